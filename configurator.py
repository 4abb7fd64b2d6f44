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
`phases='[(0, {"a": 1.0})]'`).
"""

import ast
import difflib
import sys
import traceback


class UserError(ValueError):
    """A mistake in what the user asked for: reported as one line, no traceback."""


def excepthook(kind, err, tb):
    # data.py and sample.py install this (train.py installs parallel.excepthook, which adds
    # the process-group cases): a UserError prints one line naming the problem and the fix;
    # anything else is a bug and keeps its full traceback. We write to the real stderr:
    # under torchrun, torch.distributed wraps this hook and captures sys.stderr.
    out = sys.__stderr__
    if isinstance(err, UserError):
        print(f"error: {err}", file=out, flush=True)
    else:
        traceback.print_exception(kind, err, tb, file=out)


def _unknown(key, defaults, where):
    close = difflib.get_close_matches(key, list(defaults), n=1, cutoff=0.6)
    hint = f"did you mean '{close[0]}'?" if close else "see the defaults at the top of train.py"
    return UserError(f"unknown config key '{key}' {where}: {hint}")


def _typed(key, value, default, where):
    """Check `value` against the default's type; returns the value to use."""
    if default is None or type(value) is type(default):
        return value
    if type(default) is float and type(value) is int:  # dropout=0
        return float(value)
    if type(default) is list and type(value) is tuple:  # phases = ((0, {...}),)
        return list(value)
    raise UserError(f"{key}={value!r} {where} has type {type(value).__name__}, but {key} needs "
                    f"{type(default).__name__} (default {default!r})")


def _parse_value(raw, default):
    if isinstance(default, str):
        # a string key takes the text as it is, quoted or not: out_dir=runs/a, init_from='resume'
        try:
            value = ast.literal_eval(raw)
            return value if isinstance(value, str) else raw
        except (ValueError, SyntaxError):
            return raw
    try:
        return ast.literal_eval(raw)
    except (ValueError, SyntaxError):
        return raw  # a bare word: the type check below names the mismatch


def configure(defaults, argv):
    """Returns {key: value} of the overrides in argv (config files and key=value), checked
    against `defaults` (train.py's globals). Nothing here executes a command-line value."""
    overrides = {}
    for arg in argv:
        if "=" not in arg:
            if arg.startswith("-"):
                raise UserError(f"argument '{arg}' is not key=value: write e.g. --max_iters=100 or max_iters=100")
            # a config file: run it in a namespace that can see the defaults, keep what it assigned
            try:
                with open(arg) as f:
                    source = f.read()
            except OSError as e:
                raise UserError(f"cannot read config file '{arg}' ({e.strerror}): pass an existing "
                                f"file such as config/tiny.py, or key=value") from None
            scope = {k: overrides.get(k, v) for k, v in defaults.items()}
            before = dict(scope)
            try:
                exec(compile(source, arg, "exec"), scope)
            except Exception as e:  # the user's own file: name the line, not our traceback
                lines = [f.lineno for f in traceback.extract_tb(e.__traceback__) if f.filename == arg]
                line = e.lineno if isinstance(e, SyntaxError) else (lines or ["?"])[-1]
                raise UserError(f"config file {arg}:{line}: {type(e).__name__}: {e}: fix that line") from None
            for key, value in scope.items():
                if key.startswith("_") or type(value).__name__ in ("module", "function", "type"):
                    continue
                if key not in defaults:
                    raise _unknown(key, defaults, f"in {arg}")
                if key in before and value is before[key]:
                    continue
                overrides[key] = _typed(key, value, defaults[key], f"in {arg}")
        else:
            key, raw = arg.split("=", 1)
            key = key.lstrip("-")
            if key not in defaults:
                raise _unknown(key, defaults, "on the command line")
            value = _parse_value(raw, defaults[key])
            overrides[key] = _typed(key, value, defaults[key], "on the command line")
    return overrides


def script_defaults(path):
    """{key: value} of the literal top-level assignments of a script such as train.py, read
    without running it (bench.py takes the default model and batch from here)."""
    with open(path) as f:
        tree = ast.parse(f.read(), path)
    out = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            try:
                out[node.targets[0].id] = ast.literal_eval(node.value)
            except ValueError:
                pass  # computed, not a default
    return out
