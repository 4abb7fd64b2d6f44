"""
The NaN guard, after the step: train.py's TRAINING SECTION leaves the weights alone when the
loss or the gradient norm is not finite (the verdict is the same on every rank); here each
skipped step is reported and logged, and nan_max_consecutive non-finite ones in a row roll
the run back to its latest checkpoint, whose known bad batches are then stepped over (or stop
it: nan_action=stop). fp16's overflow skips are the loss scaler's (loss_scale.py): reported
here, never counted.
"""

import os

import checkpoint
from checkpoint import restore_streams
from rundir import truncate_metrics
from guards import guard_ckpt
from guards.guard_errors import UserError, check


class NanGuard:
    """What the guard keeps: skip_iters (the known bad iterations, which checkpoints keep and a
    rollback steps over), and the run of skipped iterations in a row (`streak` of them not
    finite, the run begun at `run_start`; fp16 overflows and known bad batches neither count
    nor break it)."""

    def __init__(self, nan_max_consecutive, nan_action, skip_iters):
        self.limit, self.action, self.skip_iters = nan_max_consecutive, nan_action, skip_iters
        self.streak, self.last, self.run_start, self.rolled_back_to = 0, None, None, None

    def report(self, skipped, it, loss, grad_norm, scaler, mesh, log):
        """Prints and logs the skipped iteration `it` (`skipped`: why); True when it makes
        nan_max_consecutive non-finite ones in a row: time to roll back. A non-finite one joins
        skip_iters."""
        if self.last is None or it != self.last + 1:  # a finite step since the last skip
            self.streak, self.run_start = 0, it
        self.last = it
        if skipped == "known bad batch":
            mesh.print0(f"iter {it}: skipped (non-finite before the rollback)")
            log({"iter": it, "loss": None, "grad_norm": None, "skipped": skipped})
            return False
        if skipped == "fp16 overflow":
            mesh.print0(f"iter {it}: fp16 gradient overflow: step skipped, loss scale "
                        f"now {scaler.scale:g}")
            log({"iter": it, "loss": loss, "skipped": skipped, "loss_scale": scaler.scale})
            return False
        self.skip_iters.add(it)
        self.streak += 1
        mesh.print0(f"iter {it}: non-finite loss {loss} / grad norm {grad_norm}: step skipped "
                    f"({self.streak} in a row, nan_max_consecutive={self.limit})")
        log({"iter": it, "loss": None, "grad_norm": None, "skipped": skipped})
        return self.streak >= self.limit

    def roll_back(self, out_dir, model, optimizer, mesh, it, scaler=None):
        """roll_back below; again (no finite step since the last rollback) when this run of
        skips began where the last rollback went. Returns the iteration to go on from."""
        again = self.rolled_back_to is not None and self.run_start == self.rolled_back_to
        back = roll_back(out_dir, model, optimizer, mesh, self.skip_iters, self.streak, it,
                         self.action, scaler, again)
        # the iterations from `back` on continue this run of skips until a finite step
        self.streak, self.last, self.run_start, self.rolled_back_to = 0, back - 1, back, back
        return back


def roll_back(out_dir, model, optimizer, mesh, skip_iters, streak, it, nan_action, scaler=None,
              again=False):
    """The NaN guard's last resort after `streak` bad iterations up to `it`: the latest
    checkpoint back into the model, the optimizer, the random streams (and fp16's loss
    scaler), metrics.jsonl cut back to it; returns its iteration. Its known bad iterations join
    skip_iters, so this time their batches are stepped over. With nan_action=stop, or nothing to
    go back to, an error; and `again` (no finite step since the last rollback): the fault is not
    in a few batches."""
    check(not again, f"{streak} more iterations in a row (up to {it}) had a non-finite loss or "
                     "gradient norm right after rolling back: the fault outlives a rollback, so "
                     "it is not a few bad batches; lower learning_rate, check the data from "
                     "there on, or resume from an earlier checkpoint")
    path = checkpoint.find(out_dir, mesh, warn=mesh.print0)
    if nan_action == "stop" or path is None:
        none = "" if path else " and there is no checkpoint to roll back to"
        raise UserError(f"{streak} iterations in a row (up to {it}) had a non-finite loss or "
                        f"gradient norm{none}: lower learning_rate, check the data around these "
                        "iterations, or raise nan_max_consecutive")
    meta, state = guard_ckpt.read_meta(path)
    checkpoint.load(path, model, optimizer)
    restore_streams(state, meta, mesh, scaler)
    skip_iters.update(meta.get("skip_iters", []))
    if mesh.master:
        truncate_metrics(os.path.join(out_dir, "metrics.jsonl"), meta["iter"])
    mesh.print0(f"rolled back to {path}: continuing from iteration {meta['iter']}, stepping over "
                f"{sorted(i for i in skip_iters if i >= meta['iter'])}")
    return meta["iter"]
