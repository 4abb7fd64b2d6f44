"""
Overrides of train.py's defaults from config files and the command line:

    python train.py config/tiny.py n_layer=2 learning_rate=3e-4 --init_from=resume

A config file is plain Python assignments (`batch_size = 8`) and is executed, so it
may compute values (`n_embd = 64 * 4`); it is your own file, like a script you run.
A command-line value is never executed: it goes through ast.literal_eval, and a bare
word that is not a literal stays a string (`init_from=resume`).

Every key must already exist in train.py's defaults (a typo is an error that suggests
the closest key, in a file too), and the new value must have the default's type; an
int is accepted where the default is a float, so `dropout=0` works, and a tuple where the
default is a list (a list key, such as `phases`, is a Python literal on the command line:
`phases='[(0, {"a": 1.0})]'`). `--help` lists the keys with their defaults and comments.

The checks on the values (ranges, layouts, refused combinations) are guard_config.py's, in
one pass after this.
"""

import ast
import difflib
import math
import os
import stat
import traceback

from common import script_help
from guards.guard_errors import UserError, check


def _unknown(key, defaults, where, script):
    close = difflib.get_close_matches(key, list(defaults), n=1, cutoff=0.6)
    hint = f"did you mean '{close[0]}'?" if close else f"python {script} --help lists them"
    return UserError(f"unknown config key '{key}' {where}: {hint}")


def _typed(key, value, default, where):
    """Check `value` against the default's type; returns the value to use."""
    if default is None or type(value) is type(default):
        return value
    if type(default) is float and type(value) is int:  # dropout=0
        return float(value)
    if type(default) is list and type(value) is tuple:  # phases = ((0, {...}),)
        return list(value)
    # (the value cut to 80 characters: a line, whatever was typed)
    raise UserError(f"{key}={value!r:.80} {where} has type {type(value).__name__}, but {key} "
                    f"needs {type(default).__name__} (default {default!r})")


def _parse_value(raw, default):
    try:
        value = ast.literal_eval(raw)
    except (ValueError, SyntaxError, RecursionError, MemoryError):
        # a bare word: a string (init_from=resume), or the type check names the mismatch (a value
        # nested past the parser's depth, '-' * 5000 + '1', is no literal either)
        return raw
    # a string key takes the text as typed: out_dir=runs/a, init_from='resume', tag=1e3
    return raw if isinstance(default, str) and not isinstance(value, str) else value


def configure(defaults, argv, script="train.py"):
    """Returns {key: value} of the overrides in argv (config files and key=value), checked against
    `defaults` (`script`'s). Nothing here executes a command-line value. -h / --help: the keys."""
    overrides = {}
    for arg in argv:
        if "=" not in arg:
            if arg.startswith("-"):  # -h / --help: the keys, their defaults and comments (exit 0)
                raise (SystemExit(print(script_help(script, defaults), flush=True))
                       if arg in ("-h", "--help") else
                       UserError(f"argument '{arg}' is not key=value: write e.g. --max_iters=100 "
                                 f"or max_iters=100"))
            overrides.update(_config_file(arg, defaults, overrides, script))
            continue
        key, raw = arg.lstrip("-").split("=", 1)
        if key not in defaults:
            raise _unknown(key, defaults, "on the command line", script)
        overrides[key] = _typed(key, _parse_value(raw, defaults[key]), defaults[key],
                                "on the command line")
    return overrides


