"""
The deterministic batch loader (prepare.py makes the datasets it reads; tokenizer.py the ids).

A dataset is data/NAME/{train.bin, val.bin, meta.json} (and {train,val}.mask.bin for chat
data). Loader reads one: the global batch of iteration `it` is a pure function of the seed
and `it`, and each data-parallel rank takes its slice of it. mixture.py draws from several.

    python data.py stdlib        # prepare a dataset: prepare.py's command line
"""

# `python data.py SOURCE ...` is prepare.py's command line, run as a script rather than imported
# (the module data stays beneath prepare.py), and before this file imports torch: preparing needs none
if __name__ == "__main__":
    import runpy
    runpy.run_module("prepare", run_name="__main__")
    raise SystemExit

import os

import numpy as np
import torch

import guard_chat
from common import UserError, json_field, read_json


def check_made_as_asked(data_dir, asked, given):
    """An existing dataset was made with the val_fraction and data_source the command gives
    (meta.json records them): else one line naming the setting that differs, not the old split."""
    made = read_json(os.path.join(data_dir, "meta.json"), f"prepare {data_dir} again")
    for key, field in (("val_fraction", "val_fraction"), ("data_source", "source")):
        if key in given and asked[key] and made.get(field, asked[key]) != asked[key]:  # (older data: no record)
            raise UserError(f"{data_dir} was prepared with {key}={made[field]!r}, this command asks for {key}="
                            f"{asked[key]!r}: delete {data_dir} to prepare it again with it, or drop {key}= to use "
                            f"it as it is (or pick another dataset= name)")


TOKEN_DTYPES = {"uint16": 2 ** 16, "uint32": 2 ** 32}  # what prepare writes: dtype -> ids it can hold


def load_meta(data_dir):
    """A prepared dataset's meta.json, each field checked (types, ranges) before anything is built from it."""
    path = os.path.join(data_dir, "meta.json")
    if not os.path.exists(path):
        raise UserError(f"no prepared dataset at '{data_dir}' (meta.json missing): run "
                        f"`python data.py SOURCE --out {data_dir}` or set data_source= to prepare it")
    fix = "it was not written by prepare; prepare the dataset again"
    meta = read_json(path, fix)
    json_field(meta, "tokenizer", str, path, fix)
    json_field(meta, "dtype", str, path, fix)
    if meta["dtype"] not in TOKEN_DTYPES:
        raise UserError(f"{path}: dtype={meta['dtype'][:40]!r} is not one of {', '.join(TOKEN_DTYPES)}: {fix}")
    vocab = json_field(meta, "vocab_size", int, path, fix, 1, TOKEN_DTYPES[meta["dtype"]])
    json_field(meta, "eot_token", int, path, fix, 0, vocab - 1)
    json_field(meta, "base_vocab_size", int, path, fix, 1, vocab, required=False)
    if not all(isinstance(t, str) for t in json_field(meta, "extra_tokens", list, path, fix, required=False) or []):
        raise UserError(f"{path}: extra_tokens is not a list of strings: {fix}")
    if json_field(meta, "format", str, path, fix, required=False) not in (None, "text", "chat"):
        raise UserError(f"{path}: format={meta['format'][:40]!r} is not text or chat: {fix}")
    return meta


# ---------------------------------------------------------------------------------------
# the loader


def map_tokens(path, dtype, vocab_size):
    """The token file `path` memory-mapped, once it is checked whole and every id is below vocab_size."""
    redo = f"prepare the dataset again (`python data.py SOURCE --out {os.path.dirname(path)}`)"
    size = os.path.getsize(path) if os.path.isfile(path) else None
    if not size or size % dtype.itemsize:  # (numpy cannot map an empty file, and it holds no sequence)
        raise UserError(f"{path} is missing: {redo}" if size is None else f"{path} has {size} bytes, not a multiple "
                        f"of {dtype.itemsize} ({dtype.name} tokens) or empty: the file is truncated or damaged; {redo}")
    tokens = np.memmap(path, dtype=dtype, mode="r")
    # an id past the vocabulary indexes past the embedding (a crash, or garbage on GPU): one pass, a second per GB
    if int(tokens.max()) >= vocab_size:
        raise UserError(f"{path} holds token id {int(tokens.max())}, but meta.json says vocab_size {vocab_size}: "
                        f"the file is damaged or from another dataset; {redo}")
    return tokens


def chat_mask(path, n_tokens):
    """A chat dataset's loss mask beside its token file: one byte per token, 1 where the loss counts."""
    mask_path = path[:-len(".bin")] + ".mask.bin"
    if not os.path.exists(mask_path) or os.path.getsize(mask_path) != n_tokens:
        raise UserError(f"{mask_path} is missing or not one byte per token of {path}: prepare the dataset again")
    mask = np.memmap(mask_path, dtype=np.uint8, mode="r")
    guard_chat.check_mask(mask, mask_path)
    return mask


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
        self.tokens = map_tokens(path, np.dtype(meta["dtype"]), meta["vocab_size"])
        self.mask = chat_mask(path, len(self.tokens)) if meta.get("format") == "chat" else None
        self.eot_token = meta["eot_token"]
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

    def eot_of(self, *source):
        """The id that ends a document in this data's rows (doc_ids)."""
        return self.eot_token


def passes_note(max_iters, passes):
    """A line for a trained model set to see its training data (a mixture: its most repeated
    source) more than 3 times."""
    return (f"warning: max_iters={max_iters} passes the training data {passes:.1f} times: a "
            f"trained model learns data seen that often by heart and its held-out loss rises "
            f"(docs/benchmarks.md); max_iters={max(1, int(max_iters * 3 / passes))} is about 3 passes")


def doc_ids(x, eot_token):
    """Which document of its row each position is in, counting from 0: the number of end ids
    (eot_token: the data's <|endoftext|> or eos; a mixture's, one per row, shaped to broadcast)
    strictly before it. The end id belongs to the document it ends, and the next document starts
    right after it. Any shape; rows run along the last dim."""
    is_eot = (x == eot_token).long()
    return is_eot.cumsum(-1) - is_eot
