"""LoRA: adapters on a frozen base, on every layout, against the real peer (PEFT): its adapter
files load through peft.PeftModel on top of the Hugging Face base and give our logits."""

import json
import os
import shutil

import pytest
import torch
import torch.distributed.checkpoint as dcp
from conftest import (
    RUN,
    TINY,
    assert_same_curve,
    read_metrics,
    run_train,
    spawn,
    torchrun,
)

import faults
from model import ModelConfig, Transformer
from formats import hf
from guards.guard_errors import UserError
from techniques import fsdp
from techniques import lora
from techniques.lora import LoRALinear, apply_lora, merge_lora
from techniques.pipeline import make_stage

ALL = "wq,wk,wv,wo,w1,w2,w3,output"
# every target, clipping on, a poisoned iteration for the NaN guard (4 is skipped: tests/faults.py,
# NAN), a checkpoint at 3; the default optim=muon (the adapters train with AdamW)
LORA = [*[a for a in RUN if a != "optim=adamw"], "max_iters=6", "lora_rank=4", "lora_alpha=8",
        f"lora_targets={ALL}", "ckpt_interval=3", "grad_clip=0.5"]
NAN = dict(script="tests/faults.py", env=faults.nan_at(4))
CFG = ModelConfig(vocab_size=512, block_size=32, n_layer=2, n_head=4, n_kv_head=2, n_embd=32,
                  ffn_dim=96)


@pytest.fixture(scope="module")
def single(hf_dir, dataset, tmp_path_factory):
    """One process: train, export both ways, and resume a second run half-way."""
    root = tmp_path_factory.mktemp("lora")
    out = str(root / "run")
    p = run_train([*LORA, f"dataset={dataset}", f"out_dir={out}", f"init_from={hf_dir}",
                   f"export_lora={root / 'adapter'}", f"export_hf={root / 'merged'}"],
                  cwd=root, **NAN, fork=True)
    return {"root": root, "out": out, "stdout": p.stdout, "metrics": read_metrics(out)}


def base_model(hf_dir):
    _, sd = hf.load_hf(hf_dir)
    model = Transformer(CFG)
    model.load_state_dict(sd)
    return model.eval()


def ids(seed=1):
    return torch.randint(0, 512, (2, 24), generator=torch.Generator().manual_seed(seed))


def test_step0_is_the_base_and_training_moves_only_the_adapters(hf_dir):
    model = base_model(hf_dir)
    x = ids()
    with torch.no_grad():
        want = model(x)[0]
    base = {n: t.clone() for n, t in model.state_dict().items()}
    names = apply_lora(model, 4, 8.0, 0.0, ["wq", "wv", "w2", "output"], seed=1337)
    assert len(names) == 2 * 3 + 1 and isinstance(model.output, LoRALinear)
    assert "layers.0.attention.wq.weight" in model.state_dict()  # the base keeps its names
    with torch.no_grad():
        torch.testing.assert_close(model(x)[0], want, rtol=0, atol=0)  # B = 0: exactly the base
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    model.train()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2,
                            weight_decay=0.1)
    for _ in range(3):
        _, loss = model(x[:, :-1], x[:, 1:])
        loss.backward()
        opt.step()
        opt.zero_grad()
    after = model.state_dict()
    for n, t in base.items():
        assert torch.equal(after[n], t), f"{n} (frozen) changed"
    assert all(not torch.equal(after[n], torch.zeros_like(after[n])) for n in trainable
               if "lora_B" in n)
    # merge: W + (alpha / r) B A gives the adapter's logits; unmerge gives the base weight back
    model.eval()
    with torch.no_grad():
        lora_logits = model(x)[0]
        merge_lora(model)
        torch.testing.assert_close(model(x)[0], lora_logits, rtol=1e-5, atol=1e-5)
        for m in model.modules():
            if isinstance(m, LoRALinear):
                m.unmerge()
        torch.testing.assert_close(model.output.weight, base["output.weight"], rtol=0, atol=1e-6)


def test_adapter_init_is_layout_independent():
    """A pipeline stage builds only its layers; its adapters must equal the whole model's."""
    torch.manual_seed(0)
    whole = Transformer(CFG)
    apply_lora(whole, 4, 8.0, 0.0, ["wq", "w1"], seed=7)
    torch.manual_seed(0)
    stage = make_stage(Transformer(CFG), 1, 2)
    apply_lora(stage, 4, 8.0, 0.0, ["wq", "w1"], seed=7)
    got = {n: t for n, t in stage.state_dict().items() if "lora_A" in n}
    assert got and all(torch.equal(t, whole.state_dict()[n]) for n, t in got.items())
    a = whole.state_dict()
    assert not torch.equal(a["layers.0.attention.wq.lora_A.weight"],
                           a["layers.1.attention.wq.lora_A.weight"])


