import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from conftest import ROOT, SFT, assert_same_curve, read_metrics, run_train, torchrun

import data
import prepare
import tokenizer
from model import ModelConfig, Transformer
from guards.guard_errors import UserError

TEXTS = ["def f(x):\n    return x ** 2  # square\n", "Héllo wörld — ünïcode, 日本語, emoji 🚀🎉\n",
         "    \t\n\n  trailing spaces   ", "a" * 300 + " zzzqqq 12345678",
         "<tool> <|tool|x> |tool|> almost"]
EXTRA = ["<|tool|>", "<|result|>"]


# ---------------------------------------------------------------------------------------
# vocabulary expansion


@pytest.mark.parametrize("vocab_size", [512, 0])
def test_expansion_keeps_old_ids_and_appends_new_ones(vocab_size):
    base = tokenizer.get_tokenizer("cl100k_base", vocab_size)
    big = tokenizer.get_tokenizer("cl100k_base", vocab_size, EXTRA)
    assert big.n_vocab == base.n_vocab + 2  # 512 -> 514; cl100k_base's 100277 -> 100279
    assert [big.encode_single_token(t) for t in EXTRA] == [base.n_vocab, base.n_vocab + 1]
    assert big.eot_token == base.eot_token and big._special_tokens[tokenizer.EOT] == base.eot_token
    for text in TEXTS:  # text without the new tokens: exactly the old ids
        assert (tokenizer.encode(big, text) == tokenizer.encode(base, text)
                == base.encode_ordinary(text))
    assert tokenizer.encode_batch(big, TEXTS, 2) == base.encode_ordinary_batch(TEXTS)
    for i in sorted(base._mergeable_ranks.values())[::97] + list(base._special_tokens.values()):
        assert big.decode_single_token_bytes(i) == base.decode_single_token_bytes(i)


def test_new_tokens_encode_to_their_ids_anywhere():
    enc = tokenizer.get_tokenizer("cl100k_base", 512, EXTRA)
    tool, result = 512, 513
    text = "call<|tool|>now\nline <|result|>end<|tool|><|tool|>"
    o = enc.encode_ordinary
    want = o("call") + [tool] + o("now\nline ") + [result] + o("end") + [tool, tool]
    assert tokenizer.encode(enc, text) == want
    assert tokenizer.encode_batch(enc, [text, "plain"], 2) == [want, o("plain")]
    assert enc.decode(want) == text
    for t in TEXTS:
        assert enc.decode(tokenizer.encode(enc, t)) == t
    # without the expansion the same string is just text
    small = tokenizer.get_tokenizer("cl100k_base", 512)
    assert (max(tokenizer.encode(small, text)) < 511
            and small.decode(tokenizer.encode(small, text)) == text)


def test_endoftext_and_other_specials_in_text_stay_text():
    # the full vocabulary has fim_* specials too
    enc = tokenizer.get_tokenizer("cl100k_base", 0, EXTRA)
    text = "a <|endoftext|> b <|fim_prefix|> c <|endofprompt|> <|tool|>"
    ids = tokenizer.encode(enc, text)
    specials = set(enc._special_tokens.values())
    assert [i for i in ids if i in specials] == [enc.encode_single_token("<|tool|>")]
    assert ids[:-1] == enc.encode_ordinary(text[:-len("<|tool|>")])
    assert enc.decode(ids) == text
    plain = tokenizer.get_tokenizer("cl100k_base", 0)  # no extra tokens: encode_ordinary exactly
    assert tokenizer.encode(plain, text) == plain.encode_ordinary(text)


def test_extra_token_errors_and_file(tmp_path):
    for bad, match in ([["<|a|>", "<|a|>"], "listed twice"],
                       [[tokenizer.EOT], "already a special"], [[""], "non-empty"]):
        with pytest.raises(UserError, match=match):
            tokenizer.get_tokenizer("cl100k_base", 512, bad)
    path = tmp_path / "tokens.txt"
    path.write_text("<|tool|>\n\n  <|result|>  \n<|tool|>\n<|x|>\n", encoding="utf-8")
    assert tokenizer.load_extra_tokens(str(path)) == ["<|tool|>", "<|result|>", "<|x|>"]
    with pytest.raises(UserError, match="not found"):
        tokenizer.load_extra_tokens(str(tmp_path / "missing.txt"))
    path.write_text("\n \n")
    with pytest.raises(UserError, match="has no tokens"):
        tokenizer.load_extra_tokens(str(path))


