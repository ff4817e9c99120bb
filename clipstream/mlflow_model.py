"""MLflow "models from code" entry: how a registered version loads as a pyfunc (no pickled objects)."""

import mlflow

from clipstream.registry import ClipEmbedder

mlflow.models.set_model(ClipEmbedder())
