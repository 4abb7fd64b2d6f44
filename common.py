"""
What every file of the trainer uses, and nothing of the project beneath it: the error a user's
mistake raises (UserError, check) and the hook that prints it as one line, what a command
sets before torch imports (start_command: Ctrl-C and SIGTERM, a full stdout, --help from the
script's text), where an export may write (check_exports), JSON from outside read with limits
(loads_json, read_json, json_field), files written whole or not at all (write_atomic,
uninterrupted), file hashes (sha256_file), an exception in a few words (describe_error).
Every other file may import this one; it imports none of them.
"""

import ast
import atexit
import contextlib
import hashlib
import io
import json
import math
import os
import signal
import stat
import sys
import tempfile
import tokenize
import traceback

# ---------------------------------------------------------------------------------------
# errors: a user's mistake is one line that names it and the fix


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
    elif isinstance(err, KeyboardInterrupt):  # Ctrl-C or SIGTERM before the run catches them: 128 + N
        stopped(getattr(err, "signum", signal.SIGINT))
    elif isinstance(err, BrokenPipeError):  # `... --help | head` closed the pipe: the reader has what it wanted;
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # and no second complaint at exit
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
        print(f"error: standard output cannot be written ({e.strerror or e}): send it elsewhere", file=sys.__stderr__,
              flush=True)
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # (what it held goes nowhere)
        return True


def stopped(signum):
    """Ends the process stopped by signal `signum` before it finished: one line, and the exit
    a shell reports for a command that the signal killed, 128 + N (Ctrl-C: 130, SIGTERM: 143)."""
    what = "interrupted (Ctrl-C)" if signum == signal.SIGINT else f"stopped by {signal.Signals(signum).name}"
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
    # Interrupted unwinds (a half-prepared dataset is removed) to excepthook: the same line and exit.
    while frame and not frame.f_code.co_filename.startswith("<frozen importlib"):
        frame = frame.f_back
    if frame:
        stopped(signum)
    raise Interrupted(signum)


@contextlib.contextmanager
def uninterrupted():
    """The block runs whole: a SIGINT or SIGTERM meanwhile is delivered after it (a dataset
    swapped in by two renames is never left half-way)."""
    got = []
    old = {sig: signal.signal(sig, lambda n, frame: got.append(n)) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)
        for sig in got[:1]:
            signal.raise_signal(sig)


def check(ok, problem):
    """A mistake (in the config: before anything is touched): one line that names it and the fix."""
    if not ok:
        raise UserError(problem)


def describe_error(e):
    """An exception in a few words: its type and the first line of its message."""
    lines = str(e).strip().splitlines()
    return f"{type(e).__name__}: {lines[0][:160]}" if lines else type(e).__name__


# Sanity bounds of a model's sizes, far past any model trained here, checked before anything
# is built from a file's numbers; configurator.check_memory is the real bound.
MAX_SIZES = {"vocab_size": 2 ** 31 - 1, "n_layer": 4096, "n_head": 4096, "n_kv_head": 4096, "n_embd": 2 ** 17,
             "ffn_dim": 2 ** 20, "block_size": 2 ** 24, "rope_original_len": 2 ** 24, "n_experts": 2 ** 14,
             "moe_top_k": 2 ** 14, "moe_every": 4096, "moe_ffn_dim": 2 ** 20, "moe_shared_ffn_dim": 2 ** 20}


# ---- a script's --help, from its own text


def _literal(node):
    try:
        return ast.literal_eval(node) is not Ellipsis
    except ValueError:
        return False


def script_help(script, defaults=None):
    """--help: every key of `defaults` with its default and the comment beside it in `script`
    (this project's train.py or sample.py: its top-level or main()'s assignments), its section
    comments as headings: the file that owns the keys is the one source. No defaults: the keys
    are the script's first run of `key = literal` lines."""
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), script)
    with open(path) as f:
        source = f.read()
    comments = {t.start[0]: (t.start[1], t.string.lstrip("# ")) for t in
                tokenize.generate_tokens(io.StringIO(source).readline) if t.type == tokenize.COMMENT}
    lines, tree = source.splitlines(), ast.parse(source, path)
    main = [n.body for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "main"]
    if defaults is None:  # the first run of `key = literal` lines
        defaults = []
        for n in tree.body + sum(main, []):
            if isinstance(n, ast.Assign) and isinstance(n.targets[0], ast.Name) and _literal(n.value):
                defaults.append(n.targets[0].id)
            elif defaults:
                break
    assigns = {}  # key: its first assignment, the default
    for n in tree.body + sum(main, []):
        if isinstance(n, ast.Assign) and isinstance(n.targets[0], ast.Name) and n.targets[0].id in defaults:
            assigns.setdefault(n.targets[0].id, n)
    out = [f"usage: python {script} [config_file.py ...] key=value ... (or --key=value); the keys and their defaults:"]
    for prev, node in zip([None, *assigns.values()], assigns.values()):
        heading = [comments[ln][1] for ln in range(prev.end_lineno + 1 if prev else node.lineno - 1, node.lineno)
                   if comments.get(ln, (1,))[0] == 0]  # a section's heading: comments at the margin
        out += [f"\n{' '.join(heading)}"] if heading else []
        text, ln = [comments.get(node.end_lineno, (0, ""))[1]], node.end_lineno + 1
        while ln in comments and comments[ln][0] > 0 and not lines[ln - 1][:comments[ln][0]].strip():
            text, ln = text + [comments[ln][1]], ln + 1  # the comment goes on under the line
        key = f"{node.targets[0].id} = {ast.get_source_segment(source, node.value)}"
        out.append(f"  {key:<34} {' '.join(text)}".rstrip())
    return "\n".join(out)


