"""The continual-pretraining workflow end to end: start from a Hugging Face LLaMA, grow the
vocabulary, export (SFT on the layouts is in test_sft.py)."""

import json
import os

import numpy as np
import torch
import torch.nn.functional as F
from conftest import RUN, read_metrics, run_train, torchrun
from transformers import AutoTokenizer, LlamaForCausalLM

import checkpoint
import data
from model import ModelConfig, Transformer


def test_continual_pretraining_from_hf_on_two_ranks(hf_dir, dataset, tmp_path):
    out, export = str(tmp_path / "run"), str(tmp_path / "exported")
    p = torchrun(2, [*RUN, f"dataset={dataset}", f"out_dir={out}", f"init_from={hf_dir}", "max_iters=3",
                     f"export_hf={export}"], cwd=tmp_path, agent=True)
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


def test_the_readme_workflow_pretrain_with_new_words_then_sft_then_export(hf_dir, corpus, tmp_path):
    """The README's continual pretraining -> SFT -> export commands, end to end (one process
    each): stage 1 starts from a Hugging Face LLaMA and grows its vocabulary; stage 2 takes
    init_from= stage 1's out_dir (which has a config.json of its own: our ckpt/ must win)."""
    words = tmp_path / "domain.txt"
    words.write_text("def __init__(self\nreturn None\n")
    out = str(tmp_path / "run")
    p = run_train([*RUN, "dataset=domain", f"data_source={corpus}", f"extra_tokens={words}", "val_fraction=0.2", f"out_dir={out}",
                   f"init_from={hf_dir}", "max_iters=3"], cwd=tmp_path)
    assert "growing the vocabulary from 512 to 514" in p.stdout
    meta = json.load(open(tmp_path / "data" / "domain" / "meta.json"))
    assert meta["vocab_size"] == 514 and meta["extra_tokens"] == ["def __init__(self", "return None"]
    tokens = torch.from_numpy(np.fromfile(tmp_path / "data" / "domain" / "train.bin", dtype="uint16").astype("int64"))
    assert (tokens == 512).sum() > 0  # the new token is used in the data
    assert all(r["loss"] == r["loss"] for r in read_metrics(out) if "loss" in r)
    # 2. fine-tune on instructions, from that run's weights
    chats = tmp_path / "chat.jsonl"
    chats.write_text("".join(json.dumps({"prompt": f"What is {i} times 2?", "response": f"It is {2 * i}."}) + "\n"
                             for i in range(60)))
    sft, hf_out = str(tmp_path / "sft"), str(tmp_path / "sft" / "hf")
    p = run_train([*RUN, "dataset=chat", f"data_source={chats}", "val_fraction=0.2", "doc_mask=True", "neftune_alpha=5",
                   f"init_from={out}", f"out_dir={sft}", f"export_hf={hf_out}", "max_iters=3"], cwd=tmp_path)
    # the chat data is tokenized with stage 1's tokenizer: its words keep ids 512, 513, the chat tokens follow
    assert "growing the vocabulary from 514 to 518" in p.stdout and "exported the model" in p.stdout
    chat_meta = json.load(open(tmp_path / "data" / "chat" / "meta.json"))
    assert chat_meta["extra_tokens"] == ["def __init__(self", "return None", *data.CHAT_TOKENS]
    assert LlamaForCausalLM.from_pretrained(hf_out).config.vocab_size == len(AutoTokenizer.from_pretrained(hf_out)) == 518
    enc = data.tokenizer_from_meta(chat_meta)  # with the chat tokens
    text = "<|user|>What is 7 times 2?<|end|><|assistant|>"
    assert AutoTokenizer.from_pretrained(hf_out)(text).input_ids == data.encode(enc, text)
    # 3. or export any checkpoint later
    run_train([f"out_dir={sft}", f"export_hf={tmp_path / 'later'}"], cwd=tmp_path, script="sample.py")
    assert os.path.isfile(tmp_path / "later" / "model.safetensors")
