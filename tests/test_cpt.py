"""The continual-pretraining workflow end to end: start from a Hugging Face LLaMA, grow the
vocabulary, export (SFT on the layouts is in test_sft.py)."""

import json
import os
import re

import numpy as np
import pytest
import test_tokenizer
import torch
import torch.nn.functional as F
from conftest import HF, RUN, read_metrics, run_train, torchrun
from transformers import AutoTokenizer, LlamaForCausalLM

import checkpoint
import data
import tokenizer
from model import ModelConfig, Transformer


def test_continual_pretraining_from_hf_on_two_ranks(hf_dir, dataset, tmp_path):
    out, export = str(tmp_path / "run"), str(tmp_path / "exported")
    p = torchrun(2,
                 [*RUN, f"dataset={dataset}", f"out_dir={out}", f"init_from={hf_dir}",
                  "max_iters=3", f"export_hf={export}"], cwd=tmp_path, agent=True)
    assert "dp=2" in p.stdout and "exported the model as a Hugging Face LLaMA" in p.stdout
    # the first step's loss is the HF model's loss on the same global batch:
    # its weights were loaded
    hf = LlamaForCausalLM.from_pretrained(hf_dir).eval()
    x, y, _ = data.Loader(dataset, "train", 32, 4, 2, 1337).batch(0)
    with torch.no_grad():
        want = sum(F.cross_entropy(hf(x[k]).logits.flatten(0, 1), y[k].flatten())
                   for k in range(2)) / 2
    first = next(r for r in read_metrics(out) if "loss" in r)
    assert abs(first["loss"] - want.item()) < 1e-4
    # the export at the end loads into transformers and gives our final model's logits
    ours = Transformer(
        ModelConfig(**json.load(open(f"{out}/ckpt/iter_0000003/meta.json"))["model"]))
    checkpoint.load(f"{out}/ckpt/iter_0000003", ours, no_dist=True)
    back = LlamaForCausalLM.from_pretrained(export).eval()
    with torch.no_grad():
        torch.testing.assert_close(back(x[0]).logits, ours.eval()(x[0])[0], rtol=1e-4, atol=1e-4)
    # the same command again continues the run from its checkpoint instead of the HF weights
    p = torchrun(
        2, [*RUN, f"dataset={dataset}", f"out_dir={out}", f"init_from={hf_dir}", "max_iters=5"],
        cwd=tmp_path)
    assert f"resumed from {out}/ckpt/iter_0000003" in p.stdout


def test_the_readme_workflow_pretrain_with_new_words_then_sft_then_export(
        hf_dir, corpus, tmp_path):
    """The README's continual pretraining -> SFT -> export commands, end to end (one process
    each): stage 1 starts from a Hugging Face LLaMA and grows its vocabulary; stage 2 takes
    init_from= stage 1's out_dir (which has a config.json of its own: our ckpt/ must win)."""
    words = tmp_path / "domain.txt"
    words.write_text("def __init__(self\nreturn None\n")
    out = str(tmp_path / "run")
    p = run_train([*RUN, "dataset=domain", f"data_source={corpus}",
                   f"extra_tokens={words}", "val_fraction=0.2", f"out_dir={out}",
                   f"init_from={hf_dir}", "max_iters=3"], cwd=tmp_path, fork=True)
    assert "growing the vocabulary from 512 to 514" in p.stdout
    # a from-scratch rate (RUN's 1e-2) on a trained model: one line naming the recipes
    assert p.stdout.count("is a from-scratch rate") == 1 and "config/cpt.py" in p.stdout
    assert "passes the training data" not in p.stdout  # under 3 passes
    meta = json.load(open(tmp_path / "data" / "domain" / "meta.json"))
    assert (meta["vocab_size"] == 514
            and meta["extra_tokens"] == ["def __init__(self", "return None"])
    tokens = torch.from_numpy(
        np.fromfile(tmp_path / "data" / "domain" / "train.bin", dtype="uint16").astype("int64"))
    assert (tokens == 512).sum() > 0  # the new token is used in the data
    assert all(r["loss"] == r["loss"] for r in read_metrics(out) if "loss" in r)
    # 2. fine-tune on instructions, from that run's weights
    chats = tmp_path / "chat.jsonl"
    chats.write_text(
        "".join(json.dumps({"prompt": f"What is {i} times 2?", "response": f"It is {2 * i}."})
                + "\n" for i in range(60)))
    sft, hf_out = str(tmp_path / "sft"), str(tmp_path / "sft" / "hf")
    p = run_train([*RUN, "dataset=chat", f"data_source={chats}", "val_fraction=0.2",
                   "doc_mask=True", "neftune_alpha=5", f"init_from={out}",
                   f"out_dir={sft}", f"export_hf={hf_out}", "max_iters=20"],
                  cwd=tmp_path, fork=True)
    # the chat data is tokenized with stage 1's tokenizer: its words keep ids 512, 513,
    # the chat tokens follow
    assert ("growing the vocabulary from 514 to 518" in p.stdout
            and "exported the model" in p.stdout)
    # 60 short conversations (whole in rows, padded): 20 iterations pass them more than 3 times,
    # and one line says so
    passes = float(p.stdout.split(" epochs by max_iters")[0].rsplit("chunks, ", 1)[1])
    assert passes > 3 and p.stdout.count("passes the training data") == 1
    said = float(p.stdout.split("passes the training data ", 1)[1].split(" times")[0])
    assert abs(said - passes) <= 0.051  # printed to .1f and .2f
    fit = int(p.stdout.split(" is about 3 passes")[0].rsplit("max_iters=", 1)[1])
    assert abs(fit * passes / 20 - 3) < passes / 20
    chat_meta = json.load(open(tmp_path / "data" / "chat" / "meta.json"))
    assert chat_meta["extra_tokens"] == ["def __init__(self", "return None",
                                         *tokenizer.CHAT_TOKENS]
    assert (LlamaForCausalLM.from_pretrained(hf_out).config.vocab_size
            == len(AutoTokenizer.from_pretrained(hf_out)) == 518)
    enc = tokenizer.tokenizer_from_meta(chat_meta)  # with the chat tokens
    text = "<|user|>What is 7 times 2?<|end|><|assistant|>"
    assert AutoTokenizer.from_pretrained(hf_out)(text).input_ids == tokenizer.encode(enc, text)
    # 3. or export any checkpoint later
    run_train([f"out_dir={sft}", f"export_hf={tmp_path / 'later'}"], cwd=tmp_path,
              script="sample.py")
    assert os.path.isfile(tmp_path / "later" / "model.safetensors")


