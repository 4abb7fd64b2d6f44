"""
A model's chat template is code and data from outside: the checks that keep it to its model
directory and to a bounded cost, each a refusal in one line (chat_template.py renders it).

- A file read from a model directory (the template, tokenizer.json or .model, its config,
  config.json, the weights) resolves inside it: a link to /etc/passwd is refused, a Hugging
  Face cache's links from snapshots/<rev>/ into the repository's blobs/ are followed, and so
  are the links `huggingface-cli download --local-dir` made (huggingface_hub before 0.23)
  from anywhere into a cache's models--ORG--NAME/blobs/<digest>. A
  directory or FIFO in its place, or a template past MAX_TEMPLATE_BYTES, is refused too (in
  its own file or in tokenizer_config.json).
- One conversation's rendering runs at most MAX_RENDER_S seconds and produces at most
  MAX_RENDER_CHARS characters: Sandbox refuses, before it runs, an operation that would build
  a string or list past that ('x' * 10**9, '%999999999d' % 1, 'a'.center(10**9), the same
  filters), and a timer stops loops that never end (range(100000) inside range(100000)).
  transformers bounds neither, but a trainer renders millions of rows.
- A chat dataset has replies to learn: prepare refuses a template that renders none, and a
  loss mask with no 1, or a byte other than 0 and 1, is refused when read.
"""

import contextlib
import os
import re
import signal
import stat
import string
import threading
import time

from jinja2 import pass_eval_context
from jinja2.filters import do_center, do_format, do_indent, sync_do_join, do_replace
from jinja2.sandbox import ImmutableSandboxedEnvironment

from guards.guard_errors import UserError

MAX_TEMPLATE_BYTES = 1 << 20  # the longest real ones (tool-calling templates) are ~20 kB
MAX_RENDER_CHARS = 1 << 24  # one conversation: ~4M tokens, far past any block_size
MAX_RENDER_S = 10.0  # a real template renders a conversation in milliseconds


# ---- files of a model directory ------------------------------------------------------------


def _root(model_dir):
    """Where the files of `model_dir` may resolve: the directory, or for a snapshot of Hugging
    Face's cache (models--org--name/snapshots/<rev>/) the cache's repository directory."""
    real = os.path.realpath(model_dir)
    parent = os.path.dirname(real)
    repo = os.path.dirname(parent)
    if os.path.basename(parent) == "snapshots" and os.path.basename(repo).startswith("models--"):
        return repo
    return real


# a blob of Hugging Face's cache: its git (40) or LFS (64) digest, in a repository's blobs/
BLOB = re.compile(r"[0-9a-f]{40}|[0-9a-f]{64}")


def _is_blob(real):
    """`real` is a file of a Hugging Face cache's blobs: models--ORG--NAME/blobs/<digest>. What
    a blob holds is read as hostile as any file; only where it may lie is decided here."""
    blobs = os.path.dirname(real)
    return (BLOB.fullmatch(os.path.basename(real)) is not None
            and os.path.basename(blobs) == "blobs"
            and os.path.basename(os.path.dirname(blobs)).startswith("models--"))


def check_in_model_dir(path, fix):
    """`path` (a file of a model directory) resolves inside that directory (see _root), or to a
    blob of a Hugging Face cache, and is a regular file, not a directory, FIFO or device."""
    root, real = _root(os.path.dirname(os.path.abspath(path))), os.path.realpath(path)
    if os.path.commonpath([root, real]) != root and not _is_blob(real):
        raise UserError(f"{path} is a link to {real}, outside its model directory {root}: "
                        f"replace the link with the file itself ({fix})")
    if os.path.exists(real) and not stat.S_ISREG(os.stat(real).st_mode):
        raise UserError(f"{path} is not a regular file (a directory, FIFO or device): {fix}")


def read_template(path):
    """The text of a chat template file (chat_template.jinja), read as a plain read would."""
    fix = ("put the model's chat_template.jinja back, or remove it (conversations then use the "
           "project's template)")
    check_in_model_dir(path, fix)
    try:
        with os.fdopen(os.open(path, os.O_RDONLY | os.O_NONBLOCK), "rb") as f:
            data = f.read(MAX_TEMPLATE_BYTES + 1)
    except OSError as e:
        raise UserError(f"{path} cannot be read ({e.strerror or e}): {fix}") from None
    if len(data) > MAX_TEMPLATE_BYTES:
        raise UserError(f"{path}: more than a chat template's {MAX_TEMPLATE_BYTES:,} bytes: {fix}")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        raise UserError(f"{path}: not UTF-8 text: {fix}") from None


def check_config_template(template, where):
    """A chat_template inside tokenizer_config.json (a string, or a list of named ones) has
    the cap of the file."""
    texts = template if isinstance(template, list) else [template]
    texts = [t.get("template") if isinstance(t, dict) else t for t in texts]
    size = sum(len(t) for t in texts if isinstance(t, str))
    if size > MAX_TEMPLATE_BYTES:
        raise UserError(f"{where}: its chat_template has {size:,} characters, more than a chat "
                        f"template's {MAX_TEMPLATE_BYTES:,}: copy the model's "
                        f"tokenizer_config.json again")


