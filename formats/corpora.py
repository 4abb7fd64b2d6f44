"""
A corpus's files as records: JSONL plain, gzip'd or zstd'd, and Parquet, which is how public
corpora (FineWeb, The Stack, SlimPajama) and `datasets` exports ship. prepare.py turns records
into documents; this file only opens the formats, and says in one line when a file is corrupt
or truncated (prepare.py then leaves the previous dataset as it was).

Parquet is read a row group at a time and only the columns a record needs, so memory stays
bounded by the largest row group, not the file. pyarrow and zstandard are optional.
"""

import bz2
import gzip
import lzma
import os
import zlib

from guards.guard_errors import UserError
from guards.guard_files import loads_json

# (.json: JSON Lines too, as `datasets` writes train.json; .xz and .bz2 through the stdlib)
RECORD_SUFFIXES = (".jsonl", ".jsonl.gz", ".jsonl.zst", ".jsonl.xz", ".jsonl.bz2", ".json",
                   ".parquet")
# the columns a Parquet record may need: the text field, or a conversation's
CHAT_COLUMNS = ("messages", "prompt", "response")
# the longest JSONL line read (a book is a few MB): past it, one line instead of the memory
MAX_LINE_BYTES = 256 << 20


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
    """The raw lines of a JSONL file, decompressed on the fly by its suffix, each at most
    MAX_LINE_BYTES: a few kB of .gz or .zst can expand to gigabytes of one endless line."""
    broken = (OSError, EOFError, zlib.error, lzma.LZMAError)  # BadGzipFile is an OSError
    if path.endswith(".zst"):
        import zstandard
        broken += (zstandard.ZstdError,)
    with open(path, "rb") as raw:
        rest, size, n = [], 0, 0  # the line so far, in pieces (joined once: no quadratic copy)
        try:
            for block in _blocks(path, raw):
                *lines, last = block.split(b"\n")
                for line in lines:
                    yield b"".join(rest) + line + b"\n"
                    rest, size, n = [], 0, n + 1
                rest.append(last)
                size += len(last)
                if size > MAX_LINE_BYTES:
                    raise UserError(f"{path}:{n + 1}: a line of over {MAX_LINE_BYTES >> 20} MB "
                                    f"(no JSONL record is that long: a decompression bomb?): "
                                    f"leave the file out of the source")
        except broken as e:
            raise _corrupt(path, e) from None
        if size:
            yield b"".join(rest)


def _blocks(path, raw):
    """The file's bytes, decompressed by its suffix, in blocks of bounded size."""
    if path.endswith(".gz"):
        f = gzip.GzipFile(fileobj=raw)
        yield from iter(lambda: f.read(1 << 20), b"")
    elif path.endswith(".zst"):
        yield from _zst_blocks(raw)
    elif path.endswith((".xz", ".bz2")):
        f = lzma.LZMAFile(raw) if path.endswith(".xz") else bz2.BZ2File(raw)
        yield from iter(lambda: f.read(1 << 20), b"")
    else:
        yield from iter(lambda: raw.read(1 << 20), b"")


def _zst_blocks(raw):
    """A zstd stream's bytes (one frame or several), and an error where it ends inside a frame:
    zstandard's stream reader gives a truncated file's first part and no word. 4 kB of input at
    a time: zstd's densest blocks (~30,000x) make at most ~128 MB of it."""
    import zstandard
    d, inside = zstandard.ZstdDecompressor().decompressobj(), False
    for block in iter(lambda: raw.read(1 << 12), b""):
        while block:
            out, inside, block = d.decompress(block), True, b""
            if d.eof:  # a frame ended: what follows is the next one
                block, inside = d.unused_data, False
                d = zstandard.ZstdDecompressor().decompressobj()
            yield out
    if inside:
        raise zstandard.ZstdError("the stream ends inside a frame")