@pytest.mark.parametrize("family", ["llama3", "llama2"])
def test_expansion_export_round_trip_keeps_every_id(family, corpus, tmp_path):
    """A Hugging Face base with its own tokenizer (byte-level Llama 3 style, SentencePiece Llama 2
    style: tests/hf_families.py) -> CPT with extra tokens, three of which the base already has
    as one token (not added again, and said so) -> export: AutoTokenizer loads it with one id
    per embedding row and gives our ids, BOS, EOS and model_max_length are the base's -> init_from=
    the export tokenizes the corpus to the same ids and trains on."""
    from hf_families import write_tokenizer
    from transformers import LlamaConfig
    base, export = tmp_path / "base", tmp_path / "export"
    n = write_tokenizer(family, str(base))
    auto_base = AutoTokenizer.from_pretrained(base)
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**{**HF, "vocab_size": n, "bos_token_id": auto_base.bos_token_id,
                                    "eos_token_id": auto_base.eos_token_id})).save_pretrained(base)
    words = tmp_path / "words.txt"
    words.write_text("import\nself\nreturn\nreturn None\n<|tool|>\n")
    run = [*(a for a in RUN if not a.startswith("vocab_size=")), "max_iters=2", "val_fraction=0.2"]
    p = run_train([*run, "dataset=domain", f"data_source={corpus}",
                   f"extra_tokens={words}", f"init_from={base}",
                   f"out_dir={tmp_path / 'cpt'}", f"export_hf={export}"], cwd=tmp_path, fork=True)
    assert ("3 of the 5 extra tokens are already tokens of" in p.stdout
            and f"from {n} to {n + 2}" in p.stdout)
    meta = json.load(open(tmp_path / "data" / "domain" / "meta.json"))
    assert meta["extra_tokens"] == ["return None", "<|tool|>"] and meta["vocab_size"] == n + 2
    enc = tokenizer.tokenizer_from_meta(meta)
    tok = AutoTokenizer.from_pretrained(export)
    config = json.load(open(export / "config.json"))
    assert (len(tok) == config["vocab_size"] == n + 2
            and tok.convert_tokens_to_ids("<|tool|>") == n + 1)
    assert (tok.bos_token, tok.eos_token, tok.model_max_length) == (
        auto_base.bos_token, auto_base.eos_token, auto_base.model_max_length)
    assert (config["bos_token_id"], config["eos_token_id"]) == (
        auto_base.bos_token_id, auto_base.eos_token_id)
    lines = [*test_tokenizer.varied_lines(), "x = f() ; return None",
             "import self <|tool|> return"]
    bos = [enc.bos_token] if enc.bos_token is not None else []
    assert all(tok(line, split_special_tokens=True).input_ids == bos + tokenizer.encode(enc, line)
               for line in lines)
    # no id decodes to nothing
    assert all(tok.convert_ids_to_tokens(i) is not None for i in range(len(tok)))
    # back into this trainer: the same corpus gets the same ids through the export's tokenizer
    p = run_train([*run, "dataset=again", f"data_source={corpus}", f"init_from={export}",
                   f"out_dir={tmp_path / 'again'}"], cwd=tmp_path, fork=True)
    assert "growing the vocabulary" not in p.stdout
    for split in ("train", "val"):
        assert (tmp_path / "data" / "again" / f"{split}.bin").read_bytes() == \
               (tmp_path / "data" / "domain" / f"{split}.bin").read_bytes()
    losses = [r["loss"] for r in read_metrics(tmp_path / "again") if "loss" in r]
    assert len(losses) == 2 and all(np.isfinite(losses))


