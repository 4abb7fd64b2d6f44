"""The continual-pretraining workflow end to end: start from a Hugging Face LLaMA, grow the
vocabulary, SFT with loss masks and document masking on every layout, NEFTune, export."""

import json
import os

import pytest
import torch
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM

import data
import checkpoint
from conftest import TINY, assert_same_curve, read_metrics, run_train, torchrun
from model import ModelConfig, Transformer

HF = dict(vocab_size=512, hidden_size=32, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
          num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-5, tie_word_embeddings=False)
# the model's shape comes from the HF directory, so only the run keys of TINY
RUN = [a for a in TINY if not a.startswith(("n_layer=", "n_head=", "n_kv_head=", "n_embd="))]


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    torch.manual_seed(0)
    path = str(tmp_path_factory.mktemp("hf") / "llama")
    LlamaForCausalLM(LlamaConfig(**HF)).eval().save_pretrained(path)
    return path


def test_continual_pretraining_from_hf_on_two_ranks(hf_dir, dataset, tmp_path):
    out, export = str(tmp_path / "run"), str(tmp_path / "exported")
    p = torchrun(2, [*RUN, f"dataset={dataset}", f"out_dir={out}", f"init_from={hf_dir}", "max_iters=3",
                     f"export_hf={export}"], cwd=tmp_path)
    assert "dp=2" in p.stdout and "exported the model as a Hugging Face LLaMA" in p.stdout
    # the first step's loss is the HF model's loss on the same global batch: its weights were loaded
    hf = LlamaForCausalLM.from_pretrained(hf_dir).eval()
    x, y, _ = data.Loader(dataset, "train", 32, 4, 2, 1337).batch(0)
    with torch.no_grad():
        want = sum(F.cross_entropy(hf(x[k]).logits.flatten(0, 1), y[k].flatten()) for k in range(2)) / 2
    first = next(r for r in read_metrics(out) if "loss" in r)
    assert abs(first["loss"] - want.item()) < 1e-4
    # the export at the end loads into transformers and gives our final model's logits
    ours = Transformer(ModelConfig(**json.load(open(f"{out}/ckpt/iter_0000003/meta.json"))["model"]))
    checkpoint.load(f"{out}/ckpt/iter_0000003", ours, no_dist=True)
    back = LlamaForCausalLM.from_pretrained(export).eval()
    with torch.no_grad():
        torch.testing.assert_close(back(x[0]).logits, ours.eval()(x[0])[0], rtol=1e-4, atol=1e-4)
    # the same command again continues the run from its checkpoint instead of the HF weights
    p = torchrun(2, [*RUN, f"dataset={dataset}", f"out_dir={out}", f"init_from={hf_dir}", "max_iters=5"], cwd=tmp_path)
    assert f"resumed from {out}/ckpt/iter_0000003" in p.stdout


def test_vocabulary_expansion_from_hf(hf_dir, corpus, tmp_path):
    words = tmp_path / "domain.txt"
    words.write_text("def __init__(self\nreturn None\n")
    out = str(tmp_path / "run")
    p = run_train([*RUN, "dataset=domain", f"data_source={corpus}", f"extra_tokens={words}", "val_fraction=0.2", f"out_dir={out}",
                   f"init_from={hf_dir}", "max_iters=3"], cwd=tmp_path)
    assert "growing the vocabulary from 512 to 514" in p.stdout
    meta = json.load(open(tmp_path / "data" / "domain" / "meta.json"))
    assert meta["vocab_size"] == 514 and meta["extra_tokens"] == ["def __init__(self", "return None"]
    tokens = torch.from_numpy(__import__("numpy").fromfile(tmp_path / "data" / "domain" / "train.bin", dtype="uint16").astype("int64"))
    assert (tokens == 512).sum() > 0  # the new token is used in the data
    assert all(r["loss"] == r["loss"] for r in read_metrics(out) if "loss" in r)


