"""
LoRA: low-rank adapters on a frozen base. The layer (LoRALinear), putting adapters on a
built model and merging them back, the reference to the frozen base that a LoRA run's
checkpoints keep instead of a copy, and adapters in PEFT's format (adapter_config.json +
adapter_model.safetensors) in and out.
"""

import hashlib
import math
import os
import re

import torch
import torch.nn as nn
import torch.nn.functional as F

import checkpoint
from model import ModelConfig, Transformer, param_seed
from parallel import broadcast_object
from formats.hf import HF_NAMES, load_hf, rename, weight_files, write_export_dir
from formats.hf_safetensors import read_safetensors
from guards import guard_chat
from guards import guard_ckpt
from guards.guard_config import LORA_TARGETS, lora_targets
from guards.guard_errors import UserError
from guards.guard_files import lora_in_range, read_json, sha256_file

# LoRA (Hu et al. 2021, arXiv:2106.09685): a frozen weight W plus a trainable low-rank update,
#   y = x W^T + (alpha / r) * dropout(x) A^T B^T,   A: (r, in), B: (out, r)
# B starts at zero, so at step 0 the model is exactly the base model; only A and B train.
# The names follow PEFT's LoraLayer (lora_A.weight, lora_B.weight, scaling = lora_alpha / r,
# dropout on the adapter's input only, A Kaiming-uniform), so that an adapter maps one to
# one onto PEFT's files (save_peft_lora and load_peft_lora below write and read them).


class LoRALinear(nn.Module):
    """An nn.Linear with a LoRA adapter. The base weight stays `.weight` (and its bias, if any,
    `.bias`: Qwen2's q/k/v), so the base's names in checkpoints and Hugging Face files do not
    change."""

    def __init__(self, base, rank, alpha, dropout=0.0):
        super().__init__()
        self.in_features, self.out_features = base.in_features, base.out_features
        # the same Parameters: frozen by apply_lora, not copied
        self.weight, self.bias = base.weight, base.bias
        # skip_init: no draw from the global RNG here (reset_adapter has its own generator)
        dev = base.weight.device
        # weight (r, in)
        self.lora_A = nn.utils.skip_init(nn.Linear, self.in_features, rank, bias=False, device=dev)
        # weight (out, r)
        self.lora_B = nn.utils.skip_init(nn.Linear, rank, self.out_features, bias=False,
                                         device=dev)
        self.scaling = alpha / rank
        self.lora_dropout = nn.Dropout(dropout)
        self.merged = False

    @torch.no_grad()
    def reset_adapter(self, generator):
        # PEFT's (and nn.Linear's) init for A: Kaiming-uniform with a = sqrt(5), i.e.
        # U(-1/sqrt(in), 1/sqrt(in)); B zero: the update B A is zero until B has learned.
        # Drawn on the CPU (a CPU generator), then copied: the same values on every device.
        a = torch.empty(self.lora_A.weight.shape)
        nn.init.kaiming_uniform_(a, a=math.sqrt(5), generator=generator)
        self.lora_A.weight.copy_(a)
        nn.init.zeros_(self.lora_B.weight)

    def delta(self):
        """The update the adapter adds to the weight: (alpha / r) B A, shape (out, in)."""
        return self.scaling * (self.lora_B.weight @ self.lora_A.weight)

    def forward(self, x):
        y = F.linear(x, self.weight, self.bias)
        if self.merged:  # W already holds W + (alpha / r) B A
            return y
        return y + self.lora_B(self.lora_A(self.lora_dropout(x))) * self.scaling

    def pairs(self, x):
        """[(input, weight), ...] whose products add up to forward(x): the base's, and the adapter
        path's (s A x, B) unless merged (model.ChunkedCrossEntropy on a LoRA head)."""
        if self.merged:
            return [(x, self.weight)]
        return [(x, self.weight),
                (self.lora_A(self.lora_dropout(x)) * self.scaling, self.lora_B.weight)]

    @torch.no_grad()
    def merge(self):
        """W <- W + (alpha / r) B A: one matmul per call again, for inference or export."""
        if not self.merged:
            self.weight += self.delta().to(self.weight.dtype)
            self.merged = True

    @torch.no_grad()
    def unmerge(self):
        """W <- W - (alpha / r) B A: back to the base weight (up to float rounding)."""
        if self.merged:
            self.weight -= self.delta().to(self.weight.dtype)
            self.merged = False


