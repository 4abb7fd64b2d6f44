"""Faults for the tests of the NaN guard and of async saves, injected from outside the trainer:
its code and its keys know nothing of them. The environment asks for them, read here only:

    FAULT_NAN_AT=i FAULT_NAN_STEPS=n   the loss of training iterations i .. i+n-1 becomes NaN
                                       (so do all their gradients)
    FAULT_SAVE_DELAY_S=s               every checkpoint write starts s seconds late (a slow disk)

`python tests/faults.py key=value ...` runs train.py with them (under torchrun too: it is the
script torchrun starts); conftest's in-process ranks install them before train.py runs.
"""

import math
import os
import runpy
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def nan_at(first, steps=1):
    """The environment that poisons the loss of iterations first .. first+steps-1."""
    return {"FAULT_NAN_AT": str(first), "FAULT_NAN_STEPS": str(steps)}


def install():
    """Patches model.py and checkpoint.py as the environment asks
    (nothing when it asks nothing)."""
    nan_at, nan_steps = (int(os.environ.get("FAULT_NAN_AT", -1)),
                         int(os.environ.get("FAULT_NAN_STEPS", 1)))
    delay_s = float(os.environ.get("FAULT_SAVE_DELAY_S", 0))
    if nan_at >= 0:
        poison_loss(nan_at, nan_steps)
    if delay_s:
        slow_saves(delay_s)


def poison_loss(first, steps):
    """The training loss of iterations first .. first+steps-1 (train.py's `it`) times NaN."""
    import model
    forward = model.Transformer.forward

    def poisoned(self, *args, **kw):
        logits, loss = forward(self, *args, **kw)
        it = getattr(sys.modules["__main__"], "it", -1)  # train.py runs as __main__
        if self.training and loss is not None and first <= it < first + steps:
            loss = loss * math.nan
        return logits, loss
    model.Transformer.forward = poisoned


def slow_writer(delay_s):
    """DCP's file writer, each write starting delay_s seconds late."""
    from torch.distributed.checkpoint.filesystem import FileSystemWriter

    class SlowWriter(FileSystemWriter):
        def write_data(self, plan, planner):
            time.sleep(delay_s)
            return super().write_data(plan, planner)
    return SlowWriter


def slow_saves(delay_s):
    """Each checkpoint write (checkpoint.py's) starts delay_s seconds late."""
    import checkpoint
    checkpoint.FileSystemWriter = slow_writer(delay_s)


if __name__ == "__main__":
    install()
    sys.argv = [os.path.join(ROOT, "train.py"), *sys.argv[1:]]
    runpy.run_path(sys.argv[0], run_name="__main__")