def test_text_dataset_with_extra_tokens(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    texts = [f"doc {i}: call <|tool|> then <|result|>{i} <|endoftext|> stays text"
             for i in range(20)]
    for i, t in enumerate(texts):
        (src / f"{i}.txt").write_text(t)
    meta = prepare.prepare(str(src), str(tmp_path / "out"), "cl100k_base", 512, 0.3,
                           extra_tokens=EXTRA, verbose=False)
    assert (meta["vocab_size"] == 514 and meta["base_vocab_size"] == 512
            and meta["extra_tokens"] == EXTRA)
    assert meta["format"] == "text" and meta["chat_tokens"] == []
    assert not os.path.exists(tmp_path / "out" / "train.mask.bin")
    tokens = np.concatenate([np.fromfile(tmp_path / "out" / f"{s}.bin", dtype=meta["dtype"])
                             for s in ("train", "val")])
    assert (tokens == 512).sum() == (tokens == 513).sum() == 20
    assert (tokens == 511).sum() == 20  # one <|endoftext|> per document: the literal one is text
    enc = tokenizer.tokenizer_from_meta(meta)
    cuts = np.flatnonzero(tokens == enc.eot_token)
    assert (sorted(enc.decode(d[:-1].tolist()) for d in np.split(tokens, cuts + 1)[:-1])
            == sorted(texts))
    ld = data.Loader(str(tmp_path / "out"), "train", 8, 2, 1, seed=0)
    assert ld.batch(0)[2] is None


# ---------------------------------------------------------------------------------------
# the chat template and its loss mask

CONVERSATION = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Say hi. Quote <|end|> and <|assistant|> literally."},
    {"role": "assistant", "content": "Hi. <|end|> <|assistant|>"},
    {"role": "user", "content": "Again, with a <|tool|>?"},
    {"role": "assistant", "content": "Hi again <|tool|>"},
]


def chat_tokenizer():
    return tokenizer.get_tokenizer("cl100k_base", 512, tokenizer.CHAT_TOKENS + EXTRA)


def masked_runs(ids, mask):
    """The runs of consecutive masked tokens, as token lists."""
    runs, run = [], []
    for i, m in zip(ids, mask):
        if m:
            run.append(i)
        elif run:
            runs.append(run)
            run = []
    return runs + ([run] if run else [])


def test_render_chat_masks_exactly_the_assistant_replies():
    enc = chat_tokenizer()
    ids, mask = tokenizer.render_chat(enc, CONVERSATION)
    assert len(ids) == len(mask) and set(mask) == {0, 1}
    assert enc.decode(ids) == "".join(f"<|{m['role']}|>{m['content']}<|end|>"
                                      for m in CONVERSATION)
    end = enc.encode_single_token("<|end|>")
    replies = [m["content"] for m in CONVERSATION if m["role"] == "assistant"]
    runs = masked_runs(ids, mask)
    assert [enc.decode(r) for r in runs] == [r + "<|end|>" for r in replies]
    assert all(r[-1] == end for r in runs)  # the model learns to stop
    # the template's tokens quoted in a message stay text (one <|end|> id per message),
    # the user's extra tokens become their ids
    assert ids.count(end) == len(CONVERSATION)
    assert ids.count(enc.encode_single_token("<|assistant|>")) == 2
    assert ids.count(enc.encode_single_token("<|tool|>")) == 2
    # every role token, and everything but the replies, is unmasked
    roles = {enc.encode_single_token(t) for t in tokenizer.CHAT_TOKENS[:3]}
    assert all(m == 0 for i, m in zip(ids, mask) if i in roles)
    assert sum(mask) == sum(len(tokenizer.encode_chat_contents(enc, [[m]])[0][0]) + 1
                            for m in CONVERSATION if m["role"] == "assistant")
    with pytest.raises(UserError, match="no chat tokens"):
        tokenizer.render_chat(tokenizer.get_tokenizer("cl100k_base", 512), CONVERSATION)


def write_jsonl(path, records):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records),
                    encoding="utf-8")
    return str(path)


def conversations(n):
    """n records, alternately in the messages and the prompt/response form."""
    out = []
    for i in range(n):
        if i % 2:
            out.append({"prompt": f"What is {i} squared?", "response": f"{i} squared is {i * i}."})
        else:
            out.append({"messages": [{"role": "system", "content": "Answer briefly."},
                                     {"role": "user", "content": f"Name number {i}."},
                                     {"role": "assistant", "content": f"Number {i} <|tool|>."},
                                     {"role": "user", "content": "Thanks"},
                                     {"role": "assistant", "content": "You're welcome."}]})
    return out


