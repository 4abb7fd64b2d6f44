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
from common import UserError, check
from rundir import set_rng_states, truncate_metrics


def report(skipped, it, loss, grad_norm, streak, skip_iters, nan_max_consecutive, scaler, mesh, log):
    """Prints and logs the skipped iteration `it` (`skipped`: why); returns the number of
    non-finite ones in a row. A non-finite one joins skip_iters, which checkpoints keep."""
    if skipped == "known bad batch":
        mesh.print0(f"iter {it}: skipped (non-finite before the rollback)")
        log({"iter": it, "loss": None, "grad_norm": None, "skipped": skipped})
        return streak
    if skipped == "fp16 overflow":
        mesh.print0(f"iter {it}: fp16 gradient overflow: step skipped, loss scale now {scaler.scale:g}")
        log({"iter": it, "loss": loss, "skipped": skipped, "loss_scale": scaler.scale})
        return streak
    skip_iters.add(it)
    mesh.print0(f"iter {it}: non-finite loss {loss} / grad norm {grad_norm}: step skipped "
                f"({streak + 1} in a row, nan_max_consecutive={nan_max_consecutive})")
    log({"iter": it, "loss": None, "grad_norm": None, "skipped": skipped})
    return streak + 1


def roll_back(out_dir, model, optimizer, mesh, skip_iters, streak, it, nan_action, scaler=None, again=False):
    """The NaN guard's last resort after `streak` bad iterations up to `it`: the latest
    checkpoint back into the model, the optimizer, the random streams (and fp16's loss
    scaler), metrics.jsonl cut
    back to it; returns its iteration. Its known bad iterations join skip_iters, so this time
    their batches are stepped over. With nan_action=stop, or nothing to go back to, an error;
    and `again` (no finite step since the last rollback): the fault is not in a few batches."""
    check(not again, f"{streak} more iterations in a row (up to {it}) had a non-finite loss or gradient norm right "
                     f"after rolling back: the fault outlives a rollback, so it is not a few bad batches; lower "
                     f"learning_rate, check the data from there on, or resume from an earlier checkpoint")
    path = checkpoint.find(out_dir, mesh, warn=mesh.print0)
    if nan_action == "stop" or path is None:
        raise UserError(f"{streak} iterations in a row (up to {it}) had a non-finite loss or gradient norm"
                        f"{'' if path else ' and there is no checkpoint to roll back to'}: lower learning_rate, "
                        f"check the data around these iterations, or raise nan_max_consecutive")
    meta, state = checkpoint.read_meta(path)
    checkpoint.load(path, model, optimizer)
    set_rng_states(state, mesh, meta)
    if scaler is not None and meta.get("loss_scale"):
        scaler.load_state_dict(meta["loss_scale"])
    skip_iters.update(meta.get("skip_iters", []))
    if mesh.master:
        truncate_metrics(os.path.join(out_dir, "metrics.jsonl"), meta["iter"])
    mesh.print0(f"rolled back to {path}: continuing from iteration {meta['iter']}, stepping over "
                f"{sorted(i for i in skip_iters if i >= meta['iter'])}")
    return meta["iter"]