@pytest.fixture(scope="module")
def chat_dataset(tmp_path_factory):
    """Chat JSONL prepared with the chat template: loss masks on assistant tokens."""
    root = tmp_path_factory.mktemp("chat")
    lines = []
    for i in range(80):
        if i % 2:
            lines.append({"prompt": f"What is {i} plus {i}?", "response": f"It is {2 * i}."})
        else:
            lines.append({"messages": [{"role": "system", "content": "You add numbers."},
                                       {"role": "user", "content": f"Add {i} and {i + 1}."},
                                       {"role": "assistant", "content": f"{2 * i + 1}."}]})
    src = root / "chat.jsonl"
    src.write_text("\n".join(json.dumps(r) for r in lines) + "\n")
    out = str(root / "data")
    data.prepare(str(src), out, "cl100k_base", 512, val_fraction=0.2, verbose=False)
    return out


SFT = [*TINY, "n_layer=4", "grad_accum_steps=4", "max_iters=6", "doc_mask=True", "learning_rate=3e-3"]


@pytest.fixture(scope="module")
def sft_single(chat_dataset, tmp_path_factory):
    out = str(tmp_path_factory.mktemp("sft") / "run")
    run_train([*SFT, f"dataset={chat_dataset}", f"out_dir={out}"], cwd=os.path.dirname(out))
    return read_metrics(out)


@pytest.mark.parametrize("nproc, extra", [(2, []), (2, ["pp=2"]), (2, ["fsdp=True"])])
def test_sft_with_masks_and_doc_mask_on_every_layout(nproc, extra, chat_dataset, sft_single, tmp_path):
    out = str(tmp_path / "run")
    torchrun(nproc, [*SFT, f"dataset={chat_dataset}", f"out_dir={out}", *extra], cwd=tmp_path)
    assert_same_curve(sft_single, read_metrics(out))


def test_sft_loss_counts_only_assistant_tokens_and_neftune_only_trains(chat_dataset, sft_single, tmp_path):
    meta = json.load(open(os.path.join(chat_dataset, "meta.json")))
    assert meta["format"] == "chat" and meta["vocab_size"] == 512 + 4  # the chat tokens
    # the logged loss is the masked loss: recompute iteration 0's from the same weights and batch
    torch.manual_seed(1337)
    model = Transformer(ModelConfig(vocab_size=516, block_size=32, n_layer=4, n_head=4, n_kv_head=2, n_embd=32))
    x, y, mask = data.Loader(chat_dataset, "train", 32, 4, 4, 1337).batch(0)
    assert 0 < mask.mean() < 1
    with torch.no_grad():
        losses = [model(x[k], y[k], mask[k], data.doc_ids(x[k], meta["eot_token"]))[1] for k in range(4)]
    counts = mask.sum(dim=(1, 2))
    assert len(set(counts.tolist())) > 1  # micro-batches with different numbers of target tokens
    # token-weighted: the mean over every assistant token of the global batch, not the mean of
    # the four micro-batch means
    weighted = sum(loss * n for loss, n in zip(losses, counts)).item() / counts.sum().item()
    assert abs(sft_single[1]["loss"] - weighted) < 1e-5
    assert abs(sum(losses).item() / 4 - weighted) > 1e-3  # the two differ on this data: the test can tell
    out = str(tmp_path / "neft")
    run_train([*SFT, f"dataset={chat_dataset}", f"out_dir={out}", "neftune_alpha=5"], cwd=tmp_path)
    neft = read_metrics(out)
    assert neft[0] == sft_single[0]  # the val loss before training: evaluation has no noise
    assert neft[1]["loss"] != sft_single[1]["loss"]  # training forward does


def test_sft_loss_and_grad_norm_do_not_depend_on_the_micro_batch_split(chat_dataset, tmp_path):
    """The same 16 sequences per iteration, cut 16x1, 4x4, 2x8 and 1x16 (batch_size x
    grad_accum_steps): one objective (the mean over all target tokens of the global batch), so
    the same losses and gradient norms at iteration 0 and after 5 steps, and the same val loss."""
    curves = []
    for b, g in ((16, 1), (4, 4), (2, 8), (1, 16)):
        out = str(tmp_path / f"split{b}x{g}")
        run_train([*SFT, f"dataset={chat_dataset}", f"out_dir={out}", f"batch_size={b}", f"grad_accum_steps={g}",
                   "max_iters=6", "eval_interval=6"], cwd=tmp_path)
        curves.append(read_metrics(out))
    for other in curves[1:]:
        assert_same_curve(curves[0], other)
