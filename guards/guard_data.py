"""
The guard of prepared datasets: a dataset's meta.json read with every field checked (types,
ranges) before anything is built from it, its token files mapped once checked whole, and an
existing dataset made as the command asks.
"""

import os

import numpy as np

from guards import guard_chat
from guards.guard_errors import UserError, describe_error
from guards.guard_files import MAX_LIST_JSON_BYTES, json_field, read_json


def check_made_as_asked(data_dir, asked, given):
    """An existing dataset was made with the val_fraction and data_source the command gives
    (meta.json records them): else one line naming the setting that differs, not the old split."""
    if "val_fraction" not in given and "data_source" not in given:
        return
    made = read_json(os.path.join(data_dir, "meta.json"), f"prepare {data_dir} again",
                     limit=MAX_LIST_JSON_BYTES)
    for key, field in (("val_fraction", "val_fraction"), ("data_source", "source")):
        # (older data: no record; data_source='': prepare nothing. val_fraction=0 is a split)
        had = made.get(field, asked[key])
        if key in given and (asked[key] or key == "val_fraction") and had != asked[key] and not (
                key == "data_source" and isinstance(had, str) and _same_place(had, asked[key])):
            raise UserError(f"{data_dir} was prepared with {key}={made[field]!r}, this command "
                            f"asks for {key}="
                            f"{asked[key]!r}: delete {data_dir} to prepare it again with it, or "
                            f"drop {key}= to use it as it is (or pick another dataset= name)")


def _same_place(a, b):
    """Two spellings of one source: 'corpus/' is 'corpus', './x/*.txt' is 'x/*.txt'."""
    return os.path.realpath(a.rstrip("/") or "/") == os.path.realpath(b.rstrip("/") or "/")


# what prepare writes: dtype -> ids it can hold
TOKEN_DTYPES = {"uint16": 2 ** 16, "uint32": 2 ** 32}


def read_meta(data_dir):
    """A prepared dataset's meta.json, each field checked (types, ranges) before anything is built
    from it."""
    path = os.path.join(data_dir, "meta.json")
    if not os.path.exists(path):
        raise UserError(f"no prepared dataset at '{data_dir}' (meta.json missing): run `python "
                        f"prepare.py SOURCE --out {data_dir}` or set data_source= to prepare it")
    fix = "it was not written by prepare; prepare the dataset again"
    meta = read_json(path, fix, limit=MAX_LIST_JSON_BYTES)  # (it lists the source's files)
    json_field(meta, "tokenizer", str, path, fix)
    json_field(meta, "dtype", str, path, fix)
    if meta["dtype"] not in TOKEN_DTYPES:
        raise UserError(f"{path}: dtype={meta['dtype'][:40]!r} is not one "
                        f"of {', '.join(TOKEN_DTYPES)}: {fix}")
    vocab = json_field(meta, "vocab_size", int, path, fix, 1, TOKEN_DTYPES[meta["dtype"]])
    json_field(meta, "eot_token", int, path, fix, 0, vocab - 1)
    json_field(meta, "base_vocab_size", int, path, fix, 1, vocab, required=False)
    if not all(isinstance(t, str)
               for t in json_field(meta, "extra_tokens", list, path, fix, required=False) or []):
        raise UserError(f"{path}: extra_tokens is not a list of strings: {fix}")
    if json_field(meta, "format", str, path, fix, required=False) not in (
            None, "text", "chat", "preference"):
        raise UserError(f"{path}: format={meta['format'][:40]!r} is not text, chat or "
                        f"preference: {fix}")
    return meta


def check_not_pairs(meta, data_dir):  # (only preference.py reads pairs, a dataset alone)
    if meta.get("format") == "preference":
        raise UserError(f"{data_dir} holds preference pairs: train on it alone (dataset=)")


def map_tokens(path, dtype, vocab_size):
    """The token file `path` memory-mapped, once it is checked whole and every id is below
    vocab_size."""
    redo = f"prepare the dataset again (`python prepare.py SOURCE --out {os.path.dirname(path)}`)"
    size = os.path.getsize(path) if os.path.isfile(path) else None
    # (numpy cannot map an empty file, and it holds no sequence)
    if not size or size % dtype.itemsize:
        raise UserError(f"{path} is missing: {redo}" if size is None
                        else f"{path} has {size} bytes, not a multiple "
                        f"of {dtype.itemsize} ({dtype.name} tokens) or empty: the file is "
                        f"truncated or damaged; {redo}")
    tokens = np.memmap(path, dtype=dtype, mode="r")
    # an id past the vocabulary indexes past the embedding (a crash, or garbage on GPU): one pass,
    # a second per GB
    if int(tokens.max()) >= vocab_size:
        raise UserError(f"{path} holds token id {int(tokens.max())}, but meta.json says "
                        f"vocab_size {vocab_size}: "
                        f"the file is damaged or from another dataset; {redo}")
    return tokens


def check_rows(path, n_tokens, n_rows, block_size):
    """A split that gives at least one row of block_size + 1 tokens."""
    if n_rows < 1:
        raise UserError(f"{path} has {n_tokens} tokens, fewer than block_size + 1 = "
                        f"{block_size + 1}: lower block_size or add data")


def chat_mask(path, n_tokens):
    """A chat dataset's loss mask beside its token file: one byte per token, 1 where the loss
    counts."""
    mask_path = path[:-len(".bin")] + ".mask.bin"
    if not os.path.exists(mask_path) or os.path.getsize(mask_path) != n_tokens:
        raise UserError(f"{mask_path} is missing or not one byte per token of {path}: prepare the "
                        f"dataset again")
    mask = np.memmap(mask_path, dtype=np.uint8, mode="r")
    guard_chat.check_mask(mask, mask_path)
    return mask


def check_tokenizer(meta, where, tokenizer, vocab_size):
    """The data was tokenized as this run says (tokenizer=, vocab_size=)."""
    base_vocab = meta.get("base_vocab_size", meta["vocab_size"])  # before chat and extra tokens
    if meta["tokenizer"] != tokenizer or base_vocab != (vocab_size or base_vocab):
        raise UserError(f"{where} was prepared with tokenizer={meta['tokenizer']} "
                        f"vocab_size={base_vocab}, but this run has tokenizer={tokenizer} "
                        f"vocab_size={vocab_size}: set those, or prepare into another dataset")


def read_token_bytes(data_dir, vocab_size):
    """The UTF-8 bytes each id decodes to, as prepare.py wrote them (token_bytes.npy), checked:
    vocab_size counts in [0, 1024]. None for a dataset prepared before the file was written."""
    path = os.path.join(data_dir, "token_bytes.npy")
    if not os.path.exists(path):
        return None
    fix = "prepare the dataset again"
    try:
        t = np.load(path, allow_pickle=False)
    except (OSError, ValueError, EOFError) as e:
        raise UserError(f"{path} cannot be read ({describe_error(e)}): {fix}") from None
    if (t.shape != (vocab_size,) or t.dtype.kind not in "iu"
        or (t.size and not 0 <= t.min() <= t.max() <= 1024)):
        raise UserError(f"{path} is not {vocab_size} byte counts (it "
                        f"holds {t.dtype} {t.shape}): {fix}")
    return t.astype(np.int64)