def apply_lora(model, rank, alpha, dropout, targets, seed):
    """Puts a LoRA adapter on every linear of `model` whose name ends in one of `targets`
    (of LORA_TARGETS), in place, and freezes every other parameter. Returns the names of the
    wrapped linears. Works on a whole model or a pipeline stage (which wraps what it has).
    Each A is drawn from its own generator, seeded by (seed, its module's name): the same
    adapter whatever the layout, though a pipeline stage builds only some of them."""
    unknown = set(targets) - set(LORA_TARGETS)
    assert not unknown, f"unknown LoRA targets {sorted(unknown)}; choose from {LORA_TARGETS}"
    for p in model.parameters():
        p.requires_grad_(False)
    wrapped = []
    for name, module in list(model.named_modules()):
        if isinstance(module, nn.Linear) and name.split(".")[-1] in targets:
            lora = LoRALinear(module, rank, alpha, dropout)
            lora.reset_adapter(torch.Generator().manual_seed(param_seed(seed, name)))
            parent, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent) if parent else model, child, lora)
            wrapped.append(name)
    return wrapped


def merge_lora(model):
    """Merges every adapter of `model` into its weight (see LoRALinear.merge)."""
    for m in model.modules():
        if isinstance(m, LoRALinear):
            m.merge()
    return model


# ---------------------------------------------------------------------------------------------
# LoRA: the frozen base a run adapts, and adapters in PEFT's format.
#
# Our checkpoints of a LoRA run hold the adapters and their AdamW state only; meta.json's
# "lora" entry references the base: {"kind": "hf" | "ckpt", "path", "sha256"}. Copying a
# multi-GB base into every checkpoint (or even once) would cost what LoRA saves; the price is
# that the base must stay where it was, and the sha256 makes a changed or swapped base an
# error instead of adapters silently applied to the wrong weights.


def base_reference(path, mesh=None):
    """{"kind", "path", "sha256"} of a base model: a Hugging Face LLaMA directory (kind "hf":
    the sha256 covers config.json, the index and the weight files that hf_index reads, not a
    stray file beside them) or one checkpoint ckpt/iter_X of a run of ours (kind "ckpt": its
    manifest.json, which holds the sha256 of every file). Rank 0 reads the files (once, not
    once per rank) and tells the others."""
    ref = None
    if mesh is None or mesh.master:
        path = os.path.abspath(path)
        if os.path.isfile(os.path.join(path, "config.json")):
            index = "model.safetensors.index.json"
            files = ["config.json", *weight_files(path)]
            files += [index] if os.path.isfile(os.path.join(path, index)) else []
            kind, files = "hf", sorted(files)
            for f in files:  # (a FIFO or a link to /dev/zero would never finish hashing)
                guard_chat.check_in_model_dir(os.path.join(path, f), "copy or download it again")
        else:
            kind, files = "ckpt", ["manifest.json"]
        h = hashlib.sha256()
        for f in files:
            h.update(f"{f}:{sha256_file(os.path.join(path, f))}\n".encode())
        ref = {"kind": kind, "path": path, "sha256": h.hexdigest()}
    return ref if mesh is None else broadcast_object(ref, mesh)


def load_base(model, ref, mesh=None):
    """Reads the base that `ref` (see base_reference) names into `model` (whole, before
    apply_lora), after checking that it is still there and still the same."""
    path = ref["path"]
    if not os.path.isfile(os.path.join(path,
                                       "config.json" if ref["kind"] == "hf" else "manifest.json")):
        raise UserError(f"the base model of this LoRA run, {path}, is gone: the run's checkpoints "
                        "hold only the adapters and reference the base; put it back there, or "
                        "start a new out_dir")
    now = base_reference(path, mesh)
    if now["sha256"] != ref["sha256"]:
        raise UserError(f"the base model {path} has changed since this LoRA run started (sha256 "
                        f"{now['sha256'][:12]}, was {ref['sha256'][:12]}): the adapters were "
                        "trained on the old weights; restore them, or start a new out_dir")
    if ref["kind"] == "hf":
        _, sd = load_hf(path)
        if model.cfg.tie_embeddings:
            sd.setdefault("output.weight", sd["tok_embeddings.weight"])
        model.load_state_dict(sd)
    else:
        checkpoint.load(path, model, no_dist=True)
    return model


