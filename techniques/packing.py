"""
Whole documents per row (packing=bfd): best-fit-decreasing packing of a prepared split, as TRL's
SFTTrainer (packing_strategy="bfd"), torchtune's PackedDataset and axolotl's multipack keep each
conversation whole in one row.

The default loader cuts a split into rows of block_size + 1 tokens end to end, so a conversation
that crosses a cut trains its reply in a row that lost its prompt. Here each document (a
conversation, with the id that ends it) lies whole in one row: the longest first, each into the
row with the least room left that still holds it (a new row when none does). What a row has left
is padding: the end id, masked out of the loss, and after every real token, so no real token
attends to it. A document longer than a row is split at a turn boundary (where a reply ends:
the loss mask falls from 1 to 0) into pieces that fit, else cut at the row's length.

The packing is a pure function of the split and block_size, computed when the loader opens the
split (a second or two per million documents), so a batch stays a pure function of (seed, it).
"""

import numpy as np
import torch


def documents(tokens, eot):
    """(starts, lengths) of the documents of a token file, each with the id that ends it."""
    ends = np.flatnonzero(np.asarray(tokens) == eot) + 1
    if not len(ends) or ends[-1] != len(tokens):
        ends = np.append(ends, len(tokens))
    starts = np.concatenate([[0], ends[:-1]])
    return starts, ends - starts


def split_long(starts, lengths, row, mask=None):
    """Documents longer than `row` tokens as pieces that fit: each piece ends at the last turn
    boundary that fits (a position after a reply, where mask falls from 1 to 0), else at `row`
    tokens. Returns (starts, lengths, documents split at turn boundaries only, documents cut)."""
    out_s, out_n, n_split, n_cut = [], [], 0, 0
    for s, n in zip(starts.tolist(), lengths.tolist()):
        if n <= row:
            out_s.append(s)
            out_n.append(n)
            continue
        bounds = []
        if mask is not None:
            m = np.asarray(mask[s:s + n], dtype=np.int8)
            # a piece may end before these: the first token after a reply
            bounds = (np.flatnonzero((m[:-1] == 1) & (m[1:] == 0)) + 1).tolist()
        cut, at, end = False, s, s + n
        while end - at > row:
            fits = [b + s for b in bounds if at < b + s <= at + row]
            nxt = fits[-1] if fits else at + row
            cut |= not fits
            out_s.append(at)
            out_n.append(nxt - at)
            at = nxt
        out_s.append(at)
        out_n.append(end - at)
        n_cut += cut
        n_split += not cut
    return np.asarray(out_s, dtype=np.int64), np.asarray(out_n, dtype=np.int64), n_split, n_cut


def best_fit_decreasing(lengths, row):
    """Each piece's row: the longest first, each into the fullest row that still holds it.
    free[c] lists the rows with c tokens of room, so the best fit is the first non-empty c >= n."""
    order = np.argsort(-lengths, kind="stable")
    room = np.zeros(row + 1, dtype=np.int64)  # how many rows have c tokens left
    free = [[] for _ in range(row + 1)]
    where = np.empty(len(lengths), dtype=np.int64)
    n_rows = 0
    for i in order.tolist():
        n = int(lengths[i])
        c = n + int(np.argmax(room[n:] > 0)) if room[n:].any() else -1
        if c < 0:
            r, c = n_rows, row
            n_rows += 1
        else:
            r = free[c].pop()
            room[c] -= 1
        where[i] = r
        free[c - n].append(r)
        room[c - n] += 1
    return where, n_rows


class Packed:
    """A split's rows: row r holds the pieces ptr[r]:ptr[r + 1] of (starts, lengths), in the
    order they were placed, then padding."""

    def __init__(self, tokens, mask, eot, row):
        starts, lengths = documents(tokens, eot)
        self.n_docs = len(starts)
        starts, lengths, self.n_split, self.n_cut = split_long(starts, lengths, row, mask)
        where, self.n_rows = best_fit_decreasing(lengths, row)
        order = np.lexsort((np.arange(len(where)), where))  # by row, then as placed (stable)
        self.starts, self.lengths = starts[order], lengths[order]
        self.ptr = np.concatenate([[0], np.cumsum(np.bincount(where, minlength=self.n_rows))])
        self.row, self.eot = row, eot
        self.padding = 1 - lengths.sum() / (self.n_rows * row)

    def note(self, name):
        return (f"{name}: {self.n_docs:,} documents in {self.n_rows:,} rows of {self.row:,} "
                f"tokens, best fit, each whole but {self.n_split:,} split at a turn boundary and "
                f"{self.n_cut:,} cut (longer than a row); {self.padding:.1%} of the rows is "
                f"padding")

    def rows(self, rows, tokens, mask):
        """(x, y, loss_mask) of the given rows: each (len(rows), row - 1); padding counts nothing,
        and a text split's real targets count all."""
        data = np.full((len(rows), self.row), self.eot, dtype=np.int64)
        keep = np.zeros((len(rows), self.row), dtype=np.float32)
        for k, r in enumerate(rows.tolist()):
            at = 0
            for i in range(self.ptr[r], self.ptr[r + 1]):
                s, n = int(self.starts[i]), int(self.lengths[i])
                data[k, at:at + n] = tokens[s:s + n]
                keep[k, at:at + n] = 1 if mask is None else mask[s:s + n]
                at += n
        data, keep = torch.from_numpy(data), torch.from_numpy(keep)
        return data[:, :-1], data[:, 1:], keep[:, 1:]
