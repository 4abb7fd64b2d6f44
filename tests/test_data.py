import gzip
import json
import os
import sys

import numpy as np
import pytest
import torch

import data
import prepare
import tokenizer
from guards.guard_errors import UserError

TEXTS = ["def f(x):\n    return x ** 2  # square\n", "Héllo wörld — ünïcode, 日本語, emoji 🚀🎉\n",
         "    \t\n\n  trailing spaces   ", "<|endoftext|> is plain text here",
         "a" * 300 + " zzzqqq 12345678"]


@pytest.mark.parametrize("vocab_size", [257, 512, 8192])
def test_truncated_tokenizer_round_trips(vocab_size):
    enc = tokenizer.get_tokenizer("cl100k_base", vocab_size)
    assert enc.n_vocab == vocab_size and enc.eot_token == vocab_size - 1
    for text in TEXTS:
        ids = enc.encode_ordinary(text)
        assert max(ids) < vocab_size - 1  # ordinary text never produces <|endoftext|>
        assert enc.decode(ids) == text
    assert enc.encode("<|endoftext|>", allowed_special="all") == [vocab_size - 1]


def test_truncated_tokenizer_is_a_prefix_of_the_full_one():
    full, small = (tokenizer.get_tokenizer("cl100k_base"),
                   tokenizer.get_tokenizer("cl100k_base", 1000))
    assert full.n_vocab == 100277
    for i in range(999):
        assert small.decode_single_token_bytes(i) == full.decode_single_token_bytes(i)
    # fewer merges: more (shorter) tokens for the same text
    text = "".join(TEXTS)
    assert len(small.encode_ordinary(text)) > len(full.encode_ordinary(text))
    with pytest.raises(UserError, match="at least 257"):
        tokenizer.get_tokenizer("cl100k_base", 100)


def read_docs(out, split):
    meta = json.load(open(os.path.join(out, "meta.json")))
    tokens = np.fromfile(os.path.join(out, f"{split}.bin"), dtype=meta["dtype"])
    enc = tokenizer.get_tokenizer(meta["tokenizer"], meta["vocab_size"])
    assert tokens[-1] == enc.eot_token
    cuts = np.flatnonzero(tokens == enc.eot_token)
    return [enc.decode(d.tolist()) for d in np.split(tokens, cuts + 1)[:-1] for d in [d[:-1]]]


def test_prepare_directory_round_trip(tmp_path):
    src = tmp_path / "src"
    (src / "sub").mkdir(parents=True)
    texts = {f"sub/t{i}.txt" if i % 2 else f"t{i}.txt": f"document {i}: " + TEXTS[i % len(TEXTS)]
             for i in range(30)}
    for name, text in texts.items():
        (src / name).write_text(text, encoding="utf-8")
    (src / "ignored.md").write_text("not a .txt file")
    meta = prepare.prepare(str(src), str(tmp_path / "out"), "cl100k_base", 600, val_fraction=0.3,
                           workers=2, verbose=False)
    train, val = read_docs(tmp_path / "out", "train"), read_docs(tmp_path / "out", "val")
    assert sorted(train + val) == sorted(texts.values())
    assert sorted(val) == sorted(t for n, t in texts.items() if prepare.is_val(n, 0.3))
    assert meta["dtype"] == "uint16" and meta["vocab_size"] == 600
    assert (meta["train_docs"], meta["val_docs"]) == (len(train), len(val)) and len(val) > 0
    assert meta["train_tokens"] == os.path.getsize(tmp_path / "out" / "train.bin") // 2


def test_prepare_jsonl_round_trip_and_uint32(tmp_path):
    records = [{"text": f"line {i} " + TEXTS[i % len(TEXTS)], "id": i} for i in range(25)]
    path = tmp_path / "c.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in records) + "\n\n", encoding="utf-8")
    meta = prepare.prepare(str(path), str(tmp_path / "out"), "cl100k_base", 0, val_fraction=0.3,
                           verbose=False)
    # the full vocabulary does not fit uint16
    assert meta["dtype"] == "uint32" and meta["vocab_size"] == 100277
    docs = read_docs(tmp_path / "out", "train") + read_docs(tmp_path / "out", "val")
    assert sorted(docs) == sorted(r["text"] for r in records)


