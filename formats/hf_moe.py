"""
Hugging Face mixtures of experts in and out: Mixtral (MixtralForCausalLM), Qwen2-MoE
(Qwen2MoeForCausalLM, its shared expert and q/k/v biases) and Qwen3-MoE (Qwen3MoeForCausalLM:
no shared expert, Qwen3's attention). Their config.json fields as ours,
and their expert tensors as our three 3-D weights per layer (moe.GroupedExperts): on disk
either one matrix per expert (w1/w2/w3, gate_proj/up_proj/down_proj: what transformers
writes) or transformers 5's fused gate_up_proj (E, 2F, D) and down_proj (E, D, F). hf.py
reads and writes the rest of the model and calls these.
"""

import re

import torch

from guards.guard_errors import UserError

# model_type -> architecture
MOE_FAMILIES = {"mixtral": "MixtralForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM",
                "qwen3_moe": "Qwen3MoeForCausalLM"}

# one Hugging Face tensor = one of ours ({i}: the layer); both families' names, read or written
HF_MOE_NAMES = {
    # Mixtral on disk
    "model.layers.{i}.block_sparse_moe.gate.weight": "layers.{i}.feed_forward.router.weight",
    # Qwen2-MoE; Mixtral in transformers 5
    "model.layers.{i}.mlp.gate.weight": "layers.{i}.feed_forward.router.weight",
    "model.layers.{i}.mlp.shared_expert.gate_proj.weight":
        "layers.{i}.feed_forward.shared_expert.w1.weight",
    "model.layers.{i}.mlp.shared_expert.up_proj.weight":
        "layers.{i}.feed_forward.shared_expert.w3.weight",
    "model.layers.{i}.mlp.shared_expert.down_proj.weight":
        "layers.{i}.feed_forward.shared_expert.w2.weight",
    "model.layers.{i}.mlp.shared_expert_gate.weight": "layers.{i}.feed_forward.shared_gate.weight",
    # fused (E, D, F): ours as is
    "model.layers.{i}.mlp.experts.down_proj": "layers.{i}.feed_forward.experts.w2",
}
# one matrix per expert: (layer, expert, its name) -> ours, expert e of the 3-D weight
PER_EXPERT = re.compile(r"model\.layers\.(\d+)\.(?:block_sparse_moe|mlp)\.experts\.(\d+)\."
                        r"(w1|w2|w3|gate_proj|up_proj|down_proj)\.weight")
FUSED_GATE_UP = re.compile(
    r"model\.layers\.(\d+)\.(?:block_sparse_moe|mlp)\.experts\.gate_up_proj")