def hub_cache(hub, name, src, refs):
    """A Hugging Face hub cache laid out as huggingface_hub lays one: models--ORG--NAME/blobs/
    holding the files of directory src, snapshots/<commit>/ of links into them, refs/<ref>
    naming a commit ({ref: commit}). Returns {commit: its snapshot directory}."""
    repo = hub / ("models--" + name.replace("/", "--"))
    os.makedirs(repo / "blobs", exist_ok=True)
    os.makedirs(repo / "refs", exist_ok=True)
    snaps = {}
    for ref, commit in refs.items():
        (repo / "refs" / ref).write_text(commit)  # (no newline, as huggingface_hub writes it)
        snap = repo / "snapshots" / commit
        os.makedirs(snap, exist_ok=True)
        for f in os.listdir(src):
            blob = repo / "blobs" / f"{commit[:8]}-{f}"
            blob.write_bytes(open(os.path.join(src, f), "rb").read())
            os.symlink(os.path.join("..", "..", "blobs", blob.name), snap / f)
        snaps[commit] = str(snap)
    return snaps


def test_a_model_by_its_hub_name_comes_from_the_local_cache(corpus, tmp_path, monkeypatch,
                                                             capsys):
    """init_from=ORG/NAME (train.py, sample.py eval=True) resolves, offline, to its snapshot in
    the local Hugging Face cache ($HF_HOME/hub, $HF_HUB_CACHE before it), through refs/main;
    ORG/NAME@REV or revision= pick another branch or a commit; a name not in the cache is one
    line naming it, where it looked and `hf download`; a ref that climbs out is none."""
    import sample
    from formats import hf, hf_cache
    from guards.guard_errors import UserError
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=512, block_size=32, n_layer=2, n_head=4, n_kv_head=2, n_embd=32)
    model = Transformer(cfg).eval()
    hf.save_hf(str(tmp_path / "src"), model.state_dict(), cfg,
               tokenizer.get_tokenizer("cl100k_base", 512))
    main, v2 = "1" * 40, "2" * 40
    snaps = hub_cache(tmp_path / "home" / "hub", "org/tiny", str(tmp_path / "src"),
                      {"main": main, "v2": v2})
    monkeypatch.setenv("HF_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.delenv("HUGGINGFACE_HUB_CACHE", raising=False)
    assert hf_cache.local(init_from="org/tiny", lora_from="") == (snaps[main], "")
    assert hf_cache.snapshot("init_from", "org/tiny@v2") == snaps[v2]
    assert hf_cache.snapshot("init_from", "org/tiny", "v2") == snaps[v2]
    assert hf_cache.snapshot("init_from", f"org/tiny@{v2}") == snaps[v2]  # a commit itself
    assert hf_cache.snapshot("init_from", str(tmp_path / "src")) == str(tmp_path / "src")
    with pytest.raises(UserError, match=re.escape(
            f"init_from=org/missing is not a directory, and org/missing (revision main) is not "
            f"in the local Hugging Face cache ({tmp_path / 'home' / 'hub'};")) as e:
        hf_cache.snapshot("init_from", "org/missing")
    assert "download it with `hf download org/missing`, or give" in str(e.value)
    with pytest.raises(UserError, match=re.escape("`hf download org/tiny --revision nope`")):
        hf_cache.snapshot("init_from", "org/tiny@nope")
    with pytest.raises(UserError, match="is not in the local Hugging Face cache"):
        hf_cache.snapshot("init_from", "org/tiny@../../../models--org--tiny/refs/main")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "elsewhere"))
    with pytest.raises(UserError, match=re.escape(f"cache ({tmp_path / 'elsewhere'};")):
        hf_cache.snapshot("init_from", "org/tiny")
    monkeypatch.delenv("HF_HUB_CACHE")

    # train.py from the name: the snapshot's weights, its path kept in config.json
    out = str(tmp_path / "run")
    env = {"HF_HOME": str(tmp_path / "home")}
    data_args = [f"dataset={tmp_path / 'data'}", f"data_source={corpus}"]  # (its tokenizer's)
    p = run_train([*RUN, *data_args, f"out_dir={out}", "init_from=org/tiny@v2", "max_iters=1",
                   "learning_rate=1e-4", "min_lr=1e-5", "warmup_iters=0"], cwd=tmp_path,
                  fork=True, env=env)
    assert snaps[v2] in p.stdout
    assert json.load(open(os.path.join(out, "config.json")))["init_from"] == snaps[v2]
    p = run_train([*RUN, *data_args, f"out_dir={tmp_path / 'no'}", "init_from=org/absent"],
                  cwd=tmp_path, fork=True, env=env, check=False)
    assert p.returncode != 0 and "`hf download org/absent`" in p.stderr
    assert p.stderr.count("error:") == 1
    # sample.py eval=True scores the snapshot
    task = tmp_path / "t.jsonl"
    task.write_text(json.dumps({"context": "import ", "choices": ["os", "sys"], "answer": 0}))
    sample.main(["eval=True", "init_from=org/tiny", f"eval_tasks={task}", "block_size=32"])
    assert f"tasks of {snaps[main]}: t acc " in capsys.readouterr().out
