"""
The guard of files from outside: JSON read with limits (loads_json, read_json, json_field),
sources that are regular files (check_regular), where an export may write (check_exports),
file hashes (sha256_file). Each either refuses bad input with one line or returns what a
plain read would.

The out_dir lock is here too: one run owns its out_dir, and a refused run leaves nothing
behind (remove_refused).
"""

import errno
import fcntl
import hashlib
import json
import math
import os
import shutil
import socket
import stat
import tempfile

from guards.guard_errors import UserError, check, describe_error

# Sanity bounds of a model's sizes, far past any model trained here, checked before anything
# is built from a file's numbers; guard_config.check_memory is the real bound.
MAX_SIZES = {"vocab_size": 2 ** 31 - 1, "n_layer": 4096, "n_head": 4096, "n_kv_head": 4096,
             "n_embd": 2 ** 17,
             "ffn_dim": 2 ** 20, "block_size": 2 ** 24, "rope_original_len": 2 ** 24,
             "n_experts": 2 ** 14,
             "moe_top_k": 2 ** 14, "moe_every": 4096, "moe_ffn_dim": 2 ** 20,
             "moe_shared_ffn_dim": 2 ** 20}
# LoRA's alpha in (0, 1e6) and dropout in [0, 1): one rule for the config (guard_config), a
# checkpoint's meta.json (guard_ckpt) and a PEFT adapter (lora.py), so that what one takes the
# others read back
LORA_ALPHA, LORA_DROPOUT = (0, 10 ** 6), (0, 1)


def lora_in_range(alpha, dropout):
    return LORA_ALPHA[0] < alpha < LORA_ALPHA[1] and LORA_DROPOUT[0] <= dropout < LORA_DROPOUT[1]


