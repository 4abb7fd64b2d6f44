"""
Loss curves of one or more runs as a PNG, from their metrics.jsonl:

    python plot.py out out-dp2 runs/cpt                  # -> curves.png
    python plot.py out --x time --out time.png           # against wall time instead of tokens

Train loss (smoothed, a solid line) and val loss (dots) of each run, in one colour per run,
labelled by its out_dir; a mixture's sources get a panel each. matplotlib draws them: it is
optional (training never needs it), `pip install matplotlib` (docs/checkpoints.md). For live
curves, a run with tensorboard_log=True writes the same records as TensorBoard events:
`tensorboard --logdir out`.
"""

import argparse
import io
import math
import os
import sys

from common import write_atomic
from guards.guard_errors import UserError, check, excepthook
from guards.guard_files import check_exports, loads_json

PANEL_INCHES, DPI = (5.5, 4.0), 100  # each panel 550 x 400 pixels, side by side
# a panel per mixture source: 64 is far past any mixture's, and 35,200 pixels wide (each more
# costs matplotlib time and memory: 2,000 took 190 s and 3 GB)
MAX_PANELS = 64


def read_run(path):
    """The records of a run's metrics.jsonl (`path`: the file or its out_dir). Unlike resume,
    which drops a torn tail, a plot says so: a torn or empty log is one error line."""
    if os.path.isdir(path):
        path = os.path.join(path, "metrics.jsonl")
    check(os.path.isfile(path),
          f"{path} does not exist: give a run's out_dir (it holds metrics.jsonl) or the file")
    rows = []
    with open(path, "rb") as f:
        for n, line in enumerate(f, 1):
            r = loads_json(line, f"{path} line {n}", "the write was cut short (a killed run or a "
                                                     "full disk): resume the run, which rewrites "
                                                     "its log, or delete that line")
            check(isinstance(r, dict) and type(r.get("iter")) is int,
                  f"{path} line {n} is not a metrics record (an object with an integer 'iter'): "
                  f"this is no metrics.jsonl of train.py")
            for key in ("tokens", "elapsed_s"):  # the x axes: a string would plot as a category
                v = r.get(key)
                check(v is None or type(v) in (int, float), f"{path} line {n}: {key}="
                      f"{str(v)[:40]!r} is not a number: this is no metrics.jsonl of train.py; "
                      f"fix or delete that line")
            rows.append(r)
    check(rows,
          f"{path} is empty: the run logged nothing yet (wait for its first log_interval), or "
          f"plot another run")
    return rows


def wall_time(rows):
    """Each record's wall seconds since the run's first launch: elapsed_s restarts at 0 when a
    resumed run starts, so each later launch is shifted by where the earlier one stopped."""
    out, offset, last = [], 0.0, 0.0
    for r in rows:
        t = r.get("elapsed_s")
        if t is not None and t + offset < last:  # a new launch (a resume)
            offset = last
        out.append(None if t is None else t + offset)
        last = out[-1] if t is not None else last
    return out


def curves(rows, x_key):
    """{panel: (train [(x, loss)], val [(x, loss)])}, panel '' for the loss and one per source."""
    xs = wall_time(rows) if x_key == "time" else [r.get("tokens") for r in rows]
    panels = {}
    for r, x in zip(rows, xs):
        for key, value in r.items():
            kind, _, source = key.partition("/")
            # a skipped step (null), or a line with no x (an older log)
            if kind not in ("loss", "val_loss") or x is None \
                    or not isinstance(value, (int, float)) or not math.isfinite(value):
                continue
            train, val = panels.setdefault(source, ([], []))
            (train if kind == "loss" else val).append((x, value))
    return panels


def smooth(values, alpha):
    """An exponential moving average, bias-corrected at the start (TensorBoard's smoothing)."""
    out, avg = [], 0.0
    for i, v in enumerate(values):
        avg = alpha * avg + (1 - alpha) * v
        out.append(avg / (1 - alpha ** (i + 1)))
    return out


