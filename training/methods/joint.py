"""Joint training (JointT): every task so far, together; the upper bound a continual method aims at."""

from training.methods.base import Method


class Joint(Method):
    name = "joint"

    def training_tasks(self, current: dict, history: list[dict]) -> list[dict]:
        return [*history, current]
