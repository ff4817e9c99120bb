"""The Ray Train entry point, in a module that imports nothing heavy.

Ray Train's controller actor unpickles the training function, and with it the function's module; when that
was `engine`, the controller imported DeepSpeed, open_clip and transformers only to pass the function on.
This entry imports the engine where it runs: in the workers. (The dataset plan is kept light the same way:
see `data/reader.py`.)
"""


def train_loop(config: dict) -> None:
    """`TorchTrainer` entry point: `engine.train_loop` on each worker."""
    from clipstream.training.engine import train_loop as run

    run(config)