def plot(runs, out, x_key="tokens", alpha=0.6):
    """Draws `runs` ([(label, rows)]) into the PNG `out`; returns its (width, height) in pixels."""
    drawn = [(label, curves(rows, x_key)) for label, rows in runs]
    names = sorted({name for _, panels in drawn for name in panels})
    check(names, f"no loss in {', '.join(label for label, _ in runs)}" + (
        " with elapsed_s (a log from before wall time was recorded): plot against "
        "tokens" if x_key == "time" else ""))
    check(len(names) <= MAX_PANELS,
          f"{len(names)} loss panels (loss, and loss/<source> per mixture source) in "
          f"{', '.join(label for label, _ in runs)[:200]}: plot.py draws at most {MAX_PANELS} "
          f"side by side; plot a copy of metrics.jsonl with the sources you want to see")
    try:
        import matplotlib
    except ImportError:
        raise UserError("plot.py draws with matplotlib, which is not installed: pip install "
                        "matplotlib") from None
    matplotlib.use("Agg")  # a file, never a window
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, len(names),
                             figsize=(PANEL_INCHES[0] * len(names), PANEL_INCHES[1]), dpi=DPI,
                             squeeze=False)
    for ax, name in zip(axes[0], names):
        for i, (label, panels) in enumerate(drawn):
            train, val = panels.get(name, ([], []))
            if train:
                ax.plot([x for x, _ in train], smooth([y for _, y in train], alpha), color=f"C{i}",
                        label=label)
            if val:
                ax.plot([x for x, _ in val], [y for _, y in val], "o--", color=f"C{i}",
                        markersize=4,
                        label=f"{label} (val)")
        ax.set_title(f"source {name}" if name else "loss")
        ax.set_xlabel("wall time (s)" if x_key == "time" else "tokens")
        ax.set_ylabel("loss")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    png = io.BytesIO()
    fig.savefig(png, format="png")  # (given a name without one, matplotlib appends .png)
    plt.close(fig)
    try:
        write_atomic(out, lambda f: f.write(png.getbuffer()))
    except OSError as e:
        raise UserError(f"--out {out} cannot be written ({e.strerror or e}): pick another "
                        f"path") from None
    return int(PANEL_INCHES[0] * DPI * len(names)), int(PANEL_INCHES[1] * DPI)


class _Arguments(argparse.ArgumentParser):
    def error(self, message):  # one line, as train.py says it (not a usage block and exit 2)
        raise UserError(f"{message}: `python plot.py --help` lists the arguments")


def check_out(out, runs):
    """--out names a new PNG (or an earlier one) where train.py's exports may write: never a
    run's own files or a checkpoint, a device, a link or a directory."""
    check(out.lower().endswith(".png") and os.path.basename(out) != ".png", f"--out {out!r} is "
          f"not a .png file name: plot.py writes a PNG, name it so (e.g. --out curves.png)")
    dirs = [r if os.path.isdir(r) else os.path.dirname(r) or "." for r in runs]
    check_exports({"--out": out}, dirs, ("--out",))


def main(argv):
    ap = _Arguments(description="Loss curves of runs (their metrics.jsonl) as a PNG.")
    ap.add_argument("runs", nargs="+",
                    help="out_dirs (or metrics.jsonl files), one line each, labelled by it")
    ap.add_argument("--out", default="curves.png", help="the PNG to write (default curves.png)")
    ap.add_argument("--x", choices=("tokens", "time"), default="tokens",
                    help="the x axis: tokens, or wall seconds")
    ap.add_argument("--smooth", type=float, default=0.6,
                    help="train loss EMA factor in [0, 1) (0: raw)")
    args = ap.parse_args(argv)
    check(0 <= args.smooth < 1, f"--smooth {args.smooth} must be in [0, 1) (0: the raw loss)")
    check_out(args.out, args.runs)
    runs = [(os.path.normpath(r), read_run(r)) for r in args.runs]
    width, height = plot(runs, args.out, args.x, args.smooth)
    print(f"wrote {args.out} ({width} x {height}): {len(runs)} run(s) against {args.x}")


if __name__ == "__main__":
    sys.excepthook = excepthook
    main(sys.argv[1:])