# ---- files from outside: JSON read with limits -----------------------------------------
# Every JSON file the trainer reads (a dataset's meta.json, a checkpoint's manifest.json and
# meta.json, Hugging Face config.json and index, adapter_config.json, safetensors headers,
# metrics.jsonl) goes through loads_json: no NaN or Infinity, no integer past 40 digits, no
# nesting past MAX_JSON_DEPTH, and every failure one UserError naming the file and the fix.
# The readers then check each field they use (json_field) before anything is allocated.
MAX_JSON_DEPTH = 64
MAX_JSON_BYTES = 1 << 30


def _json_int(s):
    if len(s) > 40:  # Hugging Face's tokenizer_config.json says model_max_length 1e30 (31 digits)
        raise ValueError(f"an integer of {len(s)} digits")
    return int(s)


def _json_float(s):
    v = float(s)
    if not math.isfinite(v):
        raise ValueError(f"the number {s[:24]} is out of range")
    return v


def _json_constant(s):
    raise ValueError(f"{s} is not a number")


def _depth(obj):
    """How deeply obj's lists and dicts nest (1 for a flat one), iteratively."""
    deepest, stack = 0, [(obj, 1)]
    while stack:
        o, d = stack.pop()
        if isinstance(o, (dict, list)):
            deepest = max(deepest, d)
            if deepest > MAX_JSON_DEPTH:
                break
            stack.extend((v, d + 1) for v in (o.values() if isinstance(o, dict) else o))
    return deepest


def loads_json(text, where, fix):
    """The JSON value of `text` (str or bytes) from `where`, within the limits above; a
    UserError '{where}: {what is wrong}: {fix}' otherwise."""
    try:
        obj = json.loads(text, parse_int=_json_int, parse_float=_json_float, parse_constant=_json_constant)
    except RecursionError:
        raise UserError(f"{where}: JSON nested deeper than {MAX_JSON_DEPTH} levels: {fix}") from None
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError, the number checks
        raise UserError(f"{where}: malformed JSON ({str(e).splitlines()[0][:120]}): {fix}") from None
    if _depth(obj) > MAX_JSON_DEPTH:
        raise UserError(f"{where}: JSON nested deeper than {MAX_JSON_DEPTH} levels: {fix}")
    return obj


def read_json(path, fix, kind=dict):
    """loads_json of the regular file `path` (a directory, FIFO or device is refused without
    blocking), which must hold a JSON `kind` (dict: an object; None: anything)."""
    try:
        with os.fdopen(os.open(path, os.O_RDONLY | os.O_NONBLOCK), "rb") as f:
            size, regular = os.fstat(f.fileno()).st_size, stat.S_ISREG(os.fstat(f.fileno()).st_mode)
            check(regular, f"{path} is not a regular file: {fix}")
            check(size <= MAX_JSON_BYTES, f"{path} has {size} bytes, past the {MAX_JSON_BYTES >> 20} MB limit: {fix}")
            obj = loads_json(f.read(), path, fix)
    except OSError as e:
        raise UserError(f"{path} cannot be read ({e.strerror or e}): {fix}") from None
    check(kind is None or isinstance(obj, kind),
          f"{path} holds a JSON {type(obj).__name__}, not an {'object' if kind is dict else kind}: {fix}")
    return obj


def json_field(obj, key, kind, where, fix, lo=None, hi=None, required=True):
    """obj[key], checked: of type `kind` (int: not bool; float: int or float, finite), in
    [lo, hi] when those are given. Absent (or null) and not required: None."""
    v = obj.get(key)
    if v is None and not required:
        return None
    check(key in obj, f"{where} lacks {key}: {fix}")
    ok = (type(v) is int if kind is int else isinstance(v, (int, float)) and type(v) is not bool and math.isfinite(v)
          if kind is float else isinstance(v, kind))
    if not ok:  # (the message is made only here: str() of a large value is slow)
        what = {int: "an integer", float: "a finite number", str: "a string", bool: "true or false",
                dict: "an object", list: "a list"}.get(kind, getattr(kind, "__name__", str(kind)))
        raise UserError(f"{where}: {key}={str(v)[:60]!r} is not {what}: {fix}")
    if (lo is not None and v < lo) or (hi is not None and v > hi):
        raise UserError(f"{where}: {key}={v!r} is out of range [{lo}, {hi}]: {fix}")
    return v


