"""What a reader must read to follow one plain iteration of `python train.py` (one process, one
dataset, max_iters=1): the entry script up to its last executed line, plus the full span of
every project function entered (each once; nested ones inside a counted span are not counted
again), to the first optimizer step and for the whole 1-iteration run (eval, a checkpoint), with
the split per file. --functions lists them."""

import json
import os
import shutil
import subprocess
import sys
import tempfile

from bench.base import ROOT, RUN_KEYS


READING_PROBE = r"""
import json, os, runpy, sys
root, args = sys.argv[1], sys.argv[2:]
seen, entry, snap = {}, [0], {}
def project(path):  # the repository's own .py files, the root's and its wings', bench and tests aside
    rel = os.path.relpath(os.path.abspath(path), root)
    return (rel.endswith(".py") and rel != "bench.py" and rel.count(os.sep) <= 1
            and not rel.startswith(("..", ".", "tests" + os.sep, "bench" + os.sep)))
def hook(frame, event, arg):
    co = frame.f_code
    if event == "call" and co.co_name == "step" and not snap and ("optim" in co.co_filename or project(co.co_filename)):
        snap.update(seen=dict(seen), entry=entry[0])
    if event == "call" and co.co_flags & 0x1 and project(co.co_filename) and co not in seen:
        lines = [ln for _, _, ln in co.co_lines() if ln]
        seen[co] = (os.path.relpath(co.co_filename, root), co.co_name, co.co_firstlineno, max(lines + [co.co_firstlineno]))
def trace(frame, event, arg):
    if frame.f_code.co_filename == os.path.join(root, "train.py") and frame.f_code.co_name == "<module>":
        entry[0] = max(entry[0], frame.f_lineno)
        return trace
sys.argv = ["train.py"] + args
sys.path.insert(0, root)
sys.setprofile(hook)
sys.settrace(trace)
try:
    runpy.run_path(os.path.join(root, "train.py"), run_name="__main__")
except SystemExit:
    pass
finally:
    sys.setprofile(None)
    sys.settrace(None)
out = {"first": [snap.get("entry", 0), list(snap.get("seen", {}).values())], "run": [entry[0], list(seen.values())]}
print("READING " + json.dumps(out), file=sys.__stderr__, flush=True)
"""


def is_guard(path):
    """A guard file: guard_*.py, or any file in a folder named guard* (a wing of guards)."""
    return os.path.basename(path).startswith("guard_") or path.startswith("guard")


def reading_count(entry, funcs):
    """(total lines, {file: [(name, first, last)]}): train.py lines 1..entry plus every function
    span outside it; a span nested in another counted span of the same file is not counted again.
    The guards' files are in the split, not in the total (reading_guards counts them)."""
    kept = []
    for t in sorted(set(map(tuple, funcs)), key=lambda t: (t[0], t[2], -t[3])):
        if t[0] != "train.py" and not (kept and kept[-1][0] == t[0] and kept[-1][2] <= t[2]
                                       and t[3] <= kept[-1][3]):
            kept.append(t)
    per_file = {}
    for f, name, a, b in kept:
        per_file.setdefault(f, []).append((name, a, b))
    return entry + sum(b - a + 1 for f, _, a, b in kept if not is_guard(f)), per_file


def reading_guards(per_file):
    """The lines of guards in a reading_count split: a first read may skip them."""
    return sum(b - a + 1 for f, v in per_file.items() if is_guard(f) for _, a, b in v)


def table_reading(functions=False):
    out = os.path.join(tempfile.mkdtemp(), "out")
    args = ["max_iters=1", "sample_tokens=0", "eval_interval=1000", f"out_dir={out}", *RUN_KEYS]
    root = ROOT
    p = subprocess.run([sys.executable, "-c", READING_PROBE, root] + args, capture_output=True,
                       text=True)
    shutil.rmtree(os.path.dirname(out), ignore_errors=True)
    line = [x for x in p.stderr.splitlines() if x.startswith("READING ")]
    assert line, p.stderr[-2000:]
    res = json.loads(line[0][len("READING "):])
    print("## reading cost of one plain iteration: python train.py " + " ".join(args[:3]))
    print(f"{'':28} | {'lines':>6} | {'guards':>6} | {'files':>5} | split per file (lines / "
          "functions)")
    print("-" * 100)
    for label, key in (("to the first optimizer step", "first"),
                       ("the whole 1-iteration run", "run")):
        entry, funcs = res[key]
        total, per_file = reading_count(entry, funcs)
        split = [f"train.py 1-{entry}"] + [f"{f} {sum(b - a + 1 for _, a, b in v)}/{len(v)}"
                                            for f, v in sorted(per_file.items())]
        files = 1 + sum(not is_guard(f) for f in per_file)
        print(f"{label:28} | {total:6} | {reading_guards(per_file):6} | {files:5} | "
              + ", ".join(split))
        if functions:
            for f, v in sorted(per_file.items()):
                print(f"    {f}: " + ", ".join(f"{n} {b - a + 1}" for n, a, b in v))
