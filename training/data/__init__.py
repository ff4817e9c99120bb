"""Task data: manifests and their checks, Ray Data readers, and the synthetic benchmark."""

from clipstream.training.data.task import Check, DataError, Split, Task

__all__ = ["Check", "DataError", "Split", "Task"]
