"""
torchrun's environment read as input from outside: RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR and
MASTER_PORT checked before a process group is started, each mistake one line (a traceback from
int(), a negative world that ran as one process, a rank that waited for a master nobody
named). parallel.setup then reads the same variables as it always has.
"""

import os
import socket
import time

from guards.guard_errors import UserError

FIX = ("start the run with torchrun (`torchrun --nproc_per_node=N train.py ...`), which sets "
       "them, or unset them for one process")


def _refuse(problem):
    """A UserError that this rank prints itself: before the process group only rank 0 speaks
    (guard_dist.reports), but a rank started by hand meets its own environment."""
    err = UserError(problem)
    err.own = True
    raise err


def _check(ok, problem):
    if not ok:
        _refuse(problem)


def _int(name, lo, hi=None):
    """os.environ[name] as an int in [lo, hi], or None when unset."""
    value = os.environ.get(name)
    if value is None:
        return None
    try:
        n = int(value)
    except ValueError:
        n = None
    bound = f"in [{lo}, {hi}]" if hi is not None else f">= {lo}"
    _check(n is not None and n >= lo and (hi is None or n <= hi),
           f"{name}={value[:40]!r} is not a whole number {bound}: {FIX}")
    return n


def world_size():
    """The number of processes of this run (1 without torchrun), its variables checked: the
    rank inside the world, and with a rank the address and port of the master to meet."""
    world, rank = _int("WORLD_SIZE", 1), _int("RANK", 0)
    if rank is None:  # (WORLD_SIZE alone: validated as that world, as tests of the layouts do)
        return world or 1
    local, port = _int("LOCAL_RANK", 0), _int("MASTER_PORT", 1, 65535)
    _check(world is not None, f"RANK={rank} is set but WORLD_SIZE is not: {FIX}")
    _check(rank < world, f"RANK={rank} is not below WORLD_SIZE={world}: {FIX}")
    _check(local is not None, f"RANK={rank} is set but LOCAL_RANK is not: {FIX}")
    _check(os.environ.get("MASTER_ADDR") and port is not None, f"RANK={rank} WORLD_SIZE={world} "
           f"without MASTER_ADDR and MASTER_PORT: the ranks cannot meet; {FIX}")
    return world


def check_trace_dir(out_dir):
    """profile_iters' traces go to out_dir/trace/: it is a directory, or absent."""
    trace = os.path.join(out_dir, "trace")
    if os.path.lexists(trace) and not os.path.isdir(trace):
        _refuse(f"{trace} is not a directory, and profile_iters writes its traces there: "
                        f"move it away, or pick another out_dir")


def wait_for_master(timeout_s):
    """A rank that meets a master (its torchrun agent's store, or rank 0's) reaches it at
    MASTER_ADDR:MASTER_PORT within timeout_s, or one line says so (c10d would print its retries
    and C++ frames, and this rank nothing: it is not rank 0)."""
    if "RANK" not in os.environ or (os.environ["RANK"] == "0"
                                    and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True"):
        return  # (one process; or rank 0, which opens the store itself)
    addr, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            socket.create_connection((addr, port), timeout=max(0.1, min(5.0, timeout_s))).close()
            return
        except OSError as e:
            if time.monotonic() > deadline:
                _refuse(f"no master at MASTER_ADDR={addr} MASTER_PORT={port} after "
                        f"{timeout_s:g} s (dist_timeout_s; {e.strerror or e}): start rank 0 "
                        f"there, or fix the address")
            time.sleep(0.5)
