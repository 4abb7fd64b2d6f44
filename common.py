"""
What every file of the trainer uses, and nothing of the project beneath it: the error a user's
mistake raises (UserError, check) and the hook that prints it as one line, JSON from outside
read with limits (loads_json, read_json, json_field), files written whole or not at all
(write_atomic), file hashes (sha256_file), an exception in a few words (describe_error).
Every other file may import this one; it imports none of them.
"""

import hashlib
import io
import json
import math
import os
import stat
import sys
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
    elif isinstance(err, KeyboardInterrupt):  # Ctrl-C before the run catches it: every file is written whole or not
        print("interrupted (Ctrl-C): stopped before finishing; what was written is whole, run the command again",
              file=out, flush=True)
    elif isinstance(err, BrokenPipeError):  # `... --help | head` closed the pipe: the reader has what it wanted;
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # and no second complaint at exit
    else:
        traceback.print_exception(kind, err, tb, file=out)


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