def as_messages(record):
    if "messages" in record:
        return record["messages"]
    return [{"role": "user", "content": record["prompt"]},
            {"role": "assistant", "content": record["response"]}]


def test_prompt_response_is_one_user_and_one_assistant_turn():
    enc = chat_tokenizer()
    ids, mask = tokenizer.render_chat(enc, as_messages({"prompt": "2+2?", "response": "4"}))
    assert enc.decode(ids) == "<|user|>2+2?<|end|><|assistant|>4<|end|>"
    assert [enc.decode(r) for r in masked_runs(ids, mask)] == ["4<|end|>"]


@pytest.fixture(scope="module")
def chat_with_extra_tokens(tmp_path_factory):
    root = tmp_path_factory.mktemp("chat")
    records = conversations(60)
    # a blank line is skipped
    src = write_jsonl(root / "sft.jsonl", [records[0], "", *records[1:]])
    tokens_file = root / "tokens.txt"
    # a chat token listed again is not added twice
    tokens_file.write_text("<|tool|>\n<|result|>\n<|user|>\n")
    meta = prepare.prepare(src, str(root / "out"), "cl100k_base", 512, val_fraction=0.2,
                        extra_tokens=str(tokens_file), verbose=False)
    return str(root / "out"), meta, records


def read_split(out, meta, split):
    tokens = np.fromfile(os.path.join(out, f"{split}.bin"), dtype=meta["dtype"])
    mask = np.fromfile(os.path.join(out, f"{split}.mask.bin"), dtype=np.uint8)
    return tokens, mask


def test_chat_dataset_round_trips(chat_with_extra_tokens):
    out, meta, records = chat_with_extra_tokens
    assert meta["format"] == "chat" and meta["chat_tokens"] == tokenizer.CHAT_TOKENS
    assert meta["extra_tokens"] == tokenizer.CHAT_TOKENS + EXTRA and meta["vocab_size"] == 512 + 6
    assert json.load(open(os.path.join(out, "meta.json"))) == meta
    enc = tokenizer.tokenizer_from_meta(meta)
    assert enc.encode_single_token("<|tool|>") == 516
    lines = [i + 1 + (i > 0) for i in range(len(records))]  # doc ids are sft.jsonl:LINE
    for split in ("train", "val"):
        tokens, mask = read_split(out, meta, split)
        assert len(mask) == len(tokens) == meta[f"{split}_tokens"]  # one mask byte per token
        assert mask.sum() == meta[f"{split}_loss_tokens"] > 0
        cuts = np.flatnonzero(tokens == enc.eot_token) + 1
        got = [(t.tolist(), m.tolist())
               for t, m in zip(np.split(tokens, cuts)[:-1], np.split(mask, cuts)[:-1])]
        want = [tokenizer.render_chat(enc, as_messages(r)) for r, line in zip(records, lines)
                if prepare.is_val(f"sft.jsonl:{line}", 0.2) == (split == "val")]
        assert got == [(ids + [enc.eot_token], m + [0]) for ids, m in want]
        assert meta[f"{split}_docs"] == len(want) > 0


def test_loader_returns_the_mask_of_the_targets(chat_with_extra_tokens):
    out, meta, _ = chat_with_extra_tokens
    tokens, mask = read_split(out, meta, "train")
    T = 64
    # (documents end to end: packing=concat; whole conversations per row are test_packing.py's)
    ld = data.Loader(out, "train", T, batch_size=3, grad_accum_steps=2, seed=1, packing="concat")
    x, y, loss_mask = ld.batch(5)
    assert loss_mask.dtype == torch.float32 and loss_mask.shape == y.shape == (2, 3, T)
    for c, xr, yr, mr in zip(ld.global_chunks(5).ravel(), x.reshape(-1, T), y.reshape(-1, T),
                             loss_mask.reshape(-1, T)):
        assert (xr.tolist() == tokens[c * T:c * T + T].tolist()
                and yr.tolist() == tokens[c * T + 1:c * T + T + 1].tolist())
        # the mask of the token y predicts
        assert mr.tolist() == mask[c * T + 1:c * T + T + 1].tolist()
    eot = meta["eot_token"]
    # several conversations per sequence
    assert max(int((r == eot).sum()) for r in x.reshape(-1, T)) >= 2
    assert 0 < loss_mask.sum() < loss_mask.numel()
    # rank slices carry their masks, and a batch is a pure function of (seed, it)
    parts = [data.Loader(out, "train", T, 3, 2, seed=1, dp_rank=r, dp=2, packing="concat").batch(5)
             for r in range(2)]
    assert torch.equal(torch.cat([p[2] for p in parts]), loss_mask)
    assert torch.equal(data.Loader(out, "train", T, 3, 2, seed=1, packing="concat").batch(5)[2],
                       loss_mask)


