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
