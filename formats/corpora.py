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

import bz2
import fnmatch
import glob
import gzip
import lzma
import os
import sysconfig
import zlib

from guards.guard_errors import UserError, check
from guards.guard_files import check_regular, loads_json, read_json

# (.json: JSON Lines too, as `datasets` writes train.json; .xz and .bz2 through the stdlib)
# a directory's .json files that describe data rather than hold it: a dataset prepare.py wrote
# there (meta.json), or datasets' own (state.json, dataset_info.json, dataset_dict.json)
METADATA_JSON = ("meta.json", "state.json", "dataset_info.json", "dataset_dict.json")
RECORD_SUFFIXES = (".jsonl", ".jsonl.gz", ".jsonl.zst", ".jsonl.xz", ".jsonl.bz2", ".json",
                   ".parquet", ".arrow")
# the columns a Parquet record may need: the text field, or a conversation's
CHAT_COLUMNS = ("messages", "prompt", "response", "chosen", "rejected")
# the longest JSONL line read (a book is a few MB): past it, one line instead of the memory
MAX_LINE_BYTES = 256 << 20
# an Arrow record batch's columns read at once (`datasets` writes 1,000 rows a batch)
MAX_BATCH_BYTES = 1 << 30
# the bytes of a Parquet row group's columns read at once (by its metadata; at least one row)
BATCH_ROWS_BYTES = 64 << 20


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
                    rest += (line, b"\n")
                    yield _joined(rest)
                    size, n = 0, n + 1
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


def _joined(parts):
    """The parts as one bytes, the list emptied: a generator's locals outlive its yield."""
    out = b"".join(parts)
    parts.clear()
    return out


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


def _columns(path, names, text_field):
    """The columns a record needs of those a file has: text_field's or a chat's (text_field a
    tuple: exactly those, a converter's; None: every column)."""
    if text_field is None:
        return None
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
    return columns