def load_lora_whole(path):
    """(whole model on CPU, meta) from any checkpoint of ours (checkpoint.load_whole); a LoRA
    run's is its base, read again from where it is, with the adapters on (not merged: see
    merge_lora)."""
    meta, _ = guard_ckpt.read_meta(path)
    lora = meta.get("lora")
    if not lora:
        return checkpoint.load_whole(path)
    model = load_base(Transformer(ModelConfig(**meta["model"])), lora["base"])
    # A is loaded next
    apply_lora(model, lora["rank"], lora["alpha"], lora["dropout"], lora["targets"], seed=0)
    checkpoint.load(path, model, no_dist=True)
    return model, meta


# PEFT's LoRA on a LlamaForCausalLM: the adapter of module M is saved as
# base_model.model.<M>.lora_A.weight / .lora_B.weight (PeftModel -> LoraModel -> the HF model;
# get_peft_model_state_dict drops the adapter name, ".default"), beside adapter_config.json
# with r, lora_alpha, lora_dropout and target_modules (module names: q_proj, ..., lm_head).
# scaling = lora_alpha / r unless use_rslora; forward y = base(x) + B(A(dropout(x))) * scaling.
PEFT_PREFIX = "base_model.model."
PEFT_TARGETS = {"wq": "q_proj", "wk": "k_proj", "wv": "v_proj", "wo": "o_proj",
                "w1": "gate_proj", "w3": "up_proj", "w2": "down_proj", "output": "lm_head"}
assert set(PEFT_TARGETS) == set(LORA_TARGETS)


def _peft_name(name, to_hf):
    """Ours -> PEFT's: layers.0.attention.wq.lora_A.weight ->
    base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"""
    module, ab, _ = name.rsplit(".", 2)
    return f"{PEFT_PREFIX}{rename(module + '.weight', to_hf).removesuffix('.weight')}.{ab}.weight"


def save_peft_lora(path, model, lora):
    """Writes the adapters of `model` (whole, adapters not merged) as a PEFT LoRA directory:
    adapter_config.json + adapter_model.safetensors, which
    peft.PeftModel.from_pretrained(LlamaForCausalLM.from_pretrained(base), path) loads.
    `lora`: the run's {"rank", "alpha", "dropout", "targets", "base"}. Atomic like save_hf.
    Returns the base it names (base_model_name_or_path, what AutoPeftModelForCausalLM loads):
    the base's Hugging Face directory (the base itself, or the export_hf of the run it is), or
    None."""
    if os.path.exists(path) and (not os.path.isdir(path) or os.listdir(path)):
        raise UserError(f"{path} already exists and is not an empty directory: remove it or "
                        f"export elsewhere")
    assert not any(isinstance(m, LoRALinear) and m.merged for m in model.modules()), (
        "save_peft_lora: unmerge first")
    to_hf = {v: k for k, v in HF_NAMES.items()}
    tensors = {_peft_name(n, to_hf): t.detach().to("cpu", torch.float32)
               for n, t in model.state_dict().items() if ".lora_A." in n or ".lora_B." in n}
    base = lora.get("base") or {}
    # the keys of peft.LoraConfig that change what the adapter computes, at their meaning here
    config = {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "inference_mode": True,
        "base_model_name_or_path": base.get("path") if base.get("kind") == "hf"
        else base.get("hf"),
        "r": lora["rank"], "lora_alpha": lora["alpha"], "lora_dropout": lora["dropout"],
        "target_modules": sorted(PEFT_TARGETS[t] for t in lora["targets"]),
        "bias": "none", "fan_in_fan_out": False, "use_rslora": False, "use_dora": False,
        "init_lora_weights": True, "modules_to_save": None, "layers_to_transform": None,
        "rank_pattern": {}, "alpha_pattern": {},
    }
    write_export_dir(path, "adapter_config.json", config, "adapter_model.safetensors", tensors)
    return config["base_model_name_or_path"]