def test_chat_dataset_checks_its_mask_files(chat_with_extra_tokens, tmp_path):
    out, meta, _ = chat_with_extra_tokens
    broken = tmp_path / "broken"
    broken.mkdir()
    for name in ("train.bin", "val.bin", "meta.json", "val.mask.bin"):
        (broken / name).write_bytes(open(os.path.join(out, name), "rb").read())
    (broken / "train.mask.bin").write_bytes(b"\x01" * 10)
    with pytest.raises(UserError, match="train.mask.bin is missing or not one byte per token"):
        data.Loader(str(broken), "train", 16, 2, 1, seed=0)


@pytest.mark.parametrize("line, match", [
    ('{"messages": "hello"}', "'messages' is not a list"),
    ('{"messages": [{"role": "bot", "content": "x"}]}',
     "message 1 has role 'bot': use system, user or assistant"),
    ('{"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": 3}]}',
     "message 2's content is int, not a string"),
    ('{"messages": []}', "empty conversation"),
    ('{"messages": [{"role": "user", "content": "q"}]}', "no assistant message"),
    ('{"prompt": "q", "response": null}', "'prompt' and 'response' must both be strings"),
    ('{"text": "plain text"}', "not a chat record"),
    ('{"messages": [}', "malformed JSON"),
])
def test_bad_chat_records_name_file_and_line(tmp_path, line, match):
    good = json.dumps({"prompt": "q", "response": "a"})
    path = write_jsonl(tmp_path / "bad.jsonl", [good, good, "", line])
    with pytest.raises(UserError, match=rf"bad.jsonl:4: .*{match}"):
        prepare.prepare(path, str(tmp_path / "o"), "cl100k_base", 512, verbose=False)
    # no partial files, no meta.json, no temp directory
    assert os.listdir(tmp_path) == ["bad.jsonl"]


def test_format_detection_and_mixing(tmp_path):
    text = json.dumps({"text": "hello"})
    chat = json.dumps({"prompt": "q", "response": "a"})
    path = write_jsonl(tmp_path / "mix.jsonl", [text, chat])
    with pytest.raises(UserError, match=r"mix.jsonl:2: a chat record in a text source"):
        prepare.prepare(path, str(tmp_path / "o"), "cl100k_base", 512, verbose=False)
    with pytest.raises(UserError, match=r"mix.jsonl:1: not a chat record"):
        prepare.prepare(path, str(tmp_path / "o"), "cl100k_base", 512, format="chat",
                        verbose=False)
    files = [path]
    assert prepare.detect_format("jsonl", files) == "text"
    write_jsonl(tmp_path / "mix.jsonl", ["", chat, text])
    assert prepare.detect_format("jsonl", files) == "chat"
    assert prepare.detect_format("jsonl", files, format="text") == "text"
    with pytest.raises(UserError, match="format=chat needs .jsonl"):
        prepare.detect_format("text", ["a.txt"], format="chat")
    with pytest.raises(UserError, match="format='sft' is unknown"):
        prepare.detect_format("jsonl", files, format="sft")


def test_doc_ids():
    E = 9
    x = torch.tensor([[5, 6, E, 7, E, E, 8, 8],
                      [E, 1, 2, 3, 4, 5, 6, 7]])
    assert data.doc_ids(x, E).tolist() == [[0, 0, 0, 1, 1, 2, 3, 3],
                                           [0, 1, 1, 1, 1, 1, 1, 1]]
    assert data.doc_ids(x, E).dtype == torch.long
    stacked = torch.stack([x, x.flip(-1)])  # (M, B, T): rows stay independent
    assert data.doc_ids(stacked, E)[0].tolist() == data.doc_ids(x, E).tolist()
    assert data.doc_ids(stacked, E)[1].tolist() == [[0, 0, 0, 1, 2, 2, 3, 3], [0] * 8]


