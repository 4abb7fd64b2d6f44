"""
The guard of errors and signals: a user's mistake is one line that names it and the fix
(UserError, check, and the hook that prints it), and what a command sets before torch imports
(start_command: Ctrl-C and SIGTERM, a full stdout, --help from the script's text). A valid run
does the same without any of it. Every file may import this one; it imports only common.py.
"""

import atexit
import contextlib
import io
import os
import signal
import sys
import traceback

from common import script_help


class UserError(ValueError):
    """A mistake in what the user asked for: reported as one line, no traceback."""


def check(ok, problem):
    """A mistake (in the config: before anything is touched): one line that names it and the
    fix."""
    if not ok:
        raise UserError(problem)


def describe_error(e):
    """An exception in a few words: its type and the first line of its message."""
    lines = str(e).strip().splitlines()
    return f"{type(e).__name__}: {lines[0][:160]}" if lines else type(e).__name__


def excepthook(kind, err, tb):
    # start_command installs this (train.py then guard_dist.run_excepthook, which adds the
    # process-group cases): a UserError prints one line naming the problem and the fix;
    # anything else is a bug and keeps its full traceback. We write to the real stderr:
    # under torchrun, torch.distributed wraps this hook and captures sys.stderr.
    out = sys.__stderr__
    if isinstance(err, UserError):
        print(f"error: {err}", file=out, flush=True)
    # Ctrl-C or SIGTERM before the run catches them: 128 + N
    elif isinstance(err, KeyboardInterrupt):
        stopped(getattr(err, "signum", signal.SIGINT))
    # `... --help | head` closed the pipe: the reader has what it wanted;
    elif isinstance(err, BrokenPipeError):
        # and no second complaint at exit
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    elif not (isinstance(err, OSError) and flush_stdout()):
        traceback.print_exception(kind, err, tb, file=out)


def flush_stdout(probe=True):
    """Standard output flushed; where it cannot be (`> /dev/full`), one line that says so
    instead of a traceback, and True (at exit: exit 1). probe: also where nothing is pending."""
    try:
        sys.stdout.flush()
        if probe:  # (a failed print dropped its bytes; a full device refuses even none)
            os.write(sys.stdout.fileno(), b"")
        return False
    except io.UnsupportedOperation:  # (no file descriptor: a test's capture)
        return False
    except OSError as e:
        print(f"error: standard output cannot be written ({e.strerror or e}): send it "
              f"elsewhere", file=sys.__stderr__,
              flush=True)
        # (what it held goes nowhere)
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return True


def stopped(signum):
    """Ends the process stopped by signal `signum` before it finished: one line, and the exit
    a shell reports for a command that the signal killed, 128 + N (Ctrl-C: 130, SIGTERM: 143)."""
    what = ("interrupted "
            "(Ctrl-C)" if signum == signal.SIGINT else f"stopped by {signal.Signals(signum).name}")
    with contextlib.suppress(OSError, ValueError):  # what was printed before it
        sys.stdout.flush()
    print(f"{what}: stopped before finishing; what was written is whole, run the command again",
          file=sys.__stderr__, flush=True)
    os._exit(128 + signum)


class Interrupted(KeyboardInterrupt):
    """SIGINT or SIGTERM (signum) before a run catches them itself: unwinds as Ctrl-C does."""

    def __init__(self, signum):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def start_command(argv=(), script=None):
    """Before torch imports (seconds): _on_signal, flush_stdout, excepthook; script's --help."""
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, _on_signal)
    atexit.register(lambda: flush_stdout(probe=False) and os._exit(1))
    sys.excepthook = excepthook
    if "-h" in argv or "--help" in argv:
        raise SystemExit(print(script_help(script), flush=True))


def _on_signal(signum, frame):
    # A command's Ctrl-C (SIGINT) and SIGTERM until the run installs its own handling. While a
    # module imports (torch: seconds, a minute on a busy machine; and an import may swallow a
    # KeyboardInterrupt) nothing is written yet: one line and exit 128 + N at once. Later an
    # Interrupted unwinds (a half-prepared dataset is removed) to excepthook: the same line and
    # exit.
    while frame and not frame.f_code.co_filename.startswith("<frozen importlib"):
        frame = frame.f_back
    if frame:
        stopped(signum)
    raise Interrupted(signum)