def _parquet_rows(path, text_field):
    """Each row of a Parquet file as a dict of the columns a record needs (text_field: the text
    column, or a tuple of the columns to read; no other is read)."""
    import pyarrow
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(path)
        names = pf.schema_arrow.names
        wanted = (text_field, *CHAT_COLUMNS) if isinstance(text_field, str) else text_field
        columns = [c for c in wanted if c in names]
        if isinstance(text_field, str) and not columns:
            raise UserError(f"{path} has no column '{text_field}' or 'messages' (its columns: "
                            f"{', '.join(names[:12])}): pass --text_field NAME for the text "
                            f"column")
        if len(columns) < len(wanted) and not isinstance(text_field, str):
            raise UserError(f"{path} lacks the columns {', '.join(set(wanted) - set(columns))} "
                            f"(its columns: {', '.join(names[:12])}): give the benchmark's own "
                            f"file")
        first = 1
        for i in range(pf.num_row_groups):
            table = pf.read_row_group(i, columns=columns)
            yield from _pylist(table, path, first)
            first += table.num_rows
    except (pyarrow.ArrowException, OSError, EOFError) as e:
        raise _corrupt(path, e) from None


def _pylist(table, path, first):
    """A row group's rows (the first numbered `first`) as (dict, how many of its values had bytes
    replaced), as JSONL's lines read: a value past MAX_LINE_BYTES refused, invalid UTF-8 as
    U+FFFD, and a value Python cannot hold (a timestamp past year 9999) one line."""
    import pyarrow as pa
    import pyarrow.compute as pc
    values, bad = {}, [0] * table.num_rows  # bad: values with bytes replaced, each row's
    for name, col in zip(table.column_names, table.columns):
        text = pa.types.is_string(col.type) or pa.types.is_large_string(col.type)
        if text or pa.types.is_binary(col.type) or pa.types.is_large_binary(col.type):
            long = pc.greater(pc.binary_length(col), MAX_LINE_BYTES)
            if pc.any(long).as_py():
                raise UserError(f"{path}: row {first + pc.index(long, True).as_py()}: a {name} "
                                f"of over {MAX_LINE_BYTES >> 20} MB (no document is that long: "
                                f"a decompression bomb?): leave the file out of the source")
        try:
            if text:  # (as bytes: pyarrow's own decoding raises on invalid UTF-8)
                raw = col.cast(pa.large_binary()).to_pylist()
                values[name] = [v if v is None else v.decode("utf-8", "replace") for v in raw]
                bad = [n + (v is not None and v.count(b"\xef\xbf\xbd") != t.count("\ufffd"))
                       for n, v, t in zip(bad, raw, values[name])]
            else:
                values[name] = col.to_pylist()
        except (ValueError, OverflowError) as e:  # (UnicodeDecodeError is a ValueError)
            raise UserError(f"{path}: rows {first} to {first + table.num_rows - 1}: column "
                            f"{name} cannot be read ({type(e).__name__}: {str(e)[:80]}): fix or "
                            f"leave out the file") from None
    return zip((dict(zip(values, row)) for row in zip(*values.values())), bad)


def records(path, text_field, decode):
    """(row number, record, n_replaced) for each record: a non-blank JSONL line (numbered as in
    the file, 1 first) or a Parquet row (its columns that text_field or a chat needs, or those
    text_field names when it is a tuple); `decode` turns a line's bytes into (text, n_replaced)."""
    if path.endswith(".parquet"):
        for row, (record, bad) in enumerate(_parquet_rows(path, text_field), 1):
            yield row, record, bad
        return
    for lineno, raw in enumerate(_lines(path), 1):
        line, bad = decode(raw)
        if not line.strip():
            continue
        field = text_field if isinstance(text_field, str) else text_field[0]
        record = loads_json(line, f"{path}:{lineno}", f"each line must be one JSON object such as "
                                                       f"{{\"{field}\": \"...\"}}")
        yield lineno, record, bad
