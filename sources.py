"""
A corpus's files as records: JSONL plain, gzip'd or zstd'd, and Parquet, which is how public
corpora (FineWeb, The Stack, SlimPajama) and `datasets` exports ship. prepare.py turns records
into documents; this file only opens the formats, and says in one line when a file is corrupt
or truncated (prepare.py then leaves the previous dataset as it was).

Parquet is read a row group at a time and only the columns a record needs, so memory stays
bounded by the largest row group, not the file. pyarrow and zstandard are optional.
"""

import gzip
import os
import zlib

from guard_errors import UserError
from guard_files import loads_json

RECORD_SUFFIXES = (".jsonl", ".jsonl.gz", ".jsonl.zst", ".parquet")
# the columns a Parquet record may need: the text field, or a conversation's
CHAT_COLUMNS = ("messages", "prompt", "response")


def is_records(path):
    return path.endswith(RECORD_SUFFIXES)


def stem(path):
    """'notes/c.jsonl.gz' -> 'c': a dataset's default name."""
    name = os.path.basename(path)
    for suffix in sorted(RECORD_SUFFIXES + (".txt",), key=len, reverse=True):
        if name.endswith(suffix):
            return name[:-len(suffix)]
    return os.path.splitext(name)[0]


def check_readers(files):
    """Refuses a source whose formats need a library that is missing, before anything is read."""
    needs = {".parquet": "pyarrow", ".jsonl.zst": "zstandard"}
    for suffix, module in needs.items():
        if any(f.endswith(suffix) for f in files):
            try:
                __import__(module)
            except ImportError:
                raise UserError(f"reading {suffix} files needs {module}, which is not installed: "
                                f"`pip install {module}`, or convert them to .jsonl") from None


def _corrupt(path, e):
    what = str(e).splitlines()[0][:120] if str(e) else type(e).__name__
    return UserError(f"{path} is corrupt or truncated ({what}): download or write it again, "
                     f"or leave it out of the source")


def _lines(path):
    """The raw lines of a JSONL file, decompressed on the fly by its suffix."""
    broken = (OSError, EOFError, zlib.error)  # gzip's BadGzipFile is an OSError
    with open(path, "rb") as raw:
        if path.endswith(".gz"):
            f = gzip.GzipFile(fileobj=raw)
        elif path.endswith(".zst"):
            import zstandard
            f = _zst_lines(raw, zstandard)
            broken += (zstandard.ZstdError,)
        else:
            f = raw
        try:
            yield from f
        except broken as e:
            raise _corrupt(path, e) from None


def _zst_lines(raw, zstandard):
    """The lines of a zstd stream (one frame or several), and an error where it ends inside a
    frame: zstandard's stream reader gives a truncated file's first part and no word."""
    d, rest, inside = zstandard.ZstdDecompressor().decompressobj(), b"", False
    for block in iter(lambda: raw.read(1 << 20), b""):
        while block:
            out, inside, block = d.decompress(block), True, b""
            if d.eof:  # a frame ended: what follows is the next one
                block, inside = d.unused_data, False
                d = zstandard.ZstdDecompressor().decompressobj()
            *lines, rest = (rest + out).split(b"\n")
            yield from (line + b"\n" for line in lines)
    if inside:
        raise zstandard.ZstdError("the stream ends inside a frame")
    if rest:
        yield rest


def _parquet_rows(path, text_field):
    """Each row of a Parquet file as a dict of the columns a record needs."""
    import pyarrow
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(path)
        names = pf.schema_arrow.names
        # (text_field None: every column)
        columns = [c for c in (text_field, *CHAT_COLUMNS) if c in names]
        if text_field is None:
            columns = None
        elif not columns:
            raise UserError(f"{path} has no column '{text_field}' or 'messages' (its columns: "
                            f"{', '.join(names[:12])}): pass --text_field NAME for the text "
                            f"column")
        for i in range(pf.num_row_groups):
            yield from pf.read_row_group(i, columns=columns).to_pylist()
    except (pyarrow.ArrowException, OSError, EOFError) as e:
        raise _corrupt(path, e) from None


def records(path, text_field, decode):
    """(row number, record, n_replaced) for each record: a non-blank JSONL line (numbered as in
    the file, 1 first) or a Parquet row (its columns that text_field or a chat needs; None:
    all); `decode` turns a line's bytes into (text, n_replaced)."""
    if path.endswith(".parquet"):
        for row, record in enumerate(_parquet_rows(path, text_field), 1):
            yield row, record, 0
        return
    for lineno, raw in enumerate(_lines(path), 1):
        line, bad = decode(raw)
        if not line.strip():
            continue
        record = loads_json(line, f"{path}:{lineno}", f"each line must be one JSON object such as "
                                                       f"{{\"{text_field}\": \"...\"}}")
        yield lineno, record, bad
