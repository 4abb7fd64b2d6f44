"""
The foundation beneath the files that write or explain (checkpoints, the run directory,
prepare.py, evals, plot.py, the configurator and the guards' errors), with nothing of the
project beneath it: files written whole or not at all (write_atomic, uninterrupted), and a
script's --help from its own text (configurator.py and guard_errors.start_command print it).
The guards (errors, files from outside) are guards/guard_errors.py and guards/guard_files.py.
"""

import ast
import contextlib
import io
import os
import signal
import tokenize


@contextlib.contextmanager
def uninterrupted():
    """The block runs whole: a SIGINT or SIGTERM meanwhile is delivered after it (a dataset
    swapped in by two renames is never left half-way)."""
    got = []
    old = {sig: signal.signal(sig, lambda n, frame: got.append(n))
           for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)
        for sig in got[:1]:
            signal.raise_signal(sig)


def write_atomic(path, write):
    """write(f) into a new file renamed to `path`: never through a link planted at either name
    (the temp file is created exclusively, O_NOFOLLOW; the rename replaces a link at `path`).
    The bytes are made in memory first: a full disk is an OSError (ENOSPC) of the write."""
    buf, tmp = io.BytesIO(), path + ".tmp"
    write(buf)
    try:
        if os.path.lexists(tmp):
            os.remove(tmp)
        with os.fdopen(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644),
                       "wb") as f:
            f.write(buf.getbuffer())
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError:
        if os.path.lexists(tmp):  # a half-written temp file is no one's
            os.remove(tmp)
        raise


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
                tokenize.generate_tokens(io.StringIO(source).readline)
                if t.type == tokenize.COMMENT}
    lines, tree = source.splitlines(), ast.parse(source, path)
    main = [n.body for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "main"]
    if defaults is None:  # the first run of `key = literal` lines
        defaults = []
        for n in tree.body + sum(main, []):
            if (isinstance(n, ast.Assign) and isinstance(n.targets[0], ast.Name)
                and _literal(n.value)):
                defaults.append(n.targets[0].id)
            elif defaults:
                break
    assigns = {}  # key: its first assignment, the default
    for n in tree.body + sum(main, []):
        if (isinstance(n, ast.Assign) and isinstance(n.targets[0], ast.Name)
            and n.targets[0].id in defaults):
            assigns.setdefault(n.targets[0].id, n)
    out = [f"usage: python {script} [config_file.py ...] key=value ... (or --key=value); the keys "
           f"and their defaults:"]
    for prev, node in zip([None, *assigns.values()], assigns.values()):
        heading = [comments[ln][1]
                   for ln in range(prev.end_lineno + 1 if prev else node.lineno - 1, node.lineno)
                   # a section's heading: comments at the margin
                   if comments.get(ln, (1,))[0] == 0]
        out += [f"\n{' '.join(heading)}"] if heading else []
        text, ln = [comments.get(node.end_lineno, (0, ""))[1]], node.end_lineno + 1
        while (ln in comments and comments[ln][0] > 0
               and not lines[ln - 1][:comments[ln][0]].strip()):
            text, ln = text + [comments[ln][1]], ln + 1  # the comment goes on under the line
        key = f"{node.targets[0].id} = {ast.get_source_segment(source, node.value)}"
        out.append(f"  {key:<34} {' '.join(text)}".rstrip())
    return "\n".join(out)
