"""MLflow "models from code" entry: how a registered version loads as a pyfunc (no pickled objects).
It imports only what loading a model needs (the requirements `Registry.register` declares).

Input: a table with a `text` column (captions) and an `image` column (encoded image bytes: PNG, JPEG...; base64 in
JSON, as MLflow's scoring server reads a binary column), one of the two per row, the other null or empty. Output: each row's unit embedding,
float32, from the same model (the text tower or the image tower). `Registry.register` saves the signature and an
input example with it (`clipstream.registry.pyfunc_signature`), so `mlflow models serve` and hosted serving know the
schema."""

import mlflow
import mlflow.pyfunc
import numpy as np

from clipstream import models

ARTIFACT = "checkpoint"  # clipstream.registry.ARTIFACT: the pyfunc artifact that holds the open_clip folder


def _cells(column) -> list:
    """A column's cells, None where the row leaves it out: null, NaN (pandas' missing value) or empty (JSON cannot
    carry a null in a binary column: MLflow's server base64-decodes every cell, so a row without an image sends "")."""
    return [None if x is None or (isinstance(x, float) and np.isnan(x)) or (isinstance(x, (str, bytes)) and not x)
            else x for x in column]


class ClipEmbedder(mlflow.pyfunc.PythonModel):
    """The registered artifact as an MLflow pyfunc: captions or images in, L2-normalised embeddings out."""

    def load_context(self, context):
        self.bundle = models.load_exported(context.artifacts[ARTIFACT])

    def predict(self, context, model_input, params=None) -> list[list[float]]:
        rows = len(model_input)
        texts = _cells(model_input["text"]) if "text" in model_input else [None] * rows
        images = _cells(model_input["image"]) if "image" in model_input else [None] * rows
        both = [i for i in range(rows) if (texts[i] is None) == (images[i] is None)]
        if both:
            raise ValueError(f"rows {both[:5]} give {'both' if texts[both[0]] is not None else 'neither'} text and "
                             "image: each row embeds one of them")
        out = np.zeros((rows, self.bundle.embed_dim), np.float32)
        t = [i for i in range(rows) if texts[i] is not None]
        m = [i for i in range(rows) if images[i] is not None]
        if t:
            out[t] = self.bundle.embed_texts([str(texts[i]) for i in t])
        if m:
            out[m] = self.bundle.embed_images([bytes(images[i]) for i in m])
        return out.tolist()


mlflow.models.set_model(ClipEmbedder())