OURS = {"w1": "w1", "w2": "w2", "w3": "w3", "gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}


def config_fields(hf, refuse):
    """Our ModelConfig's MoE fields from a Mixtral, Qwen2-MoE or Qwen3-MoE config.json, read as
    transformers reads them (hf.DEFAULTS; its router_aux_loss_coef, times top_k: ours counts a
    token once, see config_out; the run's aux weight unless it gives one); refuses what the layer
    does not compute."""
    for field in ("num_local_experts", "num_experts", "num_experts_per_tok",
                  "moe_intermediate_size",
                  "shared_expert_intermediate_size", "decoder_sparse_step"):
        if field in hf and (type(hf[field]) is not int or not 0 <= hf[field] <= 2 ** 20):
            raise refuse(field, "not an int in [0, 2**20]")
    for field in ("norm_topk_prob", "qkv_bias"):
        if field in hf and type(hf[field]) is not bool:
            raise refuse(field, "not a JSON bool")
    aux = hf.get("router_aux_loss_coef", 0.001)  # (the three classes' default)
    if type(aux) not in (int, float) or not 0 <= aux < 1e6:
        raise refuse("router_aux_loss_coef", "not a number in [0, 1e6)")
    dense = hf.get("mlp_only_layers") or []
    n_layer = hf["num_hidden_layers"]
    if not isinstance(dense, list) or not all(type(i) is int and 0 <= i < n_layer for i in dense):
        raise refuse("mlp_only_layers", "not a list of layer indices")
    step = hf.get("decoder_sparse_step", 1)
    if hf["model_type"] != "mixtral" and step == 0:  # (transformers divides by it)
        raise refuse("decoder_sparse_step", "must be at least 1 (every step-th layer is MoE)")
    if hf["model_type"] != "mixtral" and not any(
            (i + 1) % step == 0 and i not in dense for i in range(n_layer)):
        dense_twin = hf["model_type"].removesuffix("_moe")
        raise refuse("decoder_sparse_step", f"with mlp_only_layers={dense} no layer of the "
                                            f"{n_layer} is a mixture of experts: a dense model, "
                                            f"load it as model_type {dense_twin}")
    if hf["model_type"] == "mixtral":
        E, ffn = hf["num_local_experts"], hf["intermediate_size"]
        fields = dict(moe_ffn_dim=ffn, moe_norm_topk=True, moe_every=1)
    else:  # Qwen2-MoE, Qwen3-MoE (no shared expert; their classes' defaults)
        qwen3 = hf["model_type"] == "qwen3_moe"
        # (transformers 5 writes Qwen3-MoE's num_experts as num_local_experts; hub files keep it)
        E = hf.get("num_local_experts", hf.get("num_experts", 128)) if qwen3 else \
            hf.get("num_experts", 60)
        ffn = hf.get("moe_intermediate_size", 768 if qwen3 else 1408)
        fields = dict(moe_ffn_dim=ffn, moe_norm_topk=hf.get("norm_topk_prob", False),
                      moe_every=hf.get("decoder_sparse_step", 1) or 1,
                      moe_dense_layers=",".join(map(str, dense)),
                      moe_shared_ffn_dim=0 if qwen3 else
                      hf.get("shared_expert_intermediate_size", 5632))
    top_k = hf.get("num_experts_per_tok", 8 if hf["model_type"] == "qwen3_moe" else 2)
    if not ffn:
        raise refuse("moe_intermediate_size" if "moe_intermediate_size" in hf
                     else "intermediate_size", "an expert's width must be positive")
    if not 1 <= top_k <= E:
        raise refuse("num_experts_per_tok", f"needs 1 <= num_experts_per_tok <= the {E} experts, "
                                            f"each of a positive width")
    return dict(n_experts=E, moe_top_k=top_k, moe_score="softmax",
                moe_aux_weight=float(aux) * top_k,
                **fields)


def family(cfg):
    """The family an export of MoE config `cfg` declares: the one it came from, else Qwen3-MoE
    with q/k norms, else Mixtral when it fits (no shared expert, every layer MoE, top-k
    renormalised), else Qwen2-MoE."""
    if cfg.hf_model_type in MOE_FAMILIES:
        return cfg.hf_model_type
    mixtral = not cfg.moe_shared_ffn_dim and cfg.moe_every == 1 and cfg.moe_norm_topk \
        and not cfg.moe_dense_layers
    return "qwen3_moe" if cfg.qk_norm else "mixtral" if mixtral else "qwen2_moe"


def config_out(cfg):
    """config.json's MoE fields for an export. router_aux_loss_coef is the aux weight / top_k:
    transformers' load_balancing_loss_func counts a token's top_k slots as top_k (top_k at a
    perfect balance), our aux loss as one (1 at balance), so theirs is top_k times ours."""
    if cfg.moe_score != "softmax":
        raise UserError("export_hf: moe_score=sigmoid, but transformers' Mixtral and Qwen2-MoE "
                        "take a softmax of the router's logits (they have no sigmoid scores), so "
                        "the export would route otherwise: train with moe_score=softmax to "
                        "export; sample.py reads this model's checkpoints")
    common = dict(num_experts_per_tok=cfg.moe_top_k, output_router_logits=False,
                  router_aux_loss_coef=cfg.moe_aux_weight / cfg.moe_top_k)
    dense = [int(i) for i in cfg.moe_dense_layers.split(",") if i]
    if family(cfg) == "mixtral":
        if cfg.moe_shared_ffn_dim or cfg.moe_every != 1 or not cfg.moe_norm_topk or cfg.qkv_bias \
                or dense:
            raise UserError("export_hf: this model came from Mixtral but has a shared expert, "
                            "dense layers, "
                            "q/k/v biases or moe_norm_topk=False, which Mixtral has not")
        return dict(common, num_local_experts=cfg.n_experts,
                    intermediate_size=cfg.moe_ffn_dim or cfg.ffn_dim,
                    router_jitter_noise=0.0)
    if family(cfg) == "qwen3_moe":
        if cfg.moe_shared_ffn_dim or cfg.qkv_bias or not cfg.qk_norm:
            raise UserError("export_hf: this model came from Qwen3-MoE but has a shared expert, "
                            "q/k/v biases or no q/k norms, which Qwen3-MoE has not")
        return dict(common, num_experts=cfg.n_experts, moe_intermediate_size=cfg.moe_ffn_dim or
                    cfg.ffn_dim, norm_topk_prob=cfg.moe_norm_topk,
                    decoder_sparse_step=cfg.moe_every, mlp_only_layers=dense)
    if not cfg.moe_shared_ffn_dim:
        raise UserError("export_hf: a Qwen2-MoE has a shared expert; this model has none "
                        "(moe_shared_ffn_dim=0) and is no Mixtral either (dense layers or "
                        "moe_norm_topk=False): it cannot be exported")
    return dict(common, num_experts=cfg.n_experts,
                moe_intermediate_size=cfg.moe_ffn_dim or cfg.ffn_dim,
                shared_expert_intermediate_size=cfg.moe_shared_ffn_dim,
                norm_topk_prob=cfg.moe_norm_topk,
                decoder_sparse_step=cfg.moe_every, mlp_only_layers=dense, qkv_bias=cfg.qkv_bias)


def tensors_out(state_dict, cfg):
    """{Hugging Face name: tensor} of the MoE layers, as transformers' save_pretrained writes them:
    one matrix per expert. A trained aux-loss-free bias has no place there: refused."""
    mixtral = family(cfg) == "mixtral"
    block, names = (("block_sparse_moe", ("w1", "w3", "w2")) if mixtral
                    else ("mlp", ("gate_proj", "up_proj", "down_proj")))
    out = {}
    for name, t in state_dict.items():
        m = re.fullmatch(r"layers\.(\d+)\.feed_forward\.(.*)", name)
        if (not m
            or name.endswith(("w1.weight", "w2.weight", "w3.weight"))
            and ".shared_expert." not in name):
            continue  # not MoE (a dense feed-forward: hf.py's names)
        i, rest = m[1], m[2]
        if rest == "expert_bias":
            if t.abs().max() > 0:
                raise UserError("export_hf: this model trained an aux-loss-free routing bias "
                                "(moe_bias_rate), but transformers' Mixtral and Qwen2-MoE choose "
                                "experts by the scores alone (they have no routing bias), so the "
                                "export would route otherwise: train with moe_bias_rate=0 to "
                                "export; sample.py reads this model's checkpoints")
            continue
        if rest.startswith("experts."):
            for e in range(t.shape[0]):
                hf = dict(zip(("w1", "w3", "w2"), names))[rest[len("experts."):]]
                out[f"model.layers.{i}.{block}.experts.{e}.{hf}.weight"] = t[e]
            continue
        hf = next(k for k, v in HF_MOE_NAMES.items() if v == "layers.{i}.feed_forward." + rest
                  and (rest != "router.weight" or ("block_sparse_moe" in k) == mixtral))
        out[hf.format(i=i)] = t
    return out


def index_experts(hf_tensors, expected, path):
    """{our expert weight: ("experts", pieces)} for the 3-D weights in `expected` ({our name:
    shape}), from {HF name: (file, data_start, header entry)}: pieces {expert: tensor} or
    {"fused": (tensor, half)} (gate_up_proj's first half is w1, its second w3). The names used
    are removed from hf_tensors; shapes checked."""
    pieces = {}
    for name in list(hf_tensors):
        m, f = PER_EXPERT.fullmatch(name), FUSED_GATE_UP.fullmatch(name)
        if m:
            pieces.setdefault(f"layers.{m[1]}.feed_forward.experts.{OURS[m[3]]}", {})[
                int(m[2])] = (name, *hf_tensors.pop(name))
        elif f:
            for half, w in enumerate(("w1", "w3")):
                pieces.setdefault(f"layers.{f[1]}.feed_forward.experts.{w}", {})["fused"] = (
                    (name, *hf_tensors[name]), half)
            hf_tensors.pop(name)
    out = {}
    for ours, got in pieces.items():
        if ours not in expected:
            raise UserError(f"{path}: expert tensors for '{ours}', which config.json does not "
                            f"make a MoE layer: config.json does not match the weights")
        E, *shape = expected[ours]
        if "fused" in got:
            (name, _, _, entry), _ = got["fused"]
            ok, want = tuple(entry[3]) == (E, 2 * shape[0], shape[1]), (E, 2 * shape[0], shape[1])
        else:
            bad = [n for n, _, _, entry in got.values() if tuple(entry[3]) != tuple(shape)]
            name, ok, want = ((bad or [ours])[0], not bad and sorted(got) == list(range(E)),
                              tuple(shape))
        if not ok:
            raise UserError(f"{path}: the experts of '{ours}' do not match config.json ({name}: "
                            f"want {E} experts of {want}): config.json does not match the weights")
        out[ours] = ("experts", got)
    return out


def read_experts(pieces, read, dim, start, stop):
    """Experts [start, stop) (dim 0; dim None: all) of a 3-D weight from its pieces
    (index_experts); read(tensor, dim, start, stop) reads (a slice of) one Hugging Face tensor."""
    if "fused" in pieces:
        t, half = pieces["fused"]
        both = read(t, 0 if dim == 0 else None, start, stop)  # (n, 2F, D)
        w = both.chunk(2, dim=1)[half]
    else:
        experts = range(start, stop) if dim == 0 else sorted(pieces)
        w = torch.stack([read(pieces[e], None, 0, 0) for e in experts])
    return w if dim in (None, 0) else w.narrow(dim, start, stop - start)