def test_split_is_stable_when_files_are_added(tmp_path):
    for n in (20, 40):
        src = tmp_path / f"src{n}"
        src.mkdir()
        for i in range(n):
            (src / f"f{i}.txt").write_text(f"file {i}")
        prepare.prepare(str(src), str(tmp_path / f"out{n}"), "cl100k_base", 512, val_fraction=0.3,
                        verbose=False)
    small, large = read_docs(tmp_path / "out20", "val"), read_docs(tmp_path / "out40", "val")
    assert set(small) <= set(large) and len(large) > len(small)


def test_prepare_errors(tmp_path):
    with pytest.raises(UserError, match="not found"):
        prepare.prepare(str(tmp_path / "missing"), str(tmp_path / "o"), "cl100k_base", 512)
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "a.txt").write_text("")
    with pytest.raises(UserError, match="no documents"):
        prepare.prepare(str(tmp_path / "empty"), str(tmp_path / "o"), "cl100k_base", 512,
                        verbose=False)
    (tmp_path / "nodocs").mkdir()
    with pytest.raises(UserError, match="no .txt, .jsonl or .parquet files"):
        prepare.prepare(str(tmp_path / "nodocs"), str(tmp_path / "o"), "cl100k_base", 512)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "ok"}\n{"text": "ok"}\n{"text": broken\n')
    with pytest.raises(UserError, match=r"bad.jsonl:3: malformed JSON"):
        prepare.prepare(str(bad), str(tmp_path / "o"), "cl100k_base", 512)
    bad.write_text('{"text": "ok"}\n{"body": "no text"}\n')
    with pytest.raises(UserError, match=r"bad.jsonl:2: no string field 'text'"):
        prepare.prepare(str(bad), str(tmp_path / "o"), "cl100k_base", 512)
    assert not os.path.exists(tmp_path / "o" / "meta.json")  # nothing half-written looks complete


def test_undecodable_bytes_are_replaced_and_counted(tmp_path, capsys):
    src = tmp_path / "src"
    src.mkdir()
    for i in range(10):
        (src / f"{i}.txt").write_bytes(b"caf\xe9 ok \xff\xfe end" if i == 3
                                       else b"clean text %d" % i)
    meta = prepare.prepare(str(src), str(tmp_path / "out"), "cl100k_base", 512, val_fraction=0.5)
    assert meta["replaced_bytes"] == 3
    assert "3 undecodable bytes in 1 documents were replaced" in capsys.readouterr().out
    docs = read_docs(tmp_path / "out", "train") + read_docs(tmp_path / "out", "val")
    assert "caf\ufffd ok \ufffd\ufffd end" in docs


def split_docs(out):
    """Each document's token ids (train and val), sorted, and the chat masks beside them."""
    meta = json.load(open(os.path.join(out, "meta.json")))
    docs = []
    for split in ("train", "val"):
        tokens = np.fromfile(os.path.join(out, f"{split}.bin"), dtype=meta["dtype"])
        mask_path = os.path.join(out, f"{split}.mask.bin")
        mask = (np.fromfile(mask_path, np.uint8) if os.path.exists(mask_path)
                else np.zeros_like(tokens))
        cuts = np.flatnonzero(tokens == meta["eot_token"]) + 1
        docs += [(t.tolist(), m.tolist())
                 for t, m in zip(np.split(tokens, cuts)[:-1], np.split(mask, cuts))]
    return sorted(docs)


def write_parquet(path, rows, row_group_size=4):
    import pyarrow
    import pyarrow.parquet as pq
    pq.write_table(pyarrow.Table.from_pylist(rows), path, row_group_size=row_group_size)


def test_the_same_texts_as_txt_jsonl_gz_zst_and_parquet_prepare_to_the_same_tokens(tmp_path):
    texts = [f"doc {i}: " + TEXTS[i % len(TEXTS)] for i in range(14)]
    rows = [{"text": t, "id": i} for i, t in enumerate(texts)]  # a column the text does not need
    (tmp_path / "txt").mkdir()
    for i, t in enumerate(texts):
        (tmp_path / "txt" / f"{i:02}.txt").write_text(t, encoding="utf-8")
    jsonl = "".join(json.dumps(r) + "\n" for r in rows).encode()
    (tmp_path / "c.jsonl").write_bytes(jsonl)
    (tmp_path / "c.jsonl.gz").write_bytes(gzip.compress(jsonl))
    import zstandard
    (tmp_path / "c.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(jsonl))
    write_parquet(tmp_path / "c.parquet", rows)  # 4 row groups
    (tmp_path / "mix").mkdir()  # a glob mixing the formats
    (tmp_path / "mix" / "a.jsonl.gz").write_bytes(
        gzip.compress(b"".join(jsonl.splitlines(True)[:5])))
    write_parquet(tmp_path / "mix" / "b.parquet", rows[5:9])
    (tmp_path / "mix" / "c.jsonl").write_bytes(b"".join(jsonl.splitlines(True)[9:]))
    want = None
    for source in ("txt", "c.jsonl", "c.jsonl.gz", "c.jsonl.zst", "c.parquet", "mix/*"):
        out = tmp_path / f"out-{source.replace('/*', '')}"
        meta = prepare.prepare(str(tmp_path / source), str(out), "cl100k_base", 600,
                               val_fraction=0.3, verbose=False)
        assert meta["train_docs"] + meta["val_docs"] == len(texts) and meta["val_docs"] > 0, source
        want = want or split_docs(out)
        assert split_docs(out) == want, source
    chats = [{"messages": [{"role": "user", "content": f"q{i} " + t},
                           {"role": "assistant", "content": t}]}
             for i, t in enumerate(texts)]
    (tmp_path / "chat.jsonl").write_text("".join(json.dumps(c) + "\n" for c in chats))
    write_parquet(tmp_path / "chat.parquet", chats)  # a `messages` column of conversations
    for source in ("chat.jsonl", "chat.parquet"):
        meta = prepare.prepare(str(tmp_path / source), str(tmp_path / source.replace(".", "-")),
                               "cl100k_base", 600, val_fraction=0.3, verbose=False)
        assert meta["format"] == "chat" and meta["train_loss_tokens"] > 0
    jsonl_docs, parquet_docs = (split_docs(tmp_path / "chat-jsonl"),
                                split_docs(tmp_path / "chat-parquet"))
    assert parquet_docs == jsonl_docs and any(any(m) for _, m in jsonl_docs)


def test_a_corrupt_or_truncated_source_is_one_line_and_the_old_dataset_stays(
        tmp_path, monkeypatch):
    rows = [{"text": f"document {i} " + TEXTS[i % len(TEXTS)] * 20} for i in range(40)]
    jsonl = "".join(json.dumps(r) + "\n" for r in rows).encode()
    out = tmp_path / "out"
    prepare.prepare(_write(tmp_path / "good.jsonl", jsonl), str(out), "cl100k_base", 512,
                    verbose=False)
    before = {n: (out / n).read_bytes() for n in os.listdir(out)}
    gz = gzip.compress(jsonl)
    write_parquet(tmp_path / "good.parquet", rows)
    pq_bytes = (tmp_path / "good.parquet").read_bytes()
    # (a gzip stream's CRC is checked at its end, after its lines were read)
    import zstandard
    zst = zstandard.ZstdCompressor().compress(jsonl)
    bad = {"cut.jsonl.gz": gz[:len(gz) // 2], "crc.jsonl.gz": gz[:-8] + bytes(8),
           "cut.jsonl.zst": zst[:len(zst) // 2],
           "cut.parquet": pq_bytes[:len(pq_bytes) // 2], "noise.parquet": os.urandom(3000)}
    for name, raw in bad.items():
        with pytest.raises(
                UserError,
                match=r"is corrupt or truncated \(.+\): download or write it again") as e:
            prepare.prepare(_write(tmp_path / name, raw), str(out), "cl100k_base", 512,
                            verbose=False)
        assert "\n" not in str(e.value) and name in str(e.value)
        assert {n: (out / n).read_bytes() for n in os.listdir(out)} == before, name
        assert (sorted(os.listdir(tmp_path)).count("out") == 1
                and not list(tmp_path.glob("out.*"))), name
    for module, name in (("pyarrow", "good.parquet"), ("zstandard", "good.jsonl.zst")):
        monkeypatch.setitem(sys.modules, module, None)  # as if not installed
        with pytest.raises(UserError, match=f"needs {module}, which is not installed: `pip "
                                            f"install {module}`"):
            prepare.prepare(_write(tmp_path / name, b"x"), str(out), "cl100k_base", 512,
                            verbose=False)


def _write(path, raw):
    path.write_bytes(raw)
    return str(path)


def loader(dataset, **kw):
    args = dict(block_size=16, batch_size=3, grad_accum_steps=4, seed=7)
    return data.Loader(dataset, "train", **{**args, **kw})


def test_loader_is_a_pure_function_of_seed_and_iteration(dataset):
    a, b = loader(dataset), loader(dataset)
    xs = [a.batch(it) for it in (0, 1, 2, 50)]
    # any order, a fresh loader: the same batches
    for it, (x, y, _) in zip((50, 2, 1, 0), reversed(xs)):
        x2, y2, mask = b.batch(it)
        assert torch.equal(x, x2) and torch.equal(y, y2)
        assert mask is None  # a text dataset: every target counts
    x, y, _ = xs[0]
    assert x.shape == (4, 3, 16) and x.dtype == torch.int64
    assert torch.equal(x[..., 1:], y[..., :-1])  # y is x shifted by one
    assert not torch.equal(loader(dataset, seed=8).batch(0)[0], x)


def test_each_epoch_visits_every_chunk_once(dataset):
    ld = loader(dataset, batch_size=1, grad_accum_steps=1)
    n = ld.n_chunks
    assert n > 20
    first = np.concatenate([ld.global_chunks(it).ravel() for it in range(n)])
    second = np.concatenate([ld.global_chunks(it).ravel() for it in range(n, 2 * n)])
    assert sorted(first) == list(range(n)) and sorted(second) == list(range(n))
    assert not np.array_equal(first, second)  # a new order each epoch
    big = loader(dataset, batch_size=5, grad_accum_steps=3)  # batches that straddle epoch ends
    chunks = np.concatenate([big.global_chunks(it).ravel() for it in range(2 * n // 15 + 2)])
    assert sorted(chunks[:n]) == list(range(n))


@pytest.mark.parametrize("dp", [2, 4])
def test_rank_slices_are_disjoint_and_make_the_global_batch(dataset, dp):
    whole_x, whole_y, _ = loader(dataset).batch(3)
    parts = [loader(dataset, dp_rank=r, dp=dp).batch(3) for r in range(dp)]
    assert all(x.shape[0] == 4 // dp for x, _, _ in parts)
    torch.testing.assert_close(torch.cat([x for x, _, _ in parts]), whole_x, rtol=0, atol=0)
    torch.testing.assert_close(torch.cat([y for _, y, _ in parts]), whole_y, rtol=0, atol=0)
    lds = [loader(dataset, dp_rank=r, dp=dp) for r in range(dp)]
    mine = [set(ld.global_chunks(3)[ld.first_micro:ld.first_micro + ld.micro_steps].ravel())
            for ld in lds]
    # disjoint, 12 sequences in all
    assert sum(len(m) for m in mine) == len(set().union(*mine)) == 12


def test_compressed_lines_are_read_whole_and_bounded(tmp_path, monkeypatch):
    """Lines across the readers' blocks come out as the file holds them (plain, .gz, and .zst
    of several frames); a line past MAX_LINE_BYTES (a decompression bomb: a few kB that expand
    to one endless line) is one line of error, read no further than the bound."""
    import zstandard
    from formats import corpora
    lines = [b"x" * n + b"\n" for n in (0, 1, (1 << 20) + 7, 5, 3 << 20, 2)] + [b"tail"]
    raw = b"".join(lines)
    zc = zstandard.ZstdCompressor()
    files = {"a.jsonl": raw, "a.jsonl.gz": gzip.compress(raw),
             "a.jsonl.zst": zc.compress(raw[:1000]) + zc.compress(raw[1000:])}
    for name, data in files.items():
        assert list(corpora._lines(_write(tmp_path / name, data))) == lines, name
    monkeypatch.setattr(corpora, "MAX_LINE_BYTES", 1 << 20)
    bomb = b"{}\n" + b"\0" * (64 << 20)  # (a record, then 64 MB of zeros: a 2 kB .zst)
    for name, data in {"b.jsonl.gz": gzip.compress(bomb, 1), "b.jsonl.zst": zc.compress(bomb),
                       "b.jsonl": bomb[:3 << 20]}.items():
        with pytest.raises(UserError, match=r":2: a line of over 1 MB \(no JSONL record") as e:
            list(corpora._lines(_write(tmp_path / name, data)))
        assert "\n" not in str(e.value) and name in str(e.value)


def test_a_parquet_value_rows_repeat_is_in_memory_once_and_bounded(tmp_path, monkeypatch):
    """A dictionary page holds a value once and every row may name it: 200 rows of one 1 MB
    value are a few kB of file and 200 MB decoded. Read as the file holds them, the value is in
    memory once while the rows are read (Arrow's allocations under 20 MB); past the bound it is
    refused, naming the file and the first row that names it, before a row is decoded."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    from formats import corpora
    value = "x" * ((1 << 20) + 1)
    path = str(tmp_path / "d.parquet")
    pq.write_table(pa.table({"text": ["a", "b"] + [value] * 200}), path, compression="zstd")
    assert os.path.getsize(path) < 20_000
    base, peak, same = pa.total_allocated_bytes(), 0, 0
    for row, record, _ in corpora.records(path, "text", None):
        peak = max(peak, pa.total_allocated_bytes() - base)
        same += record["text"] == (value if row > 2 else "ab"[row - 1])
    assert same == 202 and peak < 20 << 20, peak
    monkeypatch.setattr(corpora, "MAX_LINE_BYTES", 1 << 20)
    with pytest.raises(UserError, match=r"d.parquet: row 3: a text of over 1 MB") as e:
        list(corpora.records(path, "text", None))
    assert "\n" not in str(e.value)


def write_arrow(path, rows, stream=False, batch_rows=4):
    """rows as one Arrow IPC file, the file format or the stream format, in batches."""
    import pyarrow
    table = pyarrow.Table.from_pylist(rows)
    new = pyarrow.ipc.new_stream if stream else pyarrow.ipc.new_file
    with new(str(path), table.schema) as w:
        for batch in table.to_batches(max_chunksize=batch_rows):
            w.write_batch(batch)
    return str(path)


def test_arrow_corpora_give_jsonls_tokens_and_hostile_ones_are_one_line(tmp_path, monkeypatch):
    """data_source= a directory `datasets`' save_to_disk wrote (a Dataset, and a DatasetDict of
    splits: Arrow stream files beside dataset_info.json / state.json), or one .arrow file in the
    file or the stream format: the same texts (and conversations) give the same tokens as
    .jsonl. A truncated file, a wrong column type, a schema whose offsets lie, a value past the
    limit: one line each, the old dataset left as it was."""
    import datasets
    import pyarrow
    texts = [f"doc {i}: " + TEXTS[i % len(TEXTS)] for i in range(14)]
    rows = [{"text": t, "id": i} for i, t in enumerate(texts)]
    (tmp_path / "c.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "saved"), num_shards=3)
    datasets.DatasetDict({"train": datasets.Dataset.from_list(rows[:9]),
                          "test": datasets.Dataset.from_list(rows[9:])}).save_to_disk(
        str(tmp_path / "saved_dict"))
    write_arrow(tmp_path / "file.arrow", rows)
    write_arrow(tmp_path / "stream.arrow", rows, stream=True)
    assert len(list((tmp_path / "saved").glob("*.arrow"))) > 1  # shards, read in order
    want = None
    for source in ("c.jsonl", "saved", "saved_dict", "file.arrow", "stream.arrow"):
        out = tmp_path / f"out-{source}"
        meta = prepare.prepare(str(tmp_path / source), str(out), "cl100k_base", 600,
                               val_fraction=0.3, verbose=False)
        assert meta["train_docs"] + meta["val_docs"] == len(texts), source
        want = want or split_docs(out)
        assert split_docs(out) == want, source
    chats = [{"messages": [{"role": "user", "content": f"q{i} " + t},
                           {"role": "assistant", "content": t}]} for i, t in enumerate(texts)]
    (tmp_path / "chat.jsonl").write_text("".join(json.dumps(c) + "\n" for c in chats))
    datasets.Dataset.from_list(chats).save_to_disk(str(tmp_path / "chat_saved"))
    for source in ("chat.jsonl", "chat_saved"):
        meta = prepare.prepare(str(tmp_path / source), str(tmp_path / f"out-{source}"),
                               "cl100k_base", 600, val_fraction=0.3, verbose=False)
        assert meta["format"] == "chat"
    assert split_docs(tmp_path / "out-chat_saved") == split_docs(tmp_path / "out-chat.jsonl")

    out = tmp_path / "out-c.jsonl"
    before = {n: (out / n).read_bytes() for n in os.listdir(out)}
    good = (tmp_path / "file.arrow").read_bytes()
    # a string column whose offsets point past its data (pyarrow's light check passes them),
    # and one of bytes that are no UTF-8 under a string type: the schema's word, not the bytes'
    _, offsets, data_buf = pyarrow.array(texts[:4]).buffers()
    lying = np.frombuffer(offsets, dtype=np.int32).copy()
    lying[2] = 10_000
    liar = pyarrow.StringArray.from_buffers(4, pyarrow.py_buffer(lying.tobytes()), data_buf)
    table = pyarrow.table({"text": liar})
    not_utf8 = pyarrow.StringArray.from_buffers(
        1, pyarrow.py_buffer(np.array([0, 4], np.int32).tobytes()), pyarrow.py_buffer(b"\xff\xfe"
                                                                                      b"ab"))
    with pyarrow.ipc.new_stream(str(tmp_path / "bytes.arrow"), table.schema) as w:
        w.write_table(pyarrow.table({"text": not_utf8}))
    with pyarrow.ipc.new_file(str(tmp_path / "lies.arrow"), table.schema) as w:
        w.write_table(table)
    bad = {"cut.arrow": (good[:len(good) // 2], "is corrupt or truncated"),
           "noise.arrow": (os.urandom(3000), "is corrupt or truncated"),
           "lies.arrow": (None, "is corrupt or truncated"),
           "bytes.arrow": (None, "is corrupt or truncated"),
           "ints.arrow": (None, "no string field 'text'")}
    write_arrow(tmp_path / "ints.arrow", [{"text": i} for i in range(3)])
    for name, (raw, match) in bad.items():
        path = _write(tmp_path / name, raw) if raw is not None else str(tmp_path / name)
        with pytest.raises(UserError, match=match) as e:
            prepare.prepare(path, str(out), "cl100k_base", 600, val_fraction=0.3, verbose=False)
        assert "\n" not in str(e.value) and name in str(e.value), (name, str(e.value))
        assert {n: (out / n).read_bytes() for n in os.listdir(out)} == before, name
    from formats import corpora
    monkeypatch.setattr(corpora, "MAX_LINE_BYTES", 100)  # (a 2 GB value, in small)
    with pytest.raises(UserError, match=r"file.arrow: a value of 0 MB in column 'text'"):
        prepare.prepare(str(tmp_path / "file.arrow"), str(out), "cl100k_base", 600,
                        verbose=False)
    (tmp_path / "saved" / "state.json").write_text('{"_data_files": [{"filename": "../x.arrow"}]}')
    with pytest.raises(UserError, match="state.json lists no .arrow files of its own"):
        prepare.prepare(str(tmp_path / "saved"), str(out), "cl100k_base", 600, verbose=False)