# ---- files from outside: JSON read with limits -----------------------------------------
# Every JSON file the trainer reads (a dataset's meta.json, a checkpoint's manifest.json and
# meta.json, Hugging Face config.json and index, adapter_config.json, safetensors headers,
# metrics.jsonl) goes through loads_json: no NaN or Infinity, no integer past 40 digits, no
# nesting past MAX_JSON_DEPTH, and every failure one UserError naming the file and the fix.
# The readers then check each field they use (json_field) before anything is allocated.
MAX_JSON_DEPTH = 64
# Parsed JSON takes ~50x its bytes in Python objects ("[{}, {}, ...]": 60 MB of text became
# 3.3 GB), so a file's bytes are bounded by what it is: a config, a checkpoint's meta.json or
# manifest, an index or adapter_config.json is a few kB (16 MB is far past any). Two hold
# lists that grow with what they describe and pass MAX_LIST_JSON_BYTES: a tokenizer.json (its
# vocabulary and merges: tens of MB for a 256k vocabulary) and a dataset's meta.json (the names
# of its source files: ~50 MB for a million).
MAX_JSON_BYTES = 16 << 20
MAX_LIST_JSON_BYTES = 256 << 20


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
    UserError '{where}: {what is wrong}: {fix}' otherwise. A UTF-8 BOM (Windows editors write
    one) is taken wherever JSON is read: json takes it in bytes, not in str."""
    if isinstance(text, str) and text.startswith("\ufeff"):
        text = text[1:]
    try:
        obj = json.loads(text, parse_int=_json_int, parse_float=_json_float,
                         parse_constant=_json_constant)
    except RecursionError:
        raise UserError(f"{where}: JSON nested deeper than {MAX_JSON_DEPTH} "
                        f"levels: {fix}") from None
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError, the number checks
        raise UserError(f"{where}: malformed JSON "
                        f"({str(e).splitlines()[0][:120]}): {fix}") from None
    if _depth(obj) > MAX_JSON_DEPTH:
        raise UserError(f"{where}: JSON nested deeper than {MAX_JSON_DEPTH} levels: {fix}")
    return obj


def read_json(path, fix, kind=dict, limit=MAX_JSON_BYTES):
    """loads_json of the regular file `path` of at most `limit` bytes (a directory, FIFO or
    device is refused without blocking), which must hold a JSON `kind` (dict: an object; None:
    anything)."""
    try:
        with os.fdopen(os.open(path, os.O_RDONLY | os.O_NONBLOCK), "rb") as f:
            size, regular = (os.fstat(f.fileno()).st_size,
                             stat.S_ISREG(os.fstat(f.fileno()).st_mode))
            check(regular, f"{path} is not a regular file: {fix}")
            check(size <= limit,
                  f"{path} has {size} bytes, past the {limit >> 20} MB limit: {fix}")
            obj = loads_json(f.read(), path, fix)
    except OSError as e:
        raise UserError(f"{path} cannot be read ({e.strerror or e}): {fix}") from None
    check(kind is None or isinstance(obj, kind),
          f"{path} holds a JSON {type(obj).__name__}, not "
          f"an {'object' if kind is dict else kind}: {fix}")
    return obj


def check_regular(paths, fix):
    """Each of `paths`, its links followed, is a regular file: a device or a FIFO read as one
    would never end (/dev/zero) or never start. By stat, which does not open it."""
    for path in paths:
        try:
            regular = stat.S_ISREG(os.stat(path).st_mode)
        except OSError as e:
            raise UserError(f"{path} cannot be read ({e.strerror or e}): {fix}") from None
        check(regular, f"{path} is not a regular file (a device, FIFO or directory): {fix}")


def json_field(obj, key, kind, where, fix, lo=None, hi=None, required=True):
    """obj[key], checked: of type `kind` (int: not bool; float: int or float, finite), in
    [lo, hi] when those are given. Absent (or null) and not required: None."""
    v = obj.get(key)
    if v is None and not required:
        return None
    check(key in obj, f"{where} lacks {key}: {fix}")
    ok = (type(v) is int if kind is int
          else isinstance(v, (int, float)) and type(v) is not bool and math.isfinite(v)
          if kind is float else isinstance(v, kind))
    if not ok:  # (the message is made only here: str() of a large value is slow)
        what = {int: "an integer", float: "a finite number", str: "a string",
                bool: "true or false",
                dict: "an object", list: "a list"}.get(kind, getattr(kind, "__name__", str(kind)))
        raise UserError(f"{where}: {key}={str(v)[:60]!r} is not {what}: {fix}")
    if (lo is not None and v < lo) or (hi is not None and v > hi):
        raise UserError(f"{where}: {key}={v!r} is out of range [{lo}, {hi}]: {fix}")
    return v


# what a run directory holds of its own
RUN_FILES = (".lock", "config.json", "metrics.jsonl", "ckpt")


def check_writable(key, path, file=False):
    """key=path can be made: its nearest existing part is a directory we can create a file in
    (file: path is a file, which may be there already: check_exports says which may be
    replaced)."""
    near = os.path.abspath(path)
    while not os.path.lexists(near):
        near = os.path.dirname(near)
    if file and near == os.path.abspath(path):
        near = os.path.dirname(near)
    check(os.path.isdir(near),
          f"{key}={path}{'' if near == os.path.abspath(path) else ': ' + near} is a file, not a "
          f"directory (or a symlink loop): pick another {key}")
    try:  # (tried: root may not write /sys or a read-only mount either, whatever os.access says)
        os.rmdir(tempfile.mkdtemp(prefix=".writable", dir=near))
    except OSError as e:
        raise UserError(f"{key}={path} is not writable ({near}: {e.strerror}): fix its "
                        f"permissions or pick another {key}") from None


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
            check(os.path.isdir(os.path.dirname(os.path.abspath(path))),
                  f"{key}={path}: the directory {os.path.dirname(os.path.abspath(path))} does not "
                  "exist: create it or export elsewhere")
            check(not os.path.isdir(path), f"{key}={path} is a directory: name the file to write, "
                                           f"e.g. {key}={os.path.join(path, 'model.pt')}")
        check_writable(key, path, key in files)
        mode = os.lstat(path).st_mode if os.path.lexists(path) else None
        check(mode is None
              or (stat.S_ISREG(mode) if key in files
                  else stat.S_ISDIR(mode) and not os.listdir(path)),
              f"{key}={path} exists and is not a regular file (a device or a link): name a new "
              f"file, or an earlier "
              f"export" if key in files else f"{key}={path} already exists and is not an empty "
                                             f"directory: remove it "
              f"or export elsewhere (checked now rather than after the run has trained)")
        p = real[key] = os.path.realpath(path)
        check(not any(r == p or r.startswith(p + os.sep) for r in runs),
              f"{key}={path} is or holds the run directory {runs[0] if runs else ''}: export "
              f"elsewhere, e.g. {os.path.join(path, 'export')}")
        _outside_others(f"{key}={path}", p, runs, "an export may not change a checkpoint; "
                        "export elsewhere", lambda a: f"export elsewhere, e.g. "
                                                     f"{os.path.join(a, 'export')}")
    for (k1, p1), (k2, p2) in ((x, y) for x in real.items() for y in real.items() if x[0] < y[0]):
        check(not (p1 == p2 or p1.startswith(p2 + os.sep) or p2.startswith(p1 + os.sep)),
              f"{k1}={exports[k1]} and {k2}={exports[k2]} are the same directory or one holds the "
              f"other: each export needs a place of its own")


def _outside_others(what, p, runs, in_checkpoint, fix):
    """`what` (real path p) lies neither inside a checkpoint (a directory with manifest.json)
    nor in a run directory's own files (`runs`, or what holds ckpt/ or metrics.jsonl)."""
    a = p
    while a != os.path.dirname(a):
        inside, a = os.path.relpath(p, os.path.dirname(a)).split(os.sep)[0], os.path.dirname(a)
        check(not os.path.isfile(os.path.join(a, "manifest.json")),
              f"{what} is inside the checkpoint {a}: {in_checkpoint}")
        run = (a in runs or os.path.isdir(os.path.join(a, "ckpt"))
               or os.path.isfile(os.path.join(a, "metrics.jsonl")))
        check(not run or inside not in RUN_FILES,
              f"{what} would write into the run directory {a}'s own {inside}: {fix(a)}")


