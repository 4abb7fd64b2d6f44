"""
A corpus's files as records: JSONL plain, gzip'd or zstd'd, Parquet, and Arrow (a directory
`datasets`' save_to_disk wrote, or one .arrow file), which is how public corpora (FineWeb, The
Stack, SlimPajama) and `datasets` exports ship. prepare.py turns records into documents; this
file only opens the formats, and says in one line when a file is corrupt or truncated
(prepare.py then leaves the previous dataset as it was).

Parquet is read a row group at a time and Arrow a record batch at a time (memory-mapped), only
the columns a record needs, so memory stays bounded by the largest group, not the file. An
Arrow batch is validated whole before a value is read: its schema and offsets are the file's
word, and a file from outside may lie. pyarrow and zstandard are optional.
"""

import gzip
import os
import zlib

from guards.guard_errors import UserError, check
from guards.guard_files import loads_json, read_json

RECORD_SUFFIXES = (".jsonl", ".jsonl.gz", ".jsonl.zst", ".parquet", ".arrow")
# the columns a Parquet record may need: the text field, or a conversation's
CHAT_COLUMNS = ("messages", "prompt", "response", "chosen", "rejected")
# the longest JSONL line read (a book is a few MB): past it, one line instead of the memory
MAX_LINE_BYTES = 256 << 20
# an Arrow record batch's columns read at once (`datasets` writes 1,000 rows a batch)
MAX_BATCH_BYTES = 1 << 30


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
    needs = {".parquet": "pyarrow", ".arrow": "pyarrow", ".jsonl.zst": "zstandard"}
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
    broken = (OSError, EOFError, zlib.error)  # gzip's BadGzipFile is an OSError
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


def _columns(path, names, text_field):
    """The columns a record needs of those a file has (text_field None: every column)."""
    columns = [c for c in (text_field, *CHAT_COLUMNS) if c in names]
    if text_field is not None and not columns:
        raise UserError(f"{path} has no column '{text_field}' or 'messages' (its columns: "
                        f"{', '.join(names[:12])}): pass --text_field NAME for the text "
                        f"column")
    return None if text_field is None else columns


def _parquet_rows(path, text_field):
    """Each row of a Parquet file as a dict of the columns a record needs."""
    import pyarrow
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(path)
        columns = _columns(path, pf.schema_arrow.names, text_field)
        for i in range(pf.num_row_groups):
            yield from pf.read_row_group(i, columns=columns).to_pylist()
    except (pyarrow.ArrowException, OSError, EOFError) as e:
        raise _corrupt(path, e) from None


def saved_dataset(root):
    """The .arrow files of a directory `datasets`' save_to_disk wrote, in order (state.json's
    _data_files; a DatasetDict's dataset_dict.json names its splits' directories), or None for
    another directory. The names are the directory's own files: no path leaves it."""
    fix = "save the dataset again with datasets' save_to_disk, or give its .arrow files"
    if os.path.isfile(os.path.join(root, "dataset_dict.json")):
        splits = read_json(os.path.join(root, "dataset_dict.json"), fix).get("splits")
        check(isinstance(splits, list) and splits and all(
            isinstance(s, str) and s == os.path.basename(s) and s not in ("", ".", "..")
            for s in splits), f"{root}/dataset_dict.json names no splits of its own: {fix}")
        return [f for split in splits for f in saved_dataset(os.path.join(root, split)) or []]
    if not os.path.isfile(os.path.join(root, "state.json")):
        return None
    files = read_json(os.path.join(root, "state.json"), fix).get("_data_files")
    names = [f.get("filename") if isinstance(f, dict) else None
             for f in (files if isinstance(files, list) and files else [None])]
    check(all(
        isinstance(n, str) and n == os.path.basename(n) and n.endswith(".arrow") for n in names),
        f"{root}/state.json lists no .arrow files of its own (_data_files): {fix}")
    return [os.path.join(root, n) for n in names]


def _arrow_batches(source):
    """The schema and record batches of an Arrow IPC file: the file format, or the stream
    format (what `datasets` writes)."""
    import pyarrow
    try:
        reader = pyarrow.ipc.open_file(source)
        return reader.schema, (reader.get_batch(i) for i in range(reader.num_record_batches))
    except pyarrow.ArrowInvalid:  # no file footer: a stream
        source.seek(0)
        reader = pyarrow.ipc.open_stream(source)
        return reader.schema, iter(reader)


def _arrow_rows(path, text_field):
    """Each row of an Arrow file as a dict of the columns a record needs, a batch at a time:
    each batch validated whole (offsets, lengths, UTF-8), then its sizes bounded, before a value
    is read."""
    import pyarrow
    import pyarrow.compute as pc

    try:
        with pyarrow.memory_map(path) as source:
            schema, batches = _arrow_batches(source)
            columns = _columns(path, schema.names, text_field)
            for batch in batches:
                batch = batch if columns is None else batch.select(columns)
                batch.validate(full=True)
                check(batch.nbytes <= MAX_BATCH_BYTES,
                      f"{path}: a record batch of {batch.nbytes >> 20:,} MB, past the "
                      f"{MAX_BATCH_BYTES >> 20:,} MB one is read in: write it in smaller "
                      f"batches (datasets: writer_batch_size)")
                for name, column in zip(batch.schema.names, batch.columns):
                    t = pyarrow.types
                    if any(f(column.type) for f in (t.is_string, t.is_large_string, t.is_binary,
                                                    t.is_large_binary)):
                        longest = pc.max(pc.binary_length(column)).as_py() or 0
                        check(longest <= MAX_LINE_BYTES,
                              f"{path}: a value of {longest >> 20:,} MB in column '{name}' (no "
                              f"document is past {MAX_LINE_BYTES >> 20} MB): leave the file out "
                              f"of the source")
                yield from batch.to_pylist()
    except (pyarrow.ArrowException, OSError, EOFError) as e:
        raise _corrupt(path, e) from None


def records(path, text_field, decode):
    """(row number, record, n_replaced) for each record: a non-blank JSONL line (numbered as in
    the file, 1 first) or a Parquet or Arrow row (its columns that text_field or a chat needs;
    None: all); `decode` turns a line's bytes into (text, n_replaced)."""
    if path.endswith((".parquet", ".arrow")):
        rows = _parquet_rows if path.endswith(".parquet") else _arrow_rows
        for row, record in enumerate(rows(path, text_field), 1):
            yield row, record, 0
        return
    for lineno, raw in enumerate(_lines(path), 1):
        line, bad = decode(raw)
        if not line.strip():
            continue
        record = loads_json(line, f"{path}:{lineno}", f"each line must be one JSON object such as "
                                                       f"{{\"{text_field}\": \"...\"}}")
        yield lineno, record, bad
