"""
This run's saves and the signals that stop it: when checkpoint.py's two halves of a save run
(with ckpt_async the write goes on in the background while the loop trains), and SIGTERM,
SIGUSR1 or Ctrl-C turned into one last save that every rank agrees on, and an exit code.
"""

import functools
import os
import signal
import sys

import checkpoint
from rundir import rng_states


class Saves:
    """This run's checkpoints. save(it, meta) starts one on every rank (with ckpt_async it is
    written in the background: the loop pauses only to copy the state to CPU); finish(now),
    once every rank has written it, makes it the latest. One save is in flight at most."""

    def __init__(self, out_dir, model, optimizer, mesh, keep, asynchronous, resumed_from):
        self.out_dir, self.model, self.optimizer, self.mesh = out_dir, model, optimizer, mesh
        self.keep, self.asynchronous, self.resumed_from = keep, asynchronous, resumed_from
        self.group = checkpoint.save_group(mesh) if asynchronous else None  # its own process group (checkpoint.py)
        self.pending = None  # the save in flight: started, not finished yet

    def save(self, it, meta):
        """Every rank writes its part (weights and optimizer state under global names: the whole
        model once, whatever the layout, so any layout resumes it); rank 0 adds every rank's RNG
        states and `meta`, the run's metadata (meta.json)."""
        self.finish(it)  # the previous save first
        self.pending = checkpoint.start_save(self.out_dir, it, self.model, self.optimizer, rng_states(self.mesh),
                                             meta, self.mesh, self.asynchronous, self.group)
        if not self.asynchronous:
            self.finish(it)

    def written(self):
        """This rank has written its part of the save in flight (the loop's all-reduce adds the answers)."""
        return self.pending is not None and checkpoint.written(self.pending)

    def finish(self, now):
        """Makes the save in flight the latest checkpoint. Every rank calls it at the same point
        (`now`: the iteration then); a failed write raises here."""
        if self.pending is not None:
            done, self.pending = self.pending, None
            path = checkpoint.finish_save(done, self.keep, self.resumed_from)
            self.mesh.print0(f"saved checkpoint {path}" + (f" (async: finished at iteration {now})"
                                                           if self.asynchronous else ""))


def catch_signals(mesh):
    """SIGTERM, SIGUSR1 (a preemption notice) and Ctrl-C: returns the list of signals received,
    which the loop's all-reduce turns into a stop that all ranks agree on (a checkpoint, exit_code)."""
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
    print(f"rank {rank}: got {signal.Signals(signum).name}: finishing this step, then saving a checkpoint "
          f"(Ctrl-C again to quit at once)", file=sys.stderr, flush=True)