# ---- the cost of one rendering -------------------------------------------------------------


class TooCostly(Exception):
    """A rendering past its bounds (chat_template.render reports it in one line)."""


def _refuse(what):
    raise TooCostly(f"makes more than {MAX_RENDER_CHARS:,} characters ({what})")


def _size(x):
    """About the characters x renders to: a string's length; a list's, tuple's or dict's items
    (each at least one), nested: ['a' * 16000000] * 16000000 is 16M items but 2.56e14 characters
    once printed. Counted only until it passes the bound."""
    total, stack = 0, [x]
    while stack and total <= MAX_RENDER_CHARS:
        y = stack.pop()
        if isinstance(y, str):
            total += len(y)
        elif isinstance(y, (list, tuple, dict)):
            total += len(y)
            stack.extend((*y.keys(), *y.values()) if isinstance(y, dict) else y)
    return total


def _finalize(value):
    """What {{ value }} prints, checked before str() turns a list into text (C code that
    neither the checks nor the timer can stop)."""
    if isinstance(value, (list, tuple, dict)):
        _check_width(_size(value), "a printed list")
    return value


def _check_width(n, what):
    if isinstance(n, int) and n > MAX_RENDER_CHARS:
        _refuse(what)


# a %-directive's width and precision (printf-style: '%-*.3d', '%(name)10s'), or '%%'
PERCENT = re.compile(r"%%|%(?:\([^)]*\))?[-#0 +]*(\*|\d+)?(?:\.(\*|\d+))?")


def _number(digits):
    return int(digits) if len(digits) < 20 else MAX_RENDER_CHARS + 1


def _check_percent(fmt, args):
    """fmt % args: a width or precision past the bound (given or taken by '*')."""
    if not isinstance(fmt, str):
        return
    values = args if isinstance(args, tuple) else (args,)
    for m in PERCENT.finditer(fmt):
        for given in m.groups():
            if given == "*":
                for v in values:
                    _check_width(v, "a % format's '*' width")
            elif given:
                _check_width(_number(given), "a % format's width")


def _check_format(fmt, args, kwargs):
    """fmt.format(...): a width in a field's spec past the bound (given or nested)."""
    try:
        fields = list(string.Formatter().parse(fmt))
    except ValueError:
        return  # (str.format raises it itself)
    for _, _, spec, _ in fields:
        for d in re.findall(r"\d+", spec or ""):
            _check_width(_number(d), "a format's width")
        if spec and "{" in spec:
            for v in (*args, *kwargs.values()):
                _check_width(v, "a format's nested width")


def _check_call(obj, args, kwargs):
    """A str method that could build a string past the bound, checked before it runs."""
    owner, name = getattr(obj, "__self__", None), getattr(obj, "__name__", "")
    if not isinstance(owner, str):
        return
    if name in ("center", "ljust", "rjust", "zfill") and args:
        _check_width(args[0], f"str.{name}")
    elif name == "expandtabs":
        tab = args[0] if args and isinstance(args[0], int) else 8
        _check_width(len(owner) * tab, "str.expandtabs")
    elif name == "join" and args and isinstance(args[0], (list, tuple)):
        _check_width(sum(map(_size, args[0])) + len(owner) * len(args[0]), "str.join")
    elif name == "replace" and len(args) >= 2 and all(isinstance(a, str) for a in args[:2]):
        _check_width(_replaced(owner, *args[:2]), "str.replace")


def _replaced(s, old, new):
    """The length of s.replace(old, new)."""
    return len(s) + (s.count(old) if old else len(s) + 1) * (len(new) - len(old))


