"""Everything that serves a model version."""