def _config_file(path, defaults, overrides, script):
    """The keys a config file assigns: it runs in a namespace that sees the defaults (and the
    overrides before it), and what it changed is kept, type-checked like the command line."""
    try:  # (opened without blocking: a FIFO or /dev/zero is refused, not read forever)
        with os.fdopen(os.open(path, os.O_RDONLY | os.O_NONBLOCK), encoding="utf-8") as f:
            check(stat.S_ISREG(os.fstat(f.fileno()).st_mode),
                  f"config file '{path}' is not a regular file: pass a file such as "
                  f"config/tiny.py, or key=value")
            source = f.read()
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f"cannot read config file '{path}' ({getattr(e, 'strerror', None) or e}): "
                        f"pass an existing file such as config/tiny.py, or key=value") from None
    scope = {k: overrides.get(k, v) for k, v in defaults.items()}
    before = dict(scope)
    try:
        exec(compile(source, path, "exec"), scope)
    except Exception as e:  # the user's own file: name the line, not our traceback
        lines = [f.lineno for f in traceback.extract_tb(e.__traceback__) if f.filename == path]
        line = e.lineno if isinstance(e, SyntaxError) else (lines or ["?"])[-1]
        raise UserError(f"config file {path}:{line}: {type(e).__name__}: {e}: fix that "
                        f"line") from None
    assigned = {}
    for key, value in scope.items():
        if key.startswith("_") or type(value).__name__ in ("module", "function", "type"):
            continue
        if key not in defaults:
            raise _unknown(key, defaults, f"in {path}", script)
        if key in before and value is before[key]:
            continue
        assigned[key] = _typed(key, value, defaults[key], f"in {path}")
    return assigned


def script_defaults(path):
    """{key: value} of the literal top-level assignments of a script such as train.py, read
    without running it (bench.py takes the default model and batch from here)."""
    with open(path) as f:
        tree = ast.parse(f.read(), path)
    out = {}
    for node in tree.body:
        if (isinstance(node, ast.Assign) and len(node.targets) == 1
            and isinstance(node.targets[0], ast.Name)):
            try:
                out[node.targets[0].id] = ast.literal_eval(node.value)
            except ValueError:
                pass  # computed, not a default
    return out


# ---- the mixture keys and the layout's batch: what the config derives before it is checked
def parse_mixture(spec, phases=()):
    """{source: weight} from 'stdlib:0.7,notes:0.3' (a source without ':w' weighs 1). A source
    is a dataset name under data/ or a directory; its name in logs and phases is its base name.
    One source is a mixture only with phases (their lr_scale); else it is dataset=, said so."""
    mixture = {}
    for part in (p.strip() for p in spec.split(",")):
        if not part:
            raise UserError(f"datasets={spec!r} has an empty entry: write e.g. "
                            f"datasets=stdlib:0.7,notes:0.3")
        source, _, w = part.rpartition(":") if ":" in part else (part, "", "1")
        try:
            weight = float(w)
        except ValueError:
            raise UserError(f"datasets: weight {w!r} of '{source}' is not a number: write "
                            f"e.g. {source}:0.5") from None
        if not weight > 0 or not math.isfinite(weight):
            raise UserError(f"datasets: '{source}' has weight {w}: weights must be positive "
                            f"(leave a source out to not use it)")
        same = [s for s in mixture if source_name(s) == source_name(source)]
        if same and same[0] != source:  # the logs and phases name a source by its base name
            raise UserError(f"datasets: {same[0]} and {source} are both named "
                            f"'{source_name(source)}': rename one of the directories")
        if same:
            raise UserError(f"datasets: '{source_name(source)}' is listed twice: list each source "
                            f"once")
        mixture[source] = weight
    if len(mixture) == 1 and not phases:
        raise UserError(f"datasets={spec!r} names one source, which is no mixture: write "
                        f"dataset={source} (datasets= "
                        f"takes two or more, e.g. datasets={source}:0.7,stdlib:0.3)")
    return mixture


def source_name(source):
    return os.path.basename(source.rstrip("/\\")) or source