def _checked_binop(op, left, right):
    if op == "*":
        n, seq = (left, right) if isinstance(left, int) else (right, left)
        if isinstance(n, int) and _size(seq):
            _check_width(n * _size(seq), f"{type(seq).__name__} * {n}")
    elif op == "%":
        _check_percent(left, right)
    elif op == "**" and isinstance(left, int) and isinstance(right, int) and abs(left) > 1:
        _check_width(right * abs(left).bit_length() // 8, "an integer power")  # (its digits)
    elif op == "+":
        _check_width(_size(left) + _size(right), "a concatenation")


@pass_eval_context
def _join(eval_ctx, value, d="", attribute=None):
    value = list(value)
    size = sum(len(str(v)) for v in value[:MAX_RENDER_CHARS]) + len(str(d)) * len(value)
    _check_width(size, "the join filter")
    return sync_do_join(eval_ctx, value, d, attribute)


@pass_eval_context
def _replace(eval_ctx, s, old, new, count=None):
    s, old, new = str(s), str(old), str(new)
    _check_width(_replaced(s, old, new), "the replace filter")
    return do_replace(eval_ctx, s, old, new, count)


def _center(value, width=80):
    _check_width(width, "the center filter")
    return do_center(value, width)


def _indent(s, width=4, first=False, blank=False):
    lines, each = str(s).count("\n") + 1, len(width) if isinstance(width, str) else width
    _check_width(lines * each, "the indent filter")
    return do_indent(s, width, first, blank)


def _format(value, *args, **kwargs):
    _check_percent(str(value), kwargs or args)
    return do_format(value, *args, **kwargs)


class Sandbox(ImmutableSandboxedEnvironment):
    """jinja2's immutable sandbox whose operations that make strings or lists check the size
    they would make first, and whose calls and lookups stop once the rendering is past its time
    (also where the timer cannot run: outside the main thread)."""
    intercepted_binops = frozenset({"*", "%", "**", "+"})
    deadline = float("inf")

    def __init__(self, **kwargs):
        super().__init__(finalize=_finalize, **kwargs)
        self.filters.update(join=_join, replace=_replace, center=_center, indent=_indent,
                            format=_format)

    def _in_time(self):
        if time.monotonic() > self.deadline:
            raise TooCostly(f"runs past {MAX_RENDER_S:g} s")

    def call_binop(self, context, operator, left, right):
        self._in_time()
        _checked_binop(operator, left, right)
        return super().call_binop(context, operator, left, right)

    def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 (jinja2's own signature)
        __self._in_time()
        joins = getattr(__obj, "__name__", "") == "join" and isinstance(
            getattr(__obj, "__self__", None), str)
        if joins and args and not isinstance(args[0], (list, tuple, str)):
            args = (list(args[0]), *args[1:])  # (a generator: its size is known once listed)
        _check_call(__obj, args, kwargs)
        out = super().call(__context, __obj, *args, **kwargs)
        if isinstance(out, str) and len(out) > MAX_RENDER_CHARS:  # a macro's output
            _refuse("a macro")
        return out

    def wrap_str_format(self, value):
        wrapped = super().wrap_str_format(value)  # (str.format is sandboxed where it is looked up)
        if wrapped is None:
            return None

        def checked(*args, **kwargs):
            mapping = value.__name__ == "format_map" and args and isinstance(args[0], dict)
            _check_format(value.__self__, args, args[0] if mapping else kwargs)
            return wrapped(*args, **kwargs)
        return checked

    def getitem(self, obj, argument):
        self._in_time()
        return super().getitem(obj, argument)

    def getattr(self, obj, attribute):
        self._in_time()
        return super().getattr(obj, attribute)


def _alarm(signum, frame):
    raise TooCostly(f"runs past {MAX_RENDER_S:g} s")


@contextlib.contextmanager
def bounded(env, where):
    """Renders in `env` (a Sandbox) within MAX_RENDER_S; the rendering's failures to stay in
    bounds (and a template nested past Python's recursion limit) as one UserError."""
    env.deadline = time.monotonic() + MAX_RENDER_S
    timer = threading.current_thread() is threading.main_thread()
    if timer:  # (a loop with no call or lookup in it: the signal stops it; again every 0.1 s)
        old = signal.signal(signal.SIGALRM, _alarm)
        signal.setitimer(signal.ITIMER_REAL, MAX_RENDER_S, 0.1)
    try:
        yield
    except (TooCostly, RecursionError, MemoryError) as e:
        what = {RecursionError: "nests past Python's recursion limit",
                MemoryError: "runs out of memory"}.get(type(e), str(e))
        raise UserError(f"{where}: the chat template {what} on this conversation (a real one "
                        f"renders it in milliseconds): fix the template, or use the model's "
                        f"original one") from None
    finally:
        if timer:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, old)
        env.deadline = float("inf")


def check_output(size, where):
    """What the rendering has written so far stays within MAX_RENDER_CHARS."""
    if size > MAX_RENDER_CHARS:
        raise UserError(f"{where}: the chat template makes more than {MAX_RENDER_CHARS:,} "
                        f"characters of this conversation: fix the template, or split the "
                        f"conversation")


# ---- what a chat dataset gives the loss ------------------------------------------------------


def check_learned(chat, learned, source):
    """A chat dataset whose template rendered some reply (the loss counts only those)."""
    if chat and not sum(learned.values()):
        raise UserError(f"data source '{source}': the chat template renders no assistant reply "
                        f"(0 tokens for the loss to count), so a run would learn nothing: fix the "
                        f"template, or check the roles")


def check_mask(mask, path):
    """A chat dataset's loss mask (one byte per token): 0 or 1, and some 1 (one pass over it)."""
    top = int(mask.max()) if len(mask) else 0
    if top != 1:
        what = f"has a byte of {top}, not 0 or 1" if top else "marks no token to learn"
        raise UserError(f"{path} {what}: prepare the dataset again (from a chat template that "
                        f"renders the replies)")
