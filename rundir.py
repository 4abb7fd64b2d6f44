"""
The run directory, out_dir, and the run's logs: one run owns it (guard_files' lock), it holds the
run's config.json, metrics.jsonl (Weights & Biases or TensorBoard beside it) and checkpoints
(checkpoint.py writes them, train.py's loop decides when, origin.py reads them to decide where
the weights come from). Also the signals that stop a run with a last checkpoint (SIGTERM,
SIGUSR1, Ctrl-C), and the block that ends a run.
"""

import functools
import io
import json
import math
import os
import shlex
import signal
import sys
import time

from common import write_atomic
from guards.guard_errors import UserError
from guards.guard_files import loads_json


def write_file(path, text):
    """`text` into out_dir's file `path`, whole (common.write_atomic: a link planted at
    `path` is replaced, never written through); a full disk is one line."""
    try:
        write_atomic(path, lambda f: f.write(text.encode()))
    except OSError as e:
        raise UserError(f"cannot write {path} ({e.strerror or e}): free disk space, or fix the "
                        f"permissions of {os.path.dirname(path) or '.'}") from None


def append_metrics(path, record):
    """One line of metrics.jsonl: JSON (a non-finite number becomes null, which JSON has),
    appended without following a link; a full disk is one line."""
    clean = {k: v if not isinstance(v, float) or math.isfinite(v) else None
             for k, v in record.items()}
    try:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW, 0o644)
        with os.fdopen(fd, "a") as f:
            f.write(json.dumps(clean) + "\n")
    except OSError as e:
        raise UserError(f"cannot append to {path} ({e.strerror or e}): free disk space, then "
                        f"resume (init_from=auto)") from None


def read_metrics(path):
    """The records of a run's metrics.jsonl ([] if it is absent). A line that does not parse
    (the tail of an append cut short by a kill or a full disk) is dropped: the log must never
    block a resume."""
    rows = []
    if os.path.exists(path):
        with open(path, "rb") as f:
            for line in f:
                try:
                    r = loads_json(line, path, "")
                except UserError:  # a torn line
                    continue
                if isinstance(r, dict) and type(r.get("iter")) is int:
                    rows.append(r)
    return rows


def truncate_metrics(path, upto):
    """Keeps exactly the history up to a checkpoint at iteration `upto`: lines written after it
    (a crashed run's, or before a rollback) are computed and logged again. (A train line's
    "iter" k is step k, the (k+1)-th; a val line's "iter" k comes after k steps.)"""
    old = []
    if upto and os.path.exists(path):
        old = read_metrics(path)  # a torn last line (killed mid-append) is dropped
        old = [r for r in old if r["iter"] < upto or ("val_loss" in r and r["iter"] == upto)]
    write_file(path, "".join(json.dumps(r) + "\n" for r in old))


def start_loggers(config, out_dir, start_iter, run_id, master):
    """(the loggers beside metrics.jsonl that the config asks for, wandb's run id): wandb
    (start_wandb) and TensorBoard, on rank 0 only."""
    loggers = []
    if master and config["wandb_log"]:
        loggers.append(start_wandb(config, out_dir, config["wandb_project"],
                                   config["wandb_run_name"], run_id))
        run_id = loggers[-1].id
    if master and config["tensorboard_log"]:
        loggers.append(TensorBoard(out_dir, config["tensorboard_dir"], start_iter))
    return loggers, run_id


def log(metrics_path, loggers, record):
    """One record: a line of metrics.jsonl, and each logger's numbers at its iteration."""
    append_metrics(metrics_path, record)
    for logger in loggers:
        logger.log({k: v for k, v in record.items() if k != "iter"}, step=record["iter"])


def start_wandb(config, out_dir, project, name, run_id):
    """The Weights & Biases run `run_id` (None: a new id), started or continued (resume="allow");
    its .id is what checkpoints keep, .log() and .finish() what the loop calls."""
    import uuid
    import wandb
    try:
        return wandb.init(project=project, name=name or os.path.basename(os.path.abspath(out_dir)),
                          id=run_id or uuid.uuid4().hex[:8], resume="allow", config=config,
                          dir=out_dir)
    except Exception as e:  # no login, no network, a bad project name: the user's to fix
        raise UserError(f"wandb could not start ({type(e).__name__}: "
                        f"{(str(e).splitlines() or [''])[0][:200]}): run `wandb login`, or set "
                        f"WANDB_MODE=offline, or use wandb_log=False") from None