def parse_phases(phases, names, max_iters=None):
    """[(start_iter, {name: weight}, lr_scale)] from `phases`: a list (a config file) or a
    string holding one (the command line), of (start, {name: weight}) or (start, weights,
    lr_scale) tuples, starts strictly increasing and >= 0. Sources a phase leaves out weigh 0.
    With max_iters (the config check): a note names the phases the run ends before."""
    if isinstance(phases, str):
        try:
            phases = ast.literal_eval(phases) if phases.strip() else []
        except (ValueError, SyntaxError):
            raise UserError(f"phases={phases!r} is not a Python literal: write e.g. '[(0, "
                            f"{{\"a\": 1.0}}), (400, {{\"a\": 0.5, \"b\": 0.5}}, 0.5)]'") from None
    example = "(400, {\"a\": 0.5, \"b\": 0.5}, 0.5)"
    if not isinstance(phases, (list, tuple)):
        raise UserError(f"phases must be a list of {example}-like tuples, "
                        f"not {type(phases).__name__}")
    out = []
    for p in phases:
        if not (isinstance(p, (list, tuple)) and len(p) in (2, 3) and isinstance(p[0], int)
                and not isinstance(p[0], bool) and isinstance(p[1], dict)):
            raise UserError(f"phase {p!r} is not (start_iter, {{source: weight}}) or (start_iter, "
                            f"weights, lr_scale): write e.g. {example}")
        start, weights, scale = p[0], p[1], (p[2] if len(p) == 3 else 1.0)
        if start < 0:
            raise UserError(f"phase at iteration {start} starts before 0: phases start at "
                            f"iteration 0 or later")
        if out and start <= out[-1][0]:
            raise UserError(f"phase at iteration {start} comes after the one at {out[-1][0]}: "
                            f"list phases by increasing start iteration, one phase per start")
        for name, w in weights.items():
            if name not in names:
                raise UserError(f"phase at iteration {start} names source '{name}', which is not "
                                f"one of {', '.join(names)}: add it to datasets= or fix the name")
            if (isinstance(w, bool) or not isinstance(w, (int, float)) or not w > 0
                or not math.isfinite(w)):
                raise UserError(f"phase at iteration {start}: '{name}' has weight {w!r}: weights "
                                f"must be positive "
                                f"(leave a source out of a phase to not draw from it)")
        if not weights:
            raise UserError(f"phase at iteration {start} has no sources: give at least one "
                            f"{{source: weight}}")
        if (isinstance(scale, bool) or not isinstance(scale, (int, float))
            or not 0 < scale < math.inf):
            raise UserError(f"phase at iteration {start}: lr_scale {scale!r} must be a positive "
                            f"number")
        out.append((start, {n: float(w) for n, w in weights.items()}, float(scale)))
    late = [start for start, _, _ in out if max_iters is not None and start >= max_iters]
    if late and os.environ.get("RANK", "0") == "0":
        print(f"note: the phases at iteration {', '.join(map(str, late))} start at or after "
              f"max_iters={max_iters}: "
              f"this run ends before them (raise max_iters, or start them earlier)", flush=True)
    return out


def mixture_sources(c, note=True):
    """A mixture's {source: weight} (mixture.py), its phases checked against them: nothing read
    yet. note: say which phases start after max_iters (once: train.py asks, the check does not)."""
    sources = parse_mixture(c["datasets"], c["phases"]) if c["datasets"] else {c["dataset"]: 1.0}
    parse_phases(c["phases"], [source_name(s) for s in sources], c["max_iters"] if note else None)
    return sources


def batch_for_layout(c, overrides, world):
    """The grad_accum_steps this layout runs: the default (2) raised to the next multiple of dp
    (of dp x pp with interleaved 1F1B) where the layout needs one, with a note, so that every
    layout runs with the defaults. A value the user gave is kept (and checked, never changed)."""
    pp, tp = c["pp"], c["tp"] * c["cp"]
    if "grad_accum_steps" in overrides or world % (pp * tp):
        return c["grad_accum_steps"]
    unit = world // (pp * tp) * (pp if c["pp_schedule"] == "interleaved" else 1)
    return _raised(c, unit) if c["grad_accum_steps"] % unit else c["grad_accum_steps"]


def _raised(c, unit):
    raised = -(-c["grad_accum_steps"] // unit) * unit
    if os.environ.get("RANK", "0") == "0":
        print(f"note: grad_accum_steps={c['grad_accum_steps']} (the default) raised to {raised}, "
              f"a multiple of the {unit} micro-batch streams of this layout (global "
              f"batch {c['batch_size'] * raised} sequences); "
              f"set grad_accum_steps= to choose", flush=True)
    return raised


def layer_counts(pp_layers):
    """pp_layers='3,1' as [3, 1] (guard_config checks it); '' as None: balanced by cost."""
    return [int(s) for s in pp_layers.split(",")] if pp_layers.strip() else None
