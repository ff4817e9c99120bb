"""MLflow "models from code" entry: how a registered version loads as a pyfunc (no pickled objects).
It imports only what loading a model needs (the requirements `Registry.register` declares)."""

import mlflow
import mlflow.pyfunc

from clipstream import models

ARTIFACT = "checkpoint"  # clipstream.registry.ARTIFACT: the pyfunc artifact that holds the open_clip folder


class ClipEmbedder(mlflow.pyfunc.PythonModel):
    """The registered artifact as an MLflow pyfunc: captions in, L2-normalised text embeddings out."""

    def load_context(self, context):
        self.bundle = models.load_exported(context.artifacts[ARTIFACT])

    def predict(self, context, model_input: list[str], params=None) -> list[list[float]]:
        return self.bundle.embed_texts(list(model_input)).tolist()


mlflow.models.set_model(ClipEmbedder())