# what marks a directory as someone's: a run writes its config.json into its out_dir, and
# prepare.py swaps a whole dataset directory into place
KINDS = {"manifest.json": "a checkpoint", "ckpt": "a run directory",
         "metrics.jsonl": "a run directory", ".lock": "a run directory",
         "model.safetensors": "a model directory",
         "model.safetensors.index.json": "a model directory",
         "pytorch_model.bin": "a model directory", "adapter_config.json": "a PEFT adapter",
         "meta.json": "a dataset", "train.bin": "a dataset"}


def check_place(key, path, kind):
    """key=path, the directory a run (kind 'a run directory') or a preparation ('a dataset')
    writes into, is nobody else's: it holds no file that marks another kind (KINDS), and lies
    neither inside a checkpoint nor in a run directory's own files."""
    for name, other in KINDS.items():
        check(other == kind or not os.path.lexists(os.path.join(path, name)),
              f"{key}={path} holds {name}: it is {other}, not {kind}; pick another {key}")
    _outside_others(f"{key}={path}", os.path.realpath(path), (),
                    f"pick another {key}", lambda a: f"pick another {key}")


def sha256_file(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


# ---------------------------------------------------------------------------------------
# the out_dir lock: one run owns its out_dir

def clean_stale(out_dir):
    """Removes ckpt/.tmp_iter_* directories: saves killed half-way. Only for the run that holds
    out_dir's lock (lock_out_dir): a running save's directory looks the same."""
    root = os.path.join(out_dir, "ckpt")
    for n in os.listdir(root) if os.path.isdir(root) else []:
        if n.startswith(".tmp_") and os.path.isdir(os.path.join(root, n)):
            shutil.rmtree(os.path.join(root, n), ignore_errors=True)


_held_locks = {}  # the lock files' descriptors: open until the process exits


_made = []  # what lock_out_dir created (out_dir, its .lock): removed again if the run is refused


def _regular_or_absent(path, fix):
    """A file the run writes in out_dir must be a plain file (or not there yet): never a
    link, a directory or a FIFO someone put there, which the run would write through."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISREG(st.st_mode):
        kind = ("a symbolic link" if stat.S_ISLNK(st.st_mode)
                else "a directory" if stat.S_ISDIR(st.st_mode) else "not a regular file")
        raise UserError(f"{path} is {kind}, not a file this trainer wrote: {fix}")


def lock_out_dir(out_dir):
    """Makes this process (rank 0) the only run writing to out_dir: an exclusive flock on
    out_dir/.lock until it exits (the kernel releases it however it dies), the file naming the
    holder. Returns the descriptor."""
    path = os.path.join(out_dir, ".lock")
    if path in _held_locks:  # this process holds it already
        return _held_locks[path]
    existed = os.path.isdir(out_dir)
    _check_existing(out_dir) if existed else _make(out_dir)
    made = not os.path.lexists(path)
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK, 0o644)
    except OSError as e:
        raise UserError(f"cannot open {path} ({e.strerror or e}): remove it (or pick another "
                        f"out_dir)") from None
    _made.extend([path] if made else [])
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        _refuse_busy(fd, path, out_dir, e)
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps({"host": socket.gethostname(), "pid": os.getpid()}).encode(), 0)
    except OSError as e:
        raise UserError(f"cannot write {path} ({e.strerror or e}): free disk space "
                        f"in {out_dir}") from None
    _held_locks[path] = fd
    if existed:
        clean_stale(out_dir)
    return fd


def _make(out_dir):
    try:
        os.makedirs(out_dir)
    except OSError as e:
        raise UserError(f"cannot create out_dir {out_dir} ({e.strerror or e}): pick another "
                        f"out_dir") from None
    _made.append(out_dir)


def _check_existing(out_dir):
    """A directory that was there before this run: the lock file, config.json, metrics.jsonl
    and ckpt/latest must be plain files, and ckpt a directory (never links someone planted)."""
    fix, ckpt = "remove it (or pick another out_dir)", os.path.join(out_dir, "ckpt")
    if os.path.islink(ckpt) or os.path.lexists(ckpt) and not os.path.isdir(ckpt):
        raise UserError(f"{ckpt} is {'a symbolic link' if os.path.islink(ckpt) else 'a file'}, "
                        f"not a directory this trainer made: {fix}")
    for name in (".lock", "config.json", "metrics.jsonl", os.path.join("ckpt", "latest")):
        _regular_or_absent(os.path.join(out_dir, name), fix)


def _refuse_busy(fd, path, out_dir, e):
    """The lock is taken (or locks do not work there): one line naming the holder (host, pid)."""
    holder = os.read(fd, 4096).decode(errors="replace")
    os.close(fd)
    if e.errno not in (errno.EAGAIN, errno.EACCES):
        raise UserError(f"cannot lock {path} ({describe_error(e)}): put out_dir on a filesystem "
                        f"with file locks") from None
    _made.clear()  # the other run's
    try:
        who = json.loads(holder)
        pid, host = int(who["pid"]), str(who["host"])[:100]
    except (ValueError, KeyError, TypeError):
        pid, host = "?", "?"
    raise UserError(f"out_dir {out_dir} is in use by pid {pid} on host {host} (another run): wait "
                    f"for it, or use another out_dir") from None


def remove_refused():
    """A run that ends in an error leaves nothing it made behind: the .lock it created, and
    out_dir if it created it and nothing else is in it (a run that saved keeps all). The
    excepthook calls this."""
    for path in reversed(_made):
        try:
            os.rmdir(path) if os.path.isdir(path) else os.remove(path)
        except OSError:
            pass
    _made.clear()
