"""
Where a run's weights come from, the first that matches: (1) its own newest intact checkpoint in
out_dir (resume: weights, optimizer state, random streams, iteration), (2) another run's
checkpoint (init_from= its out_dir), (3) a Hugging Face LLaMA directory (init_from= it), or
(4) fresh ones. Also whether the run found in out_dir is this command's, and the model's shape
when it comes from (1)-(3).
"""

import os
from dataclasses import dataclass

import checkpoint
from model import ModelConfig
from parallel import broadcast_object
from guards import guard_ckpt
from guards import guard_config
from guards.guard_config import SHAPE_KEYS
from guards.guard_errors import check


@dataclass
class Source:
    """Where this run's weights come from. kind: "resume" (this run's own newest intact
    checkpoint: weights, optimizer state, RNG and iteration), "run" (another run's newest
    checkpoint: its weights), "hf" (a Hugging Face LLaMA directory) or "fresh"."""
    kind: str
    path: str = None        # the checkpoint (resume, run) or the directory (hf)
    meta: dict = None       # resume, run: the checkpoint's meta.json
    state: dict = None      # resume: its state.pt (the RNG states)
    saved: dict = None      # the model's shape there (ModelConfig fields), None when fresh
    where: str = ""         # for messages
    hf_index: object = None  # hf: the weight files' index (hf.hf_index)
    lora: dict = None       # resume of a LoRA run: its settings (meta.json's "lora")


def weights_source(out_dir, init_from, mesh):
    """The Source of this run's weights: the first of train.py's (1)-(4) that matches."""
    # rank 0's view decides
    saved = broadcast_object(os.path.isdir(os.path.join(out_dir, "ckpt")), mesh)
    # (4), nothing saved here
    if not saved and init_from in ("auto", "scratch"):
        return Source("fresh")
    return _found_source(out_dir, init_from, mesh, saved)


def _found_source(out_dir, init_from, mesh, saved):
    """weights_source where out_dir holds checkpoints or init_from names where to start."""
    ckpt = checkpoint.find(out_dir, mesh, warn=mesh.print0) if saved else None
    check(not (init_from == "resume" and ckpt is None), f"init_from=resume but {out_dir}/ckpt has "
                                                        f"no checkpoint: use "
                                                        f"init_from=auto (or scratch), or the "
                                                        f"out_dir of the run to continue")
    check(not (init_from == "scratch" and ckpt), f"init_from=scratch but {out_dir} holds "
                                                 f"checkpoints of an earlier "
                                                 f"run: continue it with init_from=auto, or pick "
                                                 f"a new out_dir (or delete {out_dir}/ckpt)")
    if ckpt:                                                                # (1)
        meta, state = guard_ckpt.read_meta(ckpt)
        return Source("resume", ckpt, meta, state, meta["model"], f"the checkpoint in {out_dir}",
                      lora=meta.get("lora"))
    if init_from in ("auto", "scratch", "resume"):                          # (4)
        return Source("fresh")
    return start_from(init_from, mesh)


def start_from(init_from, mesh):
    """(2) or (3): the Source of a run that starts from another model's weights."""
    if os.path.isdir(os.path.join(init_from, "ckpt")):                      # (2)
        ckpt = checkpoint.find(init_from, mesh, warn=mesh.print0)
        check(ckpt is not None, f"init_from={init_from} is a run directory with no checkpoint in "
                                f"ckpt/: train it "
                                f"first, or point at another run or a Hugging Face model")
        meta = guard_ckpt.read_meta(ckpt)[0]
        check(not meta.get("lora"), f"init_from={init_from} is a LoRA run: start from its merged "
                                    "model (export_hf= of train.py or sample.py), or its base "
                                    "with lora_from= its export_lora")
        return Source("run", ckpt, meta, saved=meta["model"], where=f"the checkpoint {ckpt}")
    from formats import hf                                                               # (3)
    saved, index = hf.hf_index(init_from)
    return Source("hf", init_from, saved=saved, where=f"the Hugging Face model in {init_from}",
                  hf_index=index)


def finished(src, c, out_dir, mesh):
    """True (after one line saying so) when the run in out_dir has reached max_iters: this one
    then exits without touching anything."""
    it = src.meta["iter"]
    if it >= c["max_iters"]:
        done = f"{out_dir} holds a finished run (iteration {it}, max_iters={c['max_iters']})"
        # an export is written by the run that ends: a finished one must not skip it silently
        check(not c["export_hf"], f"{done}, and export_hf= is written when a run ends: `python "
                                  f"sample.py "
                                  f"out_dir={out_dir} export_hf={c['export_hf']}` exports it now")
        check(not c["export_lora"], f"{done}, and export_lora= is written when a run ends: raise "
                                    "max_iters= (it exports after the last iteration), or export "
                                    f"the merged model with `python sample.py out_dir={out_dir} "
                                    "export_hf=DIR`")
        mesh.print0(f"{done}: nothing to do; raise max_iters= to train further, or pick a new "
                    f"out_dir")
        return True
    return False


def saved_shape(src, overrides, base_vocab, c, world):
    """The ModelConfig of a model that comes from a checkpoint or a model directory: its shape
    from there, the run's own keys (block_size, dropout, ...) from the config `c`."""
    run_keys = {k: c[k]
                for k in ("block_size", "dropout", "neftune_alpha", "loss_chunk",
                          "loss_recompute", "doc_attention", "moe_aux_weight", "moe_z_weight",
                          "moe_bias_rate")
                # (the aux weight: a base's own, unless the run gives one)
                if k != "moe_aux_weight" or k in overrides or k not in src.saved}
    cfg = ModelConfig(**{**src.saved, **run_keys})
    guard_config.check_saved_shape(cfg, src, overrides, base_vocab, c, world)
    return cfg


def load_whole_into(model, src):
    """(2) or (3) into a model built whole: every rank reads all of it."""
    if src.kind == "hf":
        from formats import hf
        weights = hf.load_hf(src.path)[1]
        if model.cfg.tie_embeddings:  # one tensor under two names
            weights.setdefault("output.weight", weights["tok_embeddings.weight"])
        model.load_state_dict(weights)
    else:
        checkpoint.load(src.path, model, no_dist=True)


def check_finite_base(model, src, mesh):
    """A Hugging Face model of NaN or inf weights, refused as it is loaded: found after the
    first step, the line would blame training."""
    check(guard_ckpt.all_finite(model, bool(mesh.backend)),
          f"{src.where} holds non-finite weights (NaN or inf): download or export it again")


def config_line(c, src, spec):
    """The config: line of a run whose weights come from a model or a checkpoint (src.saved):
    its shape keys and its tokenizer (spec: its file or encoding, and its size) are the
    model's, whatever the config says, and marked so."""
    model = {k: src.saved[k] for k in SHAPE_KEYS if k in src.saved}
    if spec:
        model.update(tokenizer=spec["tokenizer"], vocab_size=spec["vocab_size"])
    keys = " ".join(f"{k}={model.get(k, v)!r}" + "*" * (k in model) for k, v in c.items())
    return f"config: {keys} (*: the model's, from {src.where})"