class TensorBoard:
    """Rank 0's records as TensorBoard event files in `path` ('': out_dir/tb; then `tensorboard
    --logdir out_dir`), through torch.utils.tensorboard, with wandb's run's .log and .finish:
    every number of a record, at its iteration. A run resumed at iteration `start` continues
    the same stream: the events from its checkpoint on are dropped (purge_step: TensorBoard
    hides the steps >= start of the earlier files), as metrics.jsonl drops them, and what
    metrics.jsonl keeps at `start` (the evaluation the checkpoint was saved after) is written
    again. A step that goes back (the NaN guard's rollback) reopens the stream there alike."""

    def __init__(self, out_dir, path, start):
        self.path, self.writer = path or os.path.join(out_dir, "tb"), None
        self.metrics_path = os.path.join(out_dir, "metrics.jsonl")
        self._open(start)

    def _open(self, start):
        from torch.utils.tensorboard import SummaryWriter  # (guard_config: it is installed)
        if self.writer is not None:
            self.writer.close()
        self.writer, self.last = SummaryWriter(self.path, purge_step=start or None), start
        for r in read_metrics(self.metrics_path) if start else []:
            if r["iter"] == start:
                self.log(r, start)

    def log(self, record, step):
        if step < self.last:
            self._open(step)
        for k, v in record.items():
            if k != "iter" and isinstance(v, (int, float)) and not isinstance(v, bool):
                self.writer.add_scalar(k, v, step)
        self.writer.flush()  # (readable while the run goes on, and after a kill)
        self.last = step

    def finish(self):
        self.writer.close()


def summary(out_dir, c, started, world, exports, stopped):
    """The block that ends a run (rank 0): the last losses (per source), tokens, wall time, mean
    speed, the newest checkpoint, the exports, and the command that continues the run."""
    rows = read_metrics(os.path.join(out_dir, "metrics.jsonl"))
    train = [r for r in rows if r.get("loss") is not None and "tok_per_s" in r]
    val = [r for r in rows if "val_loss" in r]
    losses = [f"train loss {r['loss']:.4f} (iteration {r['iter']})" for r in train[-1:]]
    losses += [f"val loss {r['val_loss']:.4f} (after {r['iter']})" for r in val[-1:]]
    losses += [f"{k} {v:.4f}" for r in train[-1:] + val[-1:] for k, v in r.items()
               if "/" in k and v is not None]
    mean = {k: sum(r[k] for r in train) / max(len(train), 1) for k in ("tok_per_s", "mfu")}
    latest = os.path.join(out_dir, "ckpt", "latest")
    with open(latest) if os.path.exists(latest) else io.StringIO("(none)") as f:
        latest = os.path.join(out_dir, "ckpt", f.read().strip())
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    launch = (["python"] if world == 1
              else ["torchrun", "--standalone", f"--nproc_per_node={world}"] if local == world
              else ["torchrun", "...(as launched, on each node)"])
    # a finished run goes on twice as long, its decay held where it ended; a stopped one as it was
    again = [a for a in sys.argv[1:]
             if stopped or not a.lstrip("-").startswith(("max_iters=", "lr_decay_iters="))]
    if not stopped:
        again += [f"max_iters={2 * c['max_iters']}",
                  f"lr_decay_iters={c['lr_decay_iters'] or c['max_iters']}"]
    return "\n".join([
        "-" * 30 + " run summary " + "-" * 30,
        ", ".join(losses),
        f"{(train[-1]['tokens'] if train else 0):,} tokens trained, {time.time() - started:.0f} s "
        f"wall time (this launch), {mean['tok_per_s']:,.0f} tok/s and mfu {mean['mfu']:.1%} (the "
        "logged iterations' mean)",
        f"checkpoint {latest}" + "".join(f"; {kind} {path}" for kind, path in exports if path),
        f"continue{'' if stopped else ' (twice as long, the decay kept where it ended)'}: "
        + shlex.join([*launch, "train.py", *again]),
        "-" * 73])


# ---------------------------------------------------------------------------------------
# the signals that stop a run with a last checkpoint


def catch_signals(mesh):
    """SIGTERM, SIGUSR1 (a preemption notice) and Ctrl-C: returns the list of signals received,
    which the loop's all-reduce turns into a stop that all ranks agree on (a checkpoint,
    exit_code)."""
    received = []
    for sig in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT):
        signal.signal(sig, functools.partial(_stop_on_signal, received, mesh.rank))
    return received


def signal_name(received):
    return signal.Signals(received[0]).name if received else "a signal (on another rank)"


def exit_code(received):
    """A run stopped by a signal exits as a shell reports a command it killed: 128 + N (a rank
    that stopped because another got it: SIGTERM's), so `train.py && sample.py` stops there."""
    return 128 + (received[0] if received else signal.SIGTERM)


def _stop_on_signal(received, rank, signum, frame):
    if signum == signal.SIGINT and received:  # a second Ctrl-C: quit at once
        os._exit(130)
    received.append(signum)
    print(f"rank {rank}: got {signal.Signals(signum).name}: finishing this step, then saving a "
          f"checkpoint (Ctrl-C again to quit at once)", file=sys.stderr, flush=True)
