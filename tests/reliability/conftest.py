"""The shared served app and its index (tests/services/conftest.py), for the reliability tests that call it."""

from tests.services.conftest import indexed, served  # noqa: F401  (fixtures, by name)
