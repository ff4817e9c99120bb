"""The driver's progress bar of a training job, read from what rank 0 logs into the job's MLflow run."""

from __future__ import annotations

import logging
import threading

from clipstream import console

logger = logging.getLogger(__name__)


class Progress:
    """A progress bar of the training steps (epoch, step, loss, samples/s, ETA), drawn in the driver from what rank 0
    logs into the task's MLflow run every `train.log_every` steps (the channel the metrics take anyway; the workers'
    own output is in their log files)."""

    def __init__(self, tracking_uri: str, run_id: str, task: str, steps_per_epoch: int, epochs: int,
                 poll_s: float = 1.0):
        from mlflow import MlflowClient

        self.client, self.run_id, self.poll_s, self.epochs = MlflowClient(tracking_uri), run_id, poll_s, epochs
        self.bar = console.bar(total=steps_per_epoch * epochs, unit="step", desc=f"train {task}",
                               leave=False, mininterval=0.5, dynamic_ncols=True)
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name="clipstream-progress", daemon=True)

    def __enter__(self) -> Progress:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.thread.join()
        self.bar.close()

    def _run(self) -> None:
        while not self.stop.wait(self.poll_s):
            try:
                self.update()
            except Exception:  # a read that failed (the store busy) is tried again at the next poll
                logger.debug("progress: reading the run's metrics failed", exc_info=True)

    def update(self) -> None:
        last = {k: max(self.client.get_metric_history(self.run_id, k), key=lambda m: m.step, default=None)
                for k in ("loss", "samples_per_s", "epoch")}
        if last["loss"] is None:
            return
        self.bar.n = min(last["loss"].step, self.bar.total)
        epoch = int(last["epoch"].value) + 1 if last["epoch"] else 1
        self.bar.set_postfix_str(f"epoch {epoch}/{self.epochs} loss {last['loss'].value:.3f}"
                                 + (f" {last['samples_per_s'].value:.0f} samples/s" if last["samples_per_s"] else ""))
