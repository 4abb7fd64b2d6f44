"""
The guard of a run's end by error, for train.py (its sys.excepthook): guard_errors' one line
for a user's mistake, plus what only a process group has: one line per run, not per rank, a
dead or hung peer named in one line, and a quick exit past gloo's threads. A refused run
leaves no out_dir or .lock behind.
"""

import os
import sys
import time
from datetime import timedelta

import torch.distributed as dist

import parallel
from guards import guard_errors
from guards import guard_files


def run_excepthook(kind, err, tb):
    """train.py's sys.excepthook: guard_errors' (a UserError is one line, a bug keeps its
    traceback) plus the two cases only a process group has. A collective that failed
    because a peer died or hung (gloo and NCCL raise a plain RuntimeError that names them)
    is one line too, with the backend's own first line, whole: it names the cause. And
    with a live process group we leave at once: the interpreter's shutdown with gloo's
    threads still holding work can hang or abort, which would stall torchrun's restart."""
    out = sys.__stderr__
    guard_files.remove_refused()  # a refused run leaves no out_dir or .lock behind
    if not reports(err, tb):
        # another rank tells it: one line per run, ours the last before torchrun's report. Before
        # the process group rank 0 meets the same error at about the same time: a moment's wait
        # lets its line out before torchrun, seeing this rank end, stops the others (SIGTERM)
        if not dist.is_initialized():
            time.sleep(3)
    elif (isinstance(err, RuntimeError)
          and any(s in str(err) for s in ("gloo", "NCCL", "Timed out", "timed out"))):
        print(f"error: a collective failed ({str(err).strip().splitlines()[0]}): a peer process "
              f"died or waited "
              f"longer than dist_timeout_s; check the other ranks' output, or raise "
              f"dist_timeout_s if a rank is only slow (e.g. a long save)", file=out, flush=True)
    else:
        guard_errors.excepthook(kind, err, tb)  # (Ctrl-C or SIGTERM: its line, and exit 128 + N)
    # 128 + N, as a shell reports a command the signal stopped
    if isinstance(err, KeyboardInterrupt):
        out.flush()
        os._exit(128 + getattr(err, "signum", 2))
    if dist.is_initialized():
        out.flush()
        sys.stdout.flush()
        os._exit(1)


def reports(err, tb):
    """Whether this rank prints the error that ends it. Under torchrun one line per run:
    before the process group (the config is validated) every rank meets the same error, so
    rank 0 tells it (but a rank's own device problem is its own: start_process_group); after that,
    the first rank to count itself in the rendezvous store (which outlives the workers: torchrun's
    agent holds it) tells it, and a peer that then fails in a collective because that rank left
    says nothing more."""
    if "RANK" not in os.environ:
        return True
    if not dist.is_initialized():
        while tb.tb_next is not None:
            tb = tb.tb_next
        return (os.environ["RANK"] == "0" or tb.tb_frame.f_code.co_filename == parallel.__file__
                or getattr(err, "own", False))  # (guard_env: a rank's own environment)
    try:
        store = dist.distributed_c10d._get_default_store()
        store.set_timeout(timedelta(seconds=5))
        return store.add("errors_reported", 1) == 1
    except Exception:  # no store to ask (it went down): better a line twice than none
        return True