def _parquet_rows(path, text_field):
    """Each row of a Parquet file as a dict of the columns a record needs (text_field: the text
    column, or a tuple of the columns to read; no other is read). A few kB of file can make
    gigabytes: a value a dictionary page holds once and every row names, or pages that
    decompress 10,000-fold. So text and bytes columns are read dictionary-encoded (a value that
    rows repeat is in memory once), and a row group in batches of about BATCH_ROWS_BYTES of
    its columns, by the sizes its metadata gives, each value bounded before it is decoded."""
    import pyarrow
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(path)
        columns, first = _columns(path, pf.schema_arrow.names, text_field), 1
        schema = pf.schema_arrow
        strings = [n for n in (columns or schema.names) if _is_bytes(schema.field(n).type)]
        pf = pq.ParquetFile(path, read_dictionary=strings)
        for i in range(pf.num_row_groups):
            group = pf.metadata.row_group(i)
            size = sum(group.column(c).total_uncompressed_size for c in range(group.num_columns)
                       if columns is None or group.column(c).path_in_schema.split(".")[0]
                       in columns)
            rows = max(1, min(1024, group.num_rows * BATCH_ROWS_BYTES // max(size, 1)))
            for batch in pf.iter_batches(rows, row_groups=[i], columns=columns):
                yield from _pylist(batch, path, first)
                first += batch.num_rows
    except (pyarrow.ArrowException, OSError, EOFError) as e:
        raise _corrupt(path, e) from None


def _is_bytes(type_):
    import pyarrow as pa
    return any(f(type_) for f in (pa.types.is_string, pa.types.is_large_string,
                                  pa.types.is_binary, pa.types.is_large_binary))


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


def _pylist(table, path, first):
    """A batch's rows (the first numbered `first`) as (dict, how many of its values had bytes
    replaced), as JSONL's lines read: a value past MAX_LINE_BYTES refused before it is decoded,
    invalid UTF-8 as U+FFFD, and a value Python cannot hold (a timestamp past year 9999) one
    line. A dictionary-encoded column's values are decoded once, each row naming its own."""
    import pyarrow as pa
    import pyarrow.compute as pc
    values, bad = {}, [0] * table.num_rows  # bad: values with bytes replaced, each row's
    for name, col in zip(table.column_names, table.columns):
        col = col.combine_chunks() if isinstance(col, pa.ChunkedArray) else col
        coded = pa.types.is_dictionary(col.type)
        words, index = (col.dictionary, col.indices) if coded else (col, None)
        if _is_bytes(words.type):
            lengths = pc.binary_length(words)
            long = pc.greater(lengths if index is None else pc.take(lengths, index),
                              MAX_LINE_BYTES)
            if pc.any(long).as_py():
                raise UserError(f"{path}: row {first + pc.index(long, True).as_py()}: a {name} "
                                f"of over {MAX_LINE_BYTES >> 20} MB (no document is that long: "
                                f"a decompression bomb?): leave the file out of the source")
        try:
            if _is_bytes(words.type):
                # (as bytes: pyarrow's own decoding raises on invalid UTF-8)
                raw = text = words.cast(pa.large_binary()).to_pylist()
                if pa.types.is_string(words.type) or pa.types.is_large_string(words.type):
                    text = [v if v is None else v.decode("utf-8", "replace") for v in raw]
                replaced = [v is not None and v.count(b"\xef\xbf\xbd") != t.count("\ufffd")
                            for v, t in zip(raw, text)] if text is not raw else [0] * len(raw)
                if index is not None:
                    at = index.to_pylist()
                    text = [None if j is None else text[j] for j in at]
                    replaced = [j is not None and replaced[j] for j in at]
                values[name], bad = text, [n + r for n, r in zip(bad, replaced)]
            else:
                values[name] = col.to_pylist()
        except (ValueError, OverflowError) as e:  # (UnicodeDecodeError is a ValueError)
            raise UserError(f"{path}: rows {first} to {first + table.num_rows - 1}: column "
                            f"{name} cannot be read ({type(e).__name__}: {str(e)[:80]}): fix or "
                            f"leave out the file") from None
    return zip((dict(zip(values, row)) for row in zip(*values.values())), bad)


def records(path, text_field, decode):
    """(row number, record, n_replaced) for each record: a non-blank JSONL line (numbered as in
    the file, 1 first) or a Parquet or Arrow row (its columns that text_field or a chat needs,
    or those text_field names when it is a tuple; None: all); `decode` turns a line's bytes into
    (text, n_replaced)."""
    if path.endswith(".parquet"):
        for row, (record, bad) in enumerate(_parquet_rows(path, text_field), 1):
            yield row, record, bad
        return
    if path.endswith(".arrow"):
        for row, record in enumerate(_arrow_rows(path, text_field), 1):
            yield row, record, 0
        return
    lineno = 0  # (enumerate's tuple, reused, would keep the last line's bytes alive)
    for raw in _lines(path):
        lineno += 1
        line, bad = decode(raw)
        del raw  # (a long document: its bytes and its line freed before the record is used)
        if not line.strip():
            continue
        field = text_field if isinstance(text_field, str) else text_field[0]
        record = loads_json(line, f"{path}:{lineno}", f"each line must be one JSON object such as "
                                                       f"{{\"{field}\": \"...\"}}")
        del line
        yield lineno, record, bad


# ---- a source's files: 'stdlib', a directory (or a datasets save_to_disk), a file, a glob ----


def stdlib_files():
    """The .py files of the running interpreter's standard library (site-packages excluded),
    sorted: the default corpus, present on every machine that can run this trainer."""
    root = sysconfig.get_paths()["stdlib"]
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames
                             if d not in ("site-packages", "dist-packages", "__pycache__"))
        files += [os.path.join(dirpath, f) for f in sorted(filenames) if f.endswith(".py")]
    return root, files


def resolve_source(source):
    """(kind, root, files, skipped) for 'stdlib', a directory of .txt files, a glob, or files of
    records (.jsonl and its compressions, .json, .parquet, .arrow, mixed as a glob finds them; a
    directory datasets' save_to_disk wrote: its .arrow files): each file once (a link to another
    file of the source, or a hard link, is skipped: the text would be
    in the data twice, maybe in both val and train), skipped of them."""
    if source == "stdlib":
        root, files = stdlib_files()
        return "text", root, files, 0
    if os.path.isdir(source):
        # the Arrow files of a `datasets` save_to_disk, or a corpus's files by their suffix: the
        # .txt and the records (mixed: refused below)
        files = saved_dataset(source) or [
            f for f in _walk(source) if f.lower().endswith((".txt", *RECORD_SUFFIXES))
            and os.path.basename(f) not in METADATA_JSON]
        root = source
    elif os.path.isfile(source):
        files, root = [source], os.path.dirname(source)
    else:
        found = _glob(source) if "**" in source else glob.glob(source)
        files = sorted(f for f in found if not os.path.isdir(f))
        root = os.path.dirname(source.split("*")[0]) or "."
        if not files:
            raise UserError(f"data source '{source}' not found: give 'stdlib', a directory of "
                            f".txt files, "
                            f"a glob such as 'notes/*.txt', or a .jsonl or .parquet file")
    if not files:
        raise UserError(f"no .txt, .jsonl or .parquet files under '{source}': put .txt files "
                        f"there or pass a glob or a .jsonl file")
    for f in files:  # ('a.JSONL' read as text, or skipped by a directory)
        name = os.path.basename(f)
        check(
            not name.lower().endswith((".txt", *RECORD_SUFFIXES)) or
            name.endswith((".txt", *RECORD_SUFFIXES)),
            f"{f}: its suffix is read in lower case only (.txt, .jsonl, .jsonl.gz, .jsonl.zst, "
            f".jsonl.xz, .jsonl.bz2, .json of JSON Lines, .parquet): rename it")
    check_regular(files, "leave it out of the source")
    jsonl = [is_records(f) for f in files]
    if any(jsonl) and not all(jsonl):
        raise UserError(f"data source '{source}' mixes records (.jsonl, .parquet) and other "
                        f"files: prepare them separately")
    check_readers(files)
    real = {}  # the file (device, inode) -> the name kept: the file's own rather than a link's
    for f in sorted(files, key=lambda f: (os.path.islink(f), f)):
        st = os.stat(f)
        real.setdefault((st.st_dev, st.st_ino), f)
    kept = set(real.values())
    kind = "records" if all(jsonl) else "text"
    return kind, root, [f for f in files if f in kept], len(files) - len(kept)


def _walk(top):
    """The paths of the files under `top`, sorted, each linked directory walked once: two
    links back up would make a walk that follows links without end."""
    seen, out = set(), []
    for d, dirs, names in os.walk(top, followlinks=True):
        st = os.stat(d)
        dirs.sort()
        if (st.st_dev, st.st_ino) in seen:
            dirs[:] = []
            continue
        seen.add((st.st_dev, st.st_ino))
        out += [os.path.join(d, n) for n in names]
    return sorted(out)


def _glob(pattern):
    """glob.glob(pattern, recursive=True) over _walk: '**' any run of directories, each other
    part as fnmatch has it (a name that starts with '.' only for a part that does too)."""
    parts = pattern.split(os.sep)
    fixed = next(i for i, p in enumerate(parts) if glob.has_magic(p))
    root = os.sep.join(parts[:fixed]) or (os.sep if pattern.startswith(os.sep) else ".")

    def match(names, pats):
        if not pats:
            return not names
        if pats[0] == "**":
            return any(match(names[i:], pats[1:]) for i in range(len(names) + 1)
                       if not any(n.startswith(".") for n in names[:i]))
        return (bool(names) and (pats[0].startswith(".") or not names[0].startswith("."))
                and fnmatch.fnmatchcase(names[0], pats[0]) and match(names[1:], pats[1:]))
    found = [f for f in _walk(root)
             if match(os.path.relpath(f, root).split(os.sep), parts[fixed:])]
    return [os.path.normpath(f) for f in found] if root == "." else found
