"""
The deterministic batch loader (prepare.py makes the datasets it reads; tokenizer.py the ids).

A dataset is data/NAME/{train.bin, val.bin, meta.json} (and {train,val}.mask.bin for chat
data). Loader reads one: the global batch of iteration `it` is a pure function of the seed
and `it`, and each data-parallel rank takes its slice of it. mixture.py draws from several.

    python prepare.py stdlib     # prepare a dataset (prepare.py)
"""

import os

import numpy as np
import torch

from guards import guard_data


def dataset_dir(source):
    """Where dataset `source` lies: a name under data/, or a directory given with its path."""
    return source if os.sep in source else os.path.join("data", source)


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
    assistant's.

    packing='bfd': the chunks are rows of whole documents instead (packing.py), padded at the
    end; the loss mask then also leaves the padding out (a text split gets one too). 'auto':
    bfd for chat data (a reply keeps its prompt), concat for text."""

    def __init__(self, data_dir, split, block_size, batch_size, grad_accum_steps, seed, dp_rank=0,
                 dp=1, packing="auto"):
        meta = guard_data.read_meta(data_dir)
        guard_data.check_not_pairs(meta, data_dir)
        path = os.path.join(data_dir, f"{split}.bin")
        self.tokens = guard_data.map_tokens(path, np.dtype(meta["dtype"]), meta["vocab_size"])
        self.mask = (guard_data.chat_mask(path, len(self.tokens)) if meta.get("format") == "chat"
                     else None)
        self.eot_token = meta["eot_token"]
        self.block_size, self.batch_size, self.seed = block_size, batch_size, seed
        self.n_chunks = (len(self.tokens) - 1) // block_size
        self.packed = None
        if packing == "auto":
            packing = "bfd" if self.mask is not None else "concat"
        if packing == "bfd":  # whole documents per row: packing.py
            from techniques import packing as packing_py
            self.packed = packing_py.Packed(self.tokens, self.mask, self.eot_token, block_size + 1)
            self.n_chunks = self.packed.n_rows
        guard_data.check_rows(path, len(self.tokens), self.n_chunks, block_size)
        assert grad_accum_steps % dp == 0, f"grad_accum_steps={grad_accum_steps}, dp={dp}"
        self.global_batch = batch_size * grad_accum_steps
        self.micro_steps = grad_accum_steps // dp
        self.first_micro = dp_rank * self.micro_steps
        self._order = (None, None)  # (epoch, permutation): the current epoch's order, cached

    def epoch_order(self, epoch):
        if self._order[0] != epoch:
            self._order = (epoch,
                           np.random.default_rng([self.seed, epoch]).permutation(self.n_chunks))
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
        x and y int64, loss_mask float32 for a chat dataset or packed rows, else None."""
        if self.packed:
            return self.packed.rows(self.chunks_of(np.asarray(samples)), self.tokens, self.mask)
        T = self.block_size
        rows = [slice(c * T, c * T + T + 1) for c in self.chunks_of(np.asarray(samples))]
        data = torch.from_numpy(np.stack([self.tokens[r] for r in rows]).astype(np.int64))
        if self.mask is None:
            return data[:, :-1], data[:, 1:], None
        mask = torch.from_numpy(np.stack([self.mask[r] for r in rows]).astype(np.float32))
        return data[:, :-1], data[:, 1:], mask[:, 1:]

    def batch(self, it):
        """This rank's (x, y, loss_mask) for iteration it: x and y int64 of shape (micro_steps,
        batch_size, block_size), loss_mask float32 of y's shape for a chat dataset or packed
        rows, else None."""
        first = it * self.global_batch + self.first_micro * self.batch_size
        x, y, mask = self.rows(np.arange(first, first + self.micro_steps * self.batch_size))
        shape = (self.micro_steps, self.batch_size, self.block_size)
        return x.reshape(shape), y.reshape(shape), None if mask is None else mask.reshape(shape)

    @property
    def masked(self):
        """Whether rows come with a loss mask (chat data, or padded rows)."""
        return self.mask is not None or self.packed is not None

    def passes(self, it):
        """How many times `it` iterations pass over the training data."""
        return it * self.global_batch / self.n_chunks


def passes_note(max_iters, passes):
    """A line for a trained model set to see its training data (a mixture: its most repeated
    source) more than 3 times."""
    return (f"warning: max_iters={max_iters} passes the training data {passes:.1f} times: a "
            f"trained model learns data seen that often by heart and its held-out loss rises "
            f"(docs/benchmarks.md); max_iters={max(1, int(max_iters * 3 / passes))} is about 3 "
            f"passes")


def doc_ids(x, eot_token):
    """Which document of its row each position is in, counting from 0: the number of end ids
    (eot_token: the data's <|endoftext|> or eos; a mixture's, one per row, shaped to broadcast)
    strictly before it. The end id belongs to the document it ends, and the next document starts
    right after it. Any shape; rows run along the last dim."""
    is_eot = (x == eot_token).long()
    return is_eot.cumsum(-1) - is_eot