# ---------------------------------------------------------------------------------------
# where a command will write, checked before it starts rather than after it has trained

RUN_FILES = (".lock", "config.json", "metrics.jsonl", "ckpt")  # what a run directory holds of its own


def check_writable(key, path):
    """key=path can be made: its nearest existing part is a directory we can create a file in."""
    near = os.path.abspath(path)
    while not os.path.lexists(near):
        near = os.path.dirname(near)
    check(os.path.isdir(near), f"{key}={path}{'' if near == os.path.abspath(path) else ': ' + near} is a file, not a "
                               f"directory (or a symlink loop): pick another {key}")
    try:  # (tried: root may not write /sys or a read-only mount either, whatever os.access says)
        os.rmdir(tempfile.mkdtemp(prefix=".writable", dir=near))
    except OSError as e:
        raise UserError(f"{key}={path} is not writable ({near}: {e.strerror}): fix its permissions or pick another "
                        f"{key}") from None


def check_exports(exports, runs=(), files=()):
    """Each key=path of `exports` (a directory to make; for a key in `files`, one file) can be
    written (check_writable); what is there may be replaced: nothing, an empty directory, or
    for a file a regular file (an earlier export), never a device or a link; it is not a run
    directory itself (`runs`, or what holds ckpt/ or metrics.jsonl) nor one of its own files
    (RUN_FILES) or checkpoints (a directory with manifest.json); and no two overlap."""
    runs, real = [os.path.realpath(r) for r in runs], {}
    for key, path in exports.items():
        if not path:
            continue
        if key in files:
            check(os.path.isdir(os.path.dirname(os.path.abspath(path))), f"{key}={path}: the directory "
                  f"{os.path.dirname(os.path.abspath(path))} does not exist: create it or export elsewhere")
            check(not os.path.isdir(path), f"{key}={path} is a directory: name the file to write, e.g. "
                                           f"{key}={os.path.join(path, 'model.pt')}")
        check_writable(key, path)
        mode = os.lstat(path).st_mode if os.path.lexists(path) else None
        check(mode is None or (stat.S_ISREG(mode) if key in files else stat.S_ISDIR(mode) and not os.listdir(path)),
              f"{key}={path} exists and is not a regular file (a device or a link): name a new file, or an earlier "
              f"export" if key in files else f"{key}={path} already exists and is not an empty directory: remove it "
              f"or export elsewhere (checked now rather than after the run has trained)")
        p = real[key] = os.path.realpath(path)
        check(not any(r == p or r.startswith(p + os.sep) for r in runs), f"{key}={path} is or holds the run "
              f"directory {runs[0] if runs else ''}: export elsewhere, e.g. {os.path.join(path, 'export')}")
        a = p
        while a != os.path.dirname(a):
            inside, a = os.path.relpath(p, os.path.dirname(a)).split(os.sep)[0], os.path.dirname(a)
            check(not os.path.isfile(os.path.join(a, "manifest.json")), f"{key}={path} is inside the checkpoint {a}: "
                  f"an export may not change a checkpoint; export elsewhere")
            run = a in runs or os.path.isdir(os.path.join(a, "ckpt")) or os.path.isfile(os.path.join(a, "metrics.jsonl"))
            check(not run or inside not in RUN_FILES, f"{key}={path} would write into the run directory {a}'s own "
                  f"{inside}: export elsewhere, e.g. {os.path.join(a, 'export')}")
    for (k1, p1), (k2, p2) in ((x, y) for x in real.items() for y in real.items() if x[0] < y[0]):
        check(not (p1 == p2 or p1.startswith(p2 + os.sep) or p2.startswith(p1 + os.sep)),
              f"{k1}={exports[k1]} and {k2}={exports[k2]} are the same directory or one holds the other: each export "
              f"needs a place of its own")


# ---------------------------------------------------------------------------------------
# files written whole, and their hashes


def write_atomic(path, write):
    """write(f) into a new file renamed to `path`: never through a link planted at either name
    (the temp file is created exclusively, O_NOFOLLOW; the rename replaces a link at `path`).
    The bytes are made in memory first: a full disk is an OSError (ENOSPC) of the write."""
    buf, tmp = io.BytesIO(), path + ".tmp"
    write(buf)
    try:
        if os.path.lexists(tmp):
            os.remove(tmp)
        with os.fdopen(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644), "wb") as f:
            f.write(buf.getbuffer())
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError:
        if os.path.lexists(tmp):  # a half-written temp file is no one's
            os.remove(tmp)
        raise


def sha256_file(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()