def load_peft_lora(path):
    """({"rank", "alpha", "dropout", "targets"}, {our name: tensor}) of a PEFT LoRA adapter
    directory (what save_pretrained / save_peft_lora write). Refuses the LoRA variants that
    would compute something else here (DoRA, rsLoRA, per-layer ranks, biases, ...)."""
    def bad(problem, fix="only plain LoRA adapters of a LlamaForCausalLM can be loaded"):
        return UserError(f"{path}: {problem}; {fix}")

    if not os.path.exists(os.path.join(path, "adapter_config.json")):
        raise bad("no adapter_config.json", "point lora_from at a PEFT adapter directory (what "
                                            "save_pretrained or export_lora writes)")
    for name in ("adapter_config.json", "adapter_model.safetensors"):  # (not a link out of it)
        guard_chat.check_in_model_dir(os.path.join(path, name), "copy or export it again")
    cfg = read_json(os.path.join(path, "adapter_config.json"), "copy or export it again")
    if cfg.get("peft_type") != "LORA":
        raise bad(f"peft_type={cfg.get('peft_type') if isinstance(cfg, dict) else None!r}, not "
                  f"'LORA'")
    for key, plain in (("use_dora", False), ("use_rslora", False), ("fan_in_fan_out", False),
                       ("bias", "none"),
                       ("rank_pattern", {}), ("alpha_pattern", {}), ("layers_to_transform", None),
                       ("modules_to_save", None), ("lora_bias", False)):
        if cfg.get(key, plain) not in (plain, None):
            raise bad(f"{key}={cfg[key]!r} is a LoRA variant that is not implemented here")
    r, alpha, drop = cfg.get("r"), cfg.get("lora_alpha"), cfg.get("lora_dropout", 0.0)
    if (type(r) is not int or not 1 <= r <= 65536 or type(alpha) not in (int, float)
            or type(drop) not in (int, float) or not lora_in_range(alpha, drop)):
        raise bad(f"r={r!r}, lora_alpha={alpha!r}, lora_dropout={drop!r}: r must be an int in [1, "
                  f"65536], lora_alpha in (0, 1e6), lora_dropout in [0, 1)",
                  "fix adapter_config.json")
    modules = cfg.get("target_modules")
    from_hf = {v: k for k, v in PEFT_TARGETS.items()}
    if not isinstance(modules, list) or not modules or not all(
            isinstance(m, str) and m in from_hf for m in modules):  # ([["q_proj"]]: unhashable)
        raise bad(f"target_modules={modules!r} is not a list of {', '.join(from_hf)}")
    targets = sorted(from_hf[m] for m in modules)
    file = os.path.join(path, "adapter_model.safetensors")
    if not os.path.isfile(file):
        raise bad("no adapter_model.safetensors (only safetensors adapters are read)",
                  "re-save the adapter with save_pretrained(..., safe_serialization=True)")
    sd = {}
    for name, t in read_safetensors(file).items():
        m = re.fullmatch(re.escape(PEFT_PREFIX) + r"(.*)\.(lora_[AB])\.weight", name)
        module = m and rename(m[1] + ".weight", HF_NAMES)
        if not module or module.split(".")[-2] not in targets:
            raise bad(f"unexpected tensor '{name}' (base weights saved beside the adapter, e.g. "
                      f"PEFT's save_embedding_layers, or a module outside target_modules)",
                      "save the adapter alone (save_embedding_layers=False)")
        sd[f"{module.removesuffix('.weight')}.{m[2]}.weight"] = t
    guard_ckpt.check_finite(sd, file, "export the adapter again from a checkpoint before the "
                                      "loss diverged")
    return {"rank": r, "alpha": float(alpha), "dropout": float(drop), "targets": targets}, sd


def load_lora_adapter(model, adapter, path):
    """Puts the adapter tensors that load_peft_lora read from `path` into `model` (whole, with
    apply_lora's adapters of the same rank and targets). Every adapter must be there: one
    left at its fresh init would be a silently different model."""
    ours = {n for n in model.state_dict() if ".lora_A." in n or ".lora_B." in n}
    missing, extra = sorted(ours - set(adapter)), sorted(set(adapter) - ours)
    if missing or extra:
        raise UserError(f"{path}: the adapter "
                        f"{'lacks ' + ', '.join(missing[:3]) if missing else ''}"
                        f"{'; ' if missing and extra else ''}"
                        f"{'has extra ' + ', '.join(extra[:3]) if extra else ''} "
                        f"for this {model.cfg.n_layer}-layer base: is it the adapter of this base "
                        f"model?")
    shapes = model.state_dict()
    for n, t in adapter.items():
        if tuple(t.shape) != tuple(shapes[n].shape):
            raise UserError(f"{path}: {n} has shape {tuple(t.shape)}, this base needs "
                            f"{tuple(shapes[n].shape)}: is it the adapter of this base model?")
    model.load_state_dict(adapter, strict=False)