def fsdp_memory(mesh):
    """Per-rank bytes under fsdp=2 with LoRA, after one step: (memory_bytes,
    adapter values held here)."""
    import parallel
    torch.manual_seed(0)
    model = Transformer(CFG)
    apply_lora(model, 4, 8.0, 0.0, ["wq", "wk", "wv", "wo"], seed=1)
    fsdp.fully_shard_model(model, mesh)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    x = ids()
    model(x[:, :-1], x[:, 1:])[1].backward()
    opt.step()
    local = [parallel._local(p) for p in model.parameters() if p.requires_grad]
    return parallel.memory_bytes(model, opt), sum(t.numel() for t in local), len(local)


def test_optimizer_holds_only_the_adapters_per_rank():
    # one process: AdamW's exp_avg and exp_avg_sq (2 x 4 bytes) per adapter value, plus one
    # 4-byte step counter per adapter tensor; nothing for the frozen base
    torch.manual_seed(0)
    model = Transformer(CFG)
    full = model.num_params()
    apply_lora(model, 4, 8.0, 0.0, ["wq", "wk", "wv", "wo"], seed=1)
    lora = [p for p in model.parameters() if p.requires_grad]
    n = sum(p.numel() for p in lora)
    # wq, wk/wv (GQA: 16 out), wo; 2 layers
    assert n == 2 * (4 * (32 + 32) + 2 * 4 * (32 + 16) + 4 * (32 + 32))
    opt = torch.optim.AdamW(lora, lr=1e-3)
    model(ids()[:, :-1], ids()[:, 1:])[1].backward()
    opt.step()
    import parallel
    mem = parallel.memory_bytes(model, opt)
    assert mem["optimizer"] == 8 * n + 4 * len(lora) and mem["optimizer"] < 8 * full / 20
    assert mem["grads"] == 4 * n
    # fsdp=2: each rank holds half of every adapter's state
    for mem, n_local, tensors in spawn(fsdp_memory, 2):
        assert mem["optimizer"] == 8 * n_local + 4 * tensors and n_local == n // 2


def test_checkpoints_hold_the_adapters_and_resume_exactly(single, hf_dir, dataset):
    assert "trainable parameters" in single["stdout"] and "iter 4: non-finite" in single["stdout"]
    assert "optim=muon with LoRA: the adapters train with AdamW" in single["stdout"]
    ckpt = os.path.join(single["out"], "ckpt", "iter_0000006")
    meta = json.load(open(os.path.join(ckpt, "meta.json")))
    assert meta["lora"]["rank"] == 4 and meta["lora"]["base"]["kind"] == "hf"
    assert meta["lora"]["base"]["path"] == os.path.abspath(hf_dir)
    keys = dcp.FileSystemReader(ckpt).read_metadata().state_dict_metadata
    model_keys = [k for k in keys if k.startswith("model.")]
    # the base is referenced
    assert model_keys and all(".lora_A." in k or ".lora_B." in k for k in model_keys)
    assert not any("lora" not in k for k in keys if k.startswith("optim."))
    # resume: stop at 3, continue to 6; the same numbers as the uninterrupted run
    out = str(single["root"] / "resumed")
    run_train(
        [*LORA, f"dataset={dataset}", f"out_dir={out}", f"init_from={hf_dir}", "max_iters=3"],
        cwd=single["root"], **NAN, fork=True)
    p = run_train([*LORA, f"dataset={dataset}", f"out_dir={out}", f"init_from={hf_dir}"],
                  cwd=single["root"], **NAN, fork=True)
    assert "resumed from" in p.stdout
    assert_same_curve(single["metrics"], read_metrics(out), exact=True)
    # the base changed under the run: resuming is refused with one line
    moved = str(single["root"] / "base_copy")
    shutil.copytree(hf_dir, moved)
    out2 = str(single["root"] / "changed")
    run_train([*LORA, f"dataset={dataset}", f"out_dir={out2}",
               f"init_from={moved}", "max_iters=3"],
              cwd=single["root"], **NAN, fork=True)
    cfg = json.load(open(os.path.join(moved, "config.json")))
    json.dump({**cfg, "rms_norm_eps": 1e-6}, open(os.path.join(moved, "config.json"), "w"))
    p = run_train([*LORA, f"dataset={dataset}", f"out_dir={out2}"], cwd=single["root"],
                  check=False, **NAN, fork=True)
    assert p.returncode != 0 and "has changed since this LoRA run started" in p.stderr


