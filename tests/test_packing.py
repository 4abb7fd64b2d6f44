"""packing.py (packing=bfd): whole conversations per row, best fit decreasing, padding that
neither trains nor is attended to, long conversations split at a turn boundary."""

import json
import os

import numpy as np
import pytest
import torch
from conftest import TINY, assert_same_curve, read_metrics, run_train, torchrun

import data
import prepare
from guards import guard_data
from techniques import packing
import tokenizer as tokenizer_py
from model import ModelConfig, Transformer

T = 48  # rows of 49 tokens


@pytest.fixture(scope="module")
def chats(tmp_path_factory):
    """Conversations of 1 to 4 exchanges, of varied length; a few longer than a row."""
    root = tmp_path_factory.mktemp("packing")
    lines = []
    for i in range(60):
        turns = []
        for k in range(1 + i % 4 + 3 * (i % 13 == 0)):
            turns += [{"role": "user", "content": f"Add {i} and {k}" + " please" * (i % 5)},
                      {"role": "assistant", "content": f"{i + k}." + " Done" * (i % 3)}]
        lines.append({"messages": turns})
    (root / "chat.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    out = str(root / "data")
    prepare.prepare(str(root / "chat.jsonl"), out, "cl100k_base", 512, val_fraction=0.2,
                    verbose=False)
    return out


def test_best_fit_decreasing_worked_by_hand():
    # rows of 8: 5 -> new row 0 (3 left); 4 -> new row 1 (4 left); 3 -> row 0, the fuller that
    # holds it (0 left); 3 -> row 1 (1 left); 2 -> new row 2 (6 left); 2 -> row 2 (4 left);
    # 1 -> row 1
    where, n_rows = packing.best_fit_decreasing(np.array([3, 2, 5, 1, 4, 3, 2]), 8)
    assert n_rows == 3 and where.tolist() == [0, 2, 0, 1, 1, 1, 2]

    # two rows of equal room (4 each) beside the tightest (3): the 3 goes to the tightest
    where, n_rows = packing.best_fit_decreasing(np.array([7, 6, 6, 3]), 10)
    assert n_rows == 3 and where.tolist() == [0, 1, 2, 0]


def textbook_bfd(lengths, row):
    """Best fit decreasing as the textbook writes it (no shared code): the longest first, each
    into the open bin with the least room that holds it, else a new bin. The bins' rooms."""
    rooms = []
    for n in sorted(lengths, reverse=True):
        fits = [k for k, r in enumerate(rooms) if r >= n]
        if fits:
            k = min(fits, key=lambda k: rooms[k])
            rooms[k] -= n
        else:
            rooms.append(row - n)
    return sorted(rooms)


def test_packing_matches_a_textbook_best_fit_decreasing_and_pieces_are_whole_documents():
    """On random documents built with known boundaries (not found by packing.documents): the same
    number of rows and the same room left in them as a textbook best fit decreasing, and every
    piece one whole document, starting where it starts and ending in its end id."""
    rng = np.random.default_rng(0)
    eot, row = 0, 32
    for trial in range(20):
        lengths = rng.integers(1, row + 1, size=int(rng.integers(5, 60)))
        docs = [np.append(rng.integers(1, 100, size=n - 1), eot) for n in lengths]
        tokens = np.concatenate(docs)
        starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
        p = packing.Packed(tokens, None, eot, row)
        used = np.bincount(np.repeat(np.arange(p.n_rows), np.diff(p.ptr)), weights=p.lengths,
                           minlength=p.n_rows)
        assert sorted((row - used).tolist()) == textbook_bfd(lengths.tolist(), row), trial
        assert sorted(zip(p.starts.tolist(), p.lengths.tolist())) == sorted(
            zip(starts.tolist(), lengths.tolist()))
        assert all(tokens[s + n - 1] == eot for s, n in zip(p.starts, p.lengths))
        assert abs(p.padding - (1 - lengths.sum() / (p.n_rows * row))) < 1e-12


def test_a_long_conversation_splits_at_the_last_turn_boundary_that_fits_and_a_cut_is_counted():
    def conversation(n, bounds):  # reply tokens just before each boundary
        m = np.zeros(n, dtype=np.uint8)
        m[[b - 1 for b in bounds]] = 1
        return m
    # 18 tokens, replies end at 4, 8 and 12, rows of 10: pieces end at 8 (not 4), then the rest
    s, n, split, cut = packing.split_long(np.array([0]), np.array([18]), 10,
                                          conversation(18, [4, 8, 12]))
    assert (s.tolist(), n.tolist(), split, cut) == ([0, 8], [8, 10], 1, 0)
    # 25 tokens, one reply ending at 15: cut at 10 (no boundary fits), then split at 15: a
    # conversation cut once is counted cut, not split
    s, n, split, cut = packing.split_long(np.array([0]), np.array([25]), 10,
                                          conversation(25, [15]))
    assert (s.tolist(), n.tolist(), split, cut) == ([0, 10, 15], [10, 5, 10], 0, 1)


def test_no_conversation_crosses_a_row_and_the_masks_cover_exactly_the_replies(chats):
    meta = guard_data.read_meta(chats)
    tokens = np.fromfile(os.path.join(chats, "train.bin"), dtype=meta["dtype"])
    mask = np.fromfile(os.path.join(chats, "train.mask.bin"), dtype=np.uint8)
    ld = data.Loader(chats, "train", T, 2, 1, seed=0, packing="bfd")
    p = ld.packed
    starts, lengths = packing.documents(tokens, meta["eot_token"])
    long = lengths > T + 1
    assert long.sum() >= 3 and p.n_split + p.n_cut == long.sum() and p.n_split >= 1
    # the pieces tile the split: every token in one piece, a conversation that fits a row is one
    order = np.argsort(p.starts)
    assert (np.array_equal(np.cumsum(p.lengths[order])[:-1], p.starts[order][1:])
            and p.lengths.sum() == len(tokens))
    whole = set(zip(p.starts.tolist(), p.lengths.tolist()))
    assert all((s, n) in whole for s, n in zip(starts[~long].tolist(), lengths[~long].tolist()))
    # a split piece ends where a reply does
    for s, n in zip(p.starts.tolist(), p.lengths.tolist()):
        end = s + n
        if tokens[end - 1] != meta["eot_token"] and n < T + 1:
            assert mask[end - 1] == 1 and mask[end] == 0, (s, n)
    # each row: its pieces end to end, then padding (the end id) that counts nothing
    x, y, m = ld.rows(np.arange(ld.n_chunks))
    rows = torch.cat([x[:, :1], y], 1).numpy()
    keep = torch.cat([torch.zeros(len(m), 1), m], 1).numpy()
    for k, r in enumerate(ld.chunks_of(np.arange(ld.n_chunks)).tolist()):
        pieces = range(p.ptr[r], p.ptr[r + 1])
        real = np.concatenate([tokens[p.starts[i]:p.starts[i] + p.lengths[i]] for i in pieces])
        want = np.concatenate([mask[p.starts[i]:p.starts[i] + p.lengths[i]] for i in pieces])
        assert (np.array_equal(rows[k, :len(real)], real)
                and (rows[k, len(real):] == meta["eot_token"]).all())
        assert np.array_equal(keep[k, 1:len(real)], want[1:]) and not keep[k, len(real):].any()
    assert abs(p.padding - (1 - len(tokens) / (p.n_rows * (T + 1)))) < 1e-12
    # best fit decreasing's bound, 11/9 of the fewest rows + 1, against a lower bound on those:
    # the volume, and the pieces over half a row (no two share one)
    fewest = max(-(-len(tokens) // (T + 1)), int((p.lengths > (T + 1) / 2).sum()))
    assert fewest <= p.n_rows <= 11 / 9 * fewest + 1
    # every reply token trains once (but a row's first token, which no position predicts)
    assert m.sum() == mask.sum() - mask[p.starts[p.ptr[:-1]]].sum()


def test_the_first_loss_equals_transformers_on_the_same_padded_rows_on_any_layout(chats, tmp_path):
    """train.py packing=bfd: its first loss is our model's on the packed batch, which equals
    transformers' on our export given the same rows with attention_mask 0 on the padding and
    labels -100 where the loss does not count; dp=2 x pp=2 trains the same curve."""
    from transformers import LlamaForCausalLM

    from formats import hf
    out = str(tmp_path / "run")
    args = [*TINY, f"dataset={chats}", "max_iters=4", f"block_size={T}", "grad_accum_steps=4",
            "packing=bfd"]
    p = run_train([*args, f"out_dir={out}"], cwd=tmp_path, fork=True)
    assert "packing: " in p.stdout and " split at a turn boundary and " in p.stdout
    first = read_metrics(out)[1]
    assert first["iter"] == 0 and "loss" in first
    meta = guard_data.read_meta(chats)
    cfg = ModelConfig(vocab_size=meta["vocab_size"], block_size=T, n_layer=2, n_head=4,
                      n_kv_head=2, n_embd=32)
    model = Transformer(cfg, seed=1337).eval()  # train.py's model for seed=1337
    ld = data.Loader(chats, "train", T, 4, 4, 1337, packing="bfd")
    x, y, m = (t.flatten(0, 1) for t in ld.batch(0))
    with torch.no_grad():
        losses, _ = model(x, y)
    ours = ((losses.double() * m).sum() / m.sum()).item()
    assert abs(ours - first["loss"]) < 1e-5 * ours, (ours, first["loss"])
    hf.save_hf(str(tmp_path / "hf"), model.state_dict(), cfg,
               tokenizer_py.tokenizer_from_meta(meta))
    theirs = LlamaForCausalLM.from_pretrained(tmp_path / "hf").eval()
    rows = torch.cat([x[:, :1], y], 1)
    chunks = ld.chunks_of(np.arange(ld.global_batch))
    real = [int(ld.packed.lengths[ld.packed.ptr[r]:ld.packed.ptr[r + 1]].sum())
            for r in chunks.tolist()]
    attention = (torch.arange(T + 1)[None] < torch.tensor(real)[:, None]).long()
    labels = rows.masked_fill(torch.cat([torch.zeros(len(m), 1), m], 1) == 0, -100)
    with torch.no_grad():
        loss = theirs(input_ids=rows, attention_mask=attention, labels=labels).loss.item()
    assert abs(loss - ours) < 1e-4 * ours, (loss, ours)
    torchrun(4, [*args, "pp=2", f"out_dir={tmp_path / 'dp2-pp2'}"], cwd=tmp_path)
    assert_same_curve(read_metrics(out), read_metrics(str(tmp_path / "dp2-pp2")))


def test_a_mixture_takes_packed_sources(chats, dataset):
    """A packed chat source beside a packed text one: each slot is its source's packed row, a
    text row masked only on its padding."""
    import configurator
    from techniques import mixture
    names = ["chats", "tiny"]
    loaders = [data.Loader(d, "train", T, 4, 2, 1337, packing="bfd") for d in (chats, dataset)]
    mix = mixture.MixtureLoader(loaders, names, [0.5, 0.5],
                                configurator.parse_phases([], names), 1.0)
    x, y, m, src = mix.batch(3)
    source, sample = mix.global_samples(3)
    assert set(source.tolist()) == {0, 1}
    for s, ld in enumerate(loaders):
        sel = source == s
        xs, ys, ms = ld.rows(sample[sel])
        assert torch.equal(x.flatten(0, 1)[sel], xs) and torch.equal(m.flatten(0, 1)[sel], ms)
    # a text row: every target of its documents counts, none of its padding
    p, rows = loaders[1].packed, loaders[1].chunks_of(sample[source == 1])
    real = torch.tensor([int(p.lengths[p.ptr[r]:p.ptr[r + 1]].sum()) for r in rows.tolist()])
    want = (torch.arange(1, T + 1)[None] < real[:, None]).float()
    assert torch.equal(m.flatten(0, 1)[source == 1], want) and p.padding > 0


def test_the_preparation_line_says_how_the_conversations_pack(chats, tmp_path, capsys):
    """prepare's line for chat data at a run's block_size: the conversations, rows, splits, cuts
    and padding that the loader then packs (a run prints the same at its start)."""
    meta = guard_data.read_meta(chats)
    source = os.path.join(os.path.dirname(chats), "chat.jsonl")
    prepare.prepare(source, str(tmp_path / "d"), "cl100k_base", 512, val_fraction=0.2,
                    block_size=T)
    line = next(x for x in capsys.readouterr().out.splitlines() if "packed at" in x)
    p = data.Loader(str(tmp_path / "d"), "train", T, 2, 1, seed=0, packing="bfd").packed
    assert p.n_cut + p.n_split >= 3 and p.padding > 0  # (numbers that can be wrong)
    assert line == f"prepare: packed at block_size={T}: " + p.note("train")
    assert f"{p.n_split:,} split at a turn boundary and {p.n_cut:,} cut" in line
    assert f"{p.padding:.1%} of the rows is padding" in line and meta["format"] == "chat"
    prepare.prepare(source, str(tmp_path / "d"), "cl100k_base", 512, val_fraction=0.2)
    assert "packed at" not in capsys.readouterr().out  # block_size=0 (a text run's own call)