# ---- what train.py calls ----------------------------------------------------------------
# Order: the base's weights are in (loaded whole, or read again from the base a resumed run
# references), then the adapters, then the pipeline cut, FSDP / data parallel and the
# optimizer (over what trains only).


def settings(c, overrides, src):
    """This run's LoRA settings {"rank", "alpha", "dropout", "targets", "base"} (kept in its
    checkpoints) and lora_from's tensors (or None): from the LoRA run being resumed, from an
    adapter directory, or from the keys. An explicit key that disagrees is a mistake."""
    adapter, targets = None, lora_targets(c)
    # resuming a LoRA run: the settings and the base come from its checkpoint
    if src.kind == "resume" and src.lora:
        lora, where = dict(src.lora), src.where
    elif src.kind == "resume":
        raise UserError(f"lora_rank / lora_from given but {c['out_dir']} holds a full fine-tuning "
                        f"run: LoRA on top "
                        f"of it needs a new out_dir with init_from={c['out_dir']}")
    elif c["lora_from"]:
        lora, adapter = load_peft_lora(c["lora_from"])
        where = f"the adapter in {c['lora_from']}"
    else:
        lora = {"rank": c["lora_rank"], "alpha": c["lora_alpha"], "dropout": c["lora_dropout"],
                "targets": targets}
        where = ""
    for key, value in (("lora_rank", c["lora_rank"]), ("lora_alpha", c["lora_alpha"]),
                       ("lora_targets", targets)):
        have = lora[key.removeprefix("lora_")]
        if key in overrides and value != have:
            raise UserError(f"{key}={overrides[key]} but {where} has {have}: drop the override")
    # a run key, like dropout
    lora["dropout"] = c["lora_dropout"] if "lora_dropout" in overrides else lora["dropout"]
    if src.kind == "fresh":
        raise UserError("LoRA adapts a trained model: set init_from= to a Hugging Face LLaMA "
                        "directory or a run's out_dir (the base, which stays frozen)")
    ffn = [t for t in lora["targets"] if t in ("w1", "w2", "w3")]
    # (apply_lora wraps linears; routed experts are 3-D weights)
    if src.saved.get("n_experts") and ffn:
        raise UserError(f"lora_targets has {','.join(ffn)}, but {src.where} is a mixture of "
                        f"experts, whose routed experts get no LoRA: only its dense layers and "
                        f"shared expert would be adapted; use attention targets "
                        f"(lora_targets=wq,wk,wv,wo), or fine-tune fully")
    return lora, adapter


def attach(model, lora, adapter, src, meta, mesh, seed, lora_from=""):
    """Puts the adapters on `model` (whole, its base's weights in; on resume they are read here
    from the base the checkpoint references) and loads lora_from's tensors, in place."""
    if model.cfg.vocab_size < meta["vocab_size"]:
        raise UserError(f"the data has {meta['vocab_size']} token ids but the base "
                        f"has {model.cfg.vocab_size}: LoRA "
                        f"keeps the embeddings frozen, so new tokens would never be learned; "
                        f"prepare the data without added tokens, or use lora_rank=0")
    if model.cfg.tie_embeddings and "output" in lora["targets"]:
        raise UserError("lora_targets has output but the base ties the head to the embedding: "
                        "merging would change the embedding too; drop output from lora_targets")
    if mesh.pp > 1 and lora["targets"] == ["output"]:
        raise UserError("lora_targets=output with pp > 1: the first stages would have nothing to "
                        "train; add a per-layer target (wq, ...) or use pp=1")
    if src.kind == "resume":  # the checkpoint references its base (path + sha256); read it again
        load_base(model, lora["base"], mesh)
    else:
        lora["base"] = base_reference(src.path, mesh)
        export = (src.meta or {}).get("config", {}).get("export_hf") if src.kind == "run" else None
        # the base run's own Hugging Face export
        if export and os.path.isfile(os.path.join(export, "config.json")):
            lora["base"]["hf"] = os.path.abspath(export)
    apply_lora(model, lora["rank"], lora["alpha"], lora["dropout"], lora["targets"], seed)
    if adapter is not None:
        load_lora_adapter(model, adapter, lora_from)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    mesh.print0(f"lora: r={lora['rank']} alpha={lora['alpha']:g} on {','.join(lora['targets'])}"
                f"{f' from {lora_from}' if adapter is not None else ''}: {trainable:,} trainable "
                f"parameters "
                f"({trainable / model.num_params():.2%}); the base ({lora['base']['path']}) is "
                f"frozen")
