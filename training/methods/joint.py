"""Joint training (JointT), the upper bound a continual method aims at: one run on the union of the tasks so far,
from the stream's start model (its version 0, else the weights its first task started from), not from the parent.
Version t of a joint stream is then "joint training up to task t", as the papers' JointT, and its R matrix row is
still defined; it stays the next version of the stream (lineage and parent as any other), and its run records the
weights it started from (param `start_model`)."""

from clipstream.training.methods.base import Method


class Joint(Method):
    name = "joint"
    starts_from_stream_start = True

    def extra_tasks(self, current, history, workdir):
        return list(history)