def test_exports_load_in_peft_and_transformers(single, hf_dir, dataset):
    ours, _ = lora.load_lora_whole(os.path.join(single["out"], "ckpt", "iter_0000006"))
    ours.eval()
    # here, not at the top: the spawned ranks of this file would import them too
    from peft import PeftModel
    from transformers import LlamaForCausalLM
    x = ids()
    with torch.no_grad():
        want = ours(x)[0]
        # the adapters did learn
        assert not torch.allclose(want, base_model(hf_dir)(x)[0], atol=1e-3)
        cfg = json.load(open(single["root"] / "adapter" / "adapter_config.json"))
        assert cfg["r"] == 4 and cfg["lora_alpha"] == 8 and "q_proj" in cfg["target_modules"]
        peft = PeftModel.from_pretrained(LlamaForCausalLM.from_pretrained(hf_dir),
                                         single["root"] / "adapter").eval()
        torch.testing.assert_close(peft(x).logits, want, rtol=1e-4, atol=1e-4)
        merged = LlamaForCausalLM.from_pretrained(single["root"] / "merged").eval()
        torch.testing.assert_close(merged(x).logits, want, rtol=1e-4, atol=1e-4)
    # PEFT's own save of the same adapter reads back as ours (its names, its config keys); by
    # default PEFT also saves the whole head beside an lm_head adapter: refused, not half-read
    peft.save_pretrained(single["root"] / "peft_with_head")
    with pytest.raises(UserError, match="save_embedding_layers"):
        lora.load_peft_lora(single["root"] / "peft_with_head")
    peft.save_pretrained(single["root"] / "peft_saved", save_embedding_layers=False)
    settings, sd = lora.load_peft_lora(single["root"] / "peft_saved")
    assert settings["rank"] == 4 and settings["targets"] == sorted(ALL.split(","))
    for n, t in sd.items():
        torch.testing.assert_close(t, ours.state_dict()[n], rtol=0, atol=0)
    # lora_from: a new run from the base and that adapter evaluates to the trained run's val loss
    out = str(single["root"] / "from_adapter")
    run_train([*RUN, f"dataset={dataset}", f"out_dir={out}", f"init_from={hf_dir}",
               f"lora_from={single['root'] / 'peft_saved'}", "max_iters=0"], cwd=single["root"],
              fork=True)
    final = [r["val_loss"] for r in single["metrics"] if r.get("iter") == 6 and "val_loss" in r]
    assert abs(read_metrics(out)[0]["val_loss"] - final[0]) < 1e-5


# tp=2: the adapters are sliced like their bases (column: B cut, A whole; row: A cut, B whole),
# the whole factor's gradient summed over the tp group; the exports gather them
@pytest.mark.parametrize("extra",
                         [[], ["pp=2"], ["fsdp=True"], ["zero=1", "offload=True"],
                          ["ddp_impl=torch"], ["tp=2"]],
                         ids=["dp2", "pp2", "fsdp2", "zero1-offload", "torch-dp2", "tp2"])
def test_lora_on_every_layout(extra, single, hf_dir, dataset, tmp_path):
    out = str(tmp_path / "run")
    # pp / fsdp / tp rebuild the model on rank 0
    exports = [f"export_lora={tmp_path / 'adapter'}"] if extra else []
    exports += [f"export_hf={tmp_path / 'merged'}"] if "tp=2" in extra else []
    p = torchrun(2,
                 [*LORA, f"dataset={dataset}", f"out_dir={out}",
                  f"init_from={hf_dir}", *extra, *exports],
                 cwd=tmp_path, env=NAN["env"])
    assert "lora: r=4" in p.stdout
    assert_same_curve(single["metrics"], read_metrics(out), rtol=1e-5)
    if exports:
        _, want = lora.load_peft_lora(single["root"] / "adapter")
        _, got = lora.load_peft_lora(tmp_path / "adapter")
        assert got.keys() == want.keys()
        for n in want:
            torch.testing.assert_close(got[n], want[n], rtol=1e-5, atol=1e-5, msg=n)
        named = json.load(
            open(tmp_path / "adapter" / "adapter_config.json"))["base_model_name_or_path"]
        assert named == os.path.abspath(hf_dir)  # a Hugging Face base names itself
    if "tp=2" in extra:  # the merged model, W + (alpha / r) B A
        want, got = (hf.load_hf(d)[1] for d in (single["root"] / "merged", tmp_path / "merged"))
        assert got.keys() == want.keys()
        for n in want:
            torch.testing.assert_close(got[n], want[n], rtol=1e-5, atol=1e-6, msg=n)


@pytest.mark.parametrize("args, message", [
    (["lora_rank=4", "lora_targets=wq,qkv"], "lora_targets='wq,qkv'"),
    (["lora_rank=4"], "LoRA adapts a trained model"),
    (["lora_rank=-1"], "lora_rank=-1 must not be negative"),
    (["export_lora=x"], "export_lora= needs a LoRA run"),
])
def test_lora_mistakes_are_one_line(args, message, dataset, tmp_path):
    p = run_train([*TINY, f"dataset={dataset}",
                   f"out_dir={tmp_path / 'run'}", "max_iters=1", *args],
                  cwd=tmp_path, check=False, fork=True)
    assert (p.returncode != 0 and message in p.stderr
            and "Traceback" not in p.stderr), p.stderr[-2000:]