def test_cli_prepares_chat_with_extra_tokens(tmp_path):
    src = write_jsonl(tmp_path / "c.jsonl", conversations(30))
    (tmp_path / "t.txt").write_text("<|tool|>\n")
    p = subprocess.run(
        [sys.executable, os.path.join(ROOT, "prepare.py"), src, "--out", str(tmp_path / "out"),
         "--vocab_size", "512", "--val_fraction", "0.3", "--extra_tokens", str(tmp_path / "t.txt"),
         "--format", "chat"], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    meta = json.load(open(tmp_path / "out" / "meta.json"))
    assert (meta["format"] == "chat"
            and meta["extra_tokens"] == tokenizer.CHAT_TOKENS + ["<|tool|>"])
    assert "assistant replies" in p.stdout
    p = subprocess.run([sys.executable, os.path.join(ROOT, "prepare.py"),
                        src, "--extra_tokens", "nope.txt"],
                       capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert p.returncode == 1 and p.stderr.strip().splitlines() == [
        "error: extra tokens file 'nope.txt' not found: give a text file with one token per line"]


# ------------------------------------------------------------------ SFT runs, on every layout

@pytest.fixture(scope="module")
def sft_single(chat_dataset, tmp_path_factory):
    # the dense document mask, the reference the layouts' default (each document's own) meets
    out = str(tmp_path_factory.mktemp("sft") / "run")
    run_train([*SFT, f"dataset={chat_dataset}", f"out_dir={out}", "doc_attention=dense"],
              cwd=os.path.dirname(out), fork=True)
    return read_metrics(out)


@pytest.mark.parametrize("nproc, extra", [(2, []), (2, ["pp=2"]), (2, ["fsdp=True"])])
def test_sft_with_masks_and_doc_mask_on_every_layout(nproc, extra, chat_dataset, sft_single,
                                                     tmp_path):
    out = str(tmp_path / "run")
    torchrun(nproc, [*SFT, f"dataset={chat_dataset}", f"out_dir={out}", *extra], cwd=tmp_path)
    assert_same_curve(sft_single, read_metrics(out))


def test_sft_loss_counts_only_assistant_tokens_and_neftune_only_trains(chat_dataset, sft_single,
                                                                       tmp_path):
    meta = json.load(open(os.path.join(chat_dataset, "meta.json")))
    assert meta["format"] == "chat" and meta["vocab_size"] == 512 + 4  # the chat tokens
    # the logged loss is the masked loss: recompute iteration 0's from the same weights and batch
    model = Transformer(
        ModelConfig(vocab_size=516, block_size=32, n_layer=4, n_head=4, n_kv_head=2, n_embd=32),
        seed=1337)
    x, y, mask = data.Loader(chat_dataset, "train", 32, 4, 4, 1337).batch(0)
    assert 0 < mask.mean() < 1
    with torch.no_grad():
        losses = [model(x[k], y[k], mask[k], data.doc_ids(x[k], meta["eot_token"]))[1]
                  for k in range(4)]
    counts = mask.sum(dim=(1, 2))
    assert len(set(counts.tolist())) > 1  # micro-batches with different numbers of target tokens
    # token-weighted: the mean over every assistant token of the global batch, not the mean of
    # the four micro-batch means
    weighted = sum(loss * n for loss, n in zip(losses, counts)).item() / counts.sum().item()
    assert abs(sft_single[1]["loss"] - weighted) < 1e-5
    # the two differ on this data, 10 times the tolerance above: the test can tell
    assert abs(sum(losses).item() / 4 - weighted) > 1e-4
    out = str(tmp_path / "neft")
    run_train([*SFT, f"dataset={chat_dataset}", f"out_dir={out}", "neftune_alpha=5"], cwd=tmp_path,
              fork=True)
    neft = read_metrics(out)
    # the val loss before training: evaluation has no noise
    assert neft[0]["val_loss"] == sft_single[0]["val_loss"]
    assert neft[1]["loss"] != sft_single[1]["loss"]  # training forward does


def test_sft_loss_and_grad_norm_do_not_depend_on_the_micro_batch_split(chat_dataset, tmp_path):
    """The same 16 sequences per iteration, cut 16x1, 4x4, 2x8 and 1x16 (batch_size x
    grad_accum_steps): one objective (the mean over all target tokens of the global batch), so
    the same losses and gradient norms at iteration 0 and after 5 steps, and the same val loss."""
    curves = []
    for b, g in ((16, 1), (4, 4), (2, 8), (1, 16)):
        out = str(tmp_path / f"split{b}x{g}")
        run_train(
            [*SFT, f"dataset={chat_dataset}", f"out_dir={out}", f"batch_size={b}",
             f"grad_accum_steps={g}", "max_iters=6", "eval_interval=6"], cwd=tmp_path, fork=True)
        curves.append(read_metrics(out))
    for other in curves[1:]:
        assert_same_curve(curves[0], other)
