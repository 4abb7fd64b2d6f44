"""
Hugging Face model directories of the LLaMA family (Llama, Mistral, Qwen2, and the MoE ones
through hf_moe.py): config.json + model.safetensors or a sharded index (the safetensors
library reads and writes them), the name table, the config mapping, import of only a rank's
part, export, and the tokenizer.json that goes with an export. Our own checkpoints are
checkpoint.py.
"""

import contextlib
import json
import os
import re
import shutil

import torch

from formats import hf_moe
from guards import guard_chat
from guards.guard_errors import UserError
from guards.guard_files import MAX_SIZES, read_json
from formats.hf_safetensors import (
    open_safetensors,
    read_safetensors_header,
    read_safetensors_part,
    write_safetensors,
)
from formats.hf_moe import (HF_MOE_NAMES, MOE_FAMILIES, config_fields, config_out,
                            index_experts, read_experts, tensors_out)
from model import ROPE_TYPES, ModelConfig, Transformer
from formats.hf_rope import original_len, rope_scaling_out, yarn_factor, yarn_fields

# ---------------------------------------------------------------------------------------------
# Hugging Face LLaMA checkpoints (LlamaForCausalLM, save_pretrained's directory layout).
# Hugging Face name -> ours; {i} is the layer index. Our RoPE uses HF's rotate-half layout
# (see rope_tables), so q_proj/k_proj load as they are: no permutation of their rows (that
# permutation is what converting Meta's original interleaved checkpoints to HF needs).
HF_NAMES = {
    "model.embed_tokens.weight": "tok_embeddings.weight",
    "model.layers.{i}.input_layernorm.weight": "layers.{i}.attention_norm.weight",
    "model.layers.{i}.self_attn.q_proj.weight": "layers.{i}.attention.wq.weight",
    "model.layers.{i}.self_attn.k_proj.weight": "layers.{i}.attention.wk.weight",
    "model.layers.{i}.self_attn.v_proj.weight": "layers.{i}.attention.wv.weight",
    "model.layers.{i}.self_attn.q_proj.bias": "layers.{i}.attention.wq.bias",  # Qwen2's biases
    "model.layers.{i}.self_attn.k_proj.bias": "layers.{i}.attention.wk.bias",
    "model.layers.{i}.self_attn.v_proj.bias": "layers.{i}.attention.wv.bias",
    "model.layers.{i}.self_attn.o_proj.weight": "layers.{i}.attention.wo.weight",
    "model.layers.{i}.self_attn.q_norm.weight": "layers.{i}.attention.q_norm.weight",  # Qwen3's
    "model.layers.{i}.self_attn.k_norm.weight": "layers.{i}.attention.k_norm.weight",
    "model.layers.{i}.post_attention_layernorm.weight": "layers.{i}.ffn_norm.weight",
    "model.layers.{i}.mlp.gate_proj.weight": "layers.{i}.feed_forward.w1.weight",
    "model.layers.{i}.mlp.up_proj.weight": "layers.{i}.feed_forward.w3.weight",
    "model.layers.{i}.mlp.down_proj.weight": "layers.{i}.feed_forward.w2.weight",
    "model.norm.weight": "norm.weight",
    "lm_head.weight": "output.weight",  # absent from HF files with tie_word_embeddings
}


def rename(name, table):
    """`name` through a table like HF_NAMES (or its inverse); None if it has no entry."""
    m = re.fullmatch(r"(.*layers\.)(\d+)(\..*)", name)
    key = f"{m[1]}{{i}}{m[3]}" if m else name
    return table[key].format(i=m[2] if m else None) if key in table else None


# model_type -> architecture, of the families this model computes (model.MODEL_TYPES)
FAMILIES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
            "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM", **MOE_FAMILIES}


# what transformers' config class of each family takes for a key config.json omits, where
# reading it as a LLaMA's would take another value (tests/test_moe.py drops each key in turn)
DEFAULTS = {
    "llama": dict(max_position_embeddings=2048),
    "mistral": dict(num_key_value_heads=8, sliding_window=4096, max_position_embeddings=131072),
    "qwen2": dict(num_key_value_heads=32, max_position_embeddings=32768),
    "qwen3": dict(num_key_value_heads=32, max_position_embeddings=32768),
    "mixtral": dict(num_local_experts=8, num_experts_per_tok=2, num_key_value_heads=8,
                    rms_norm_eps=1e-5, rope_theta=1e6, max_position_embeddings=131072),
    "qwen2_moe": dict(num_experts=60, num_experts_per_tok=4, moe_intermediate_size=1408,
                      shared_expert_intermediate_size=5632, decoder_sparse_step=1,
                      norm_topk_prob=False, qkv_bias=True, num_key_value_heads=16,
                      max_position_embeddings=32768, use_sliding_window=False),
    "qwen3_moe": dict(num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768,
                      decoder_sparse_step=1, norm_topk_prob=False, num_key_value_heads=4,
                      max_position_embeddings=32768),
}


def hf_config_to_ours(hf):
    """ModelConfig kwargs (all but block_size) from a Hugging Face config.json dict of a LLaMA,
    or of a LLaMA variant: Mistral (a sliding window), Qwen2 (q/k/v biases, a window by layer),
    Qwen3 (q/k norms, a head_dim of its own; its YaRN: hf_rope.py).
    Refuses what this model does not implement rather than load it and compute something else."""
    def refuse(field, why):
        return UserError(f"config.json: {field}={hf.get(field)!r}: {why}; only LLaMA models and "
                         f"their Mistral, Qwen2, Qwen3, Mixtral, Qwen2-MoE and Qwen3-MoE variants "
                         f"(without those options) can be loaded")

    family = hf.get("model_type")  # (its family's defaults for what it omits)
    hf = {**DEFAULTS[family], **hf} if isinstance(family, str) and family in DEFAULTS else hf
    bounds = {"vocab_size": "vocab_size", "hidden_size": "n_embd", "intermediate_size": "ffn_dim",
              "num_hidden_layers": "n_layer", "num_attention_heads": "n_head",
              "num_key_value_heads": "n_kv_head",
              "max_position_embeddings": "block_size", "sliding_window": "block_size",
              "head_dim": "n_embd"}
    for field, ours in bounds.items():
        optional = ("num_key_value_heads", "max_position_embeddings", "sliding_window", "head_dim")
        if field in optional and hf.get(field) is None:
            continue
        if (field == "sliding_window" and hf.get(field) == 0
            and hf.get("use_sliding_window") is False):
            continue  # (Qwen2-MoE's as transformers 5 saves it: no window)
        if type(hf.get(field)) is not int:
            raise refuse(field, "missing or not an int")
        if not 0 < hf[field] <= MAX_SIZES[ours]:
            raise refuse(field, f"a size must be positive and at most {MAX_SIZES[ours]}")
    # a string "false" is truthy, "abc" no eps: the types JSON gives, strictly
    for field, kinds in (("tie_word_embeddings", bool), ("attention_bias", bool),
                         ("mlp_bias", bool),
                         ("use_sliding_window", bool), ("rms_norm_eps", (int, float)),
                         ("rope_theta", (int, float)),
                         ("rope_parameters", dict), ("rope_scaling", dict), ("layer_types", list),
                         ("hidden_act", str), ("model_type", str), ("head_dim", int)):
        if hf.get(field) is not None and (not isinstance(hf[field], kinds) or
                                          type(hf[field]) is bool and kinds is not bool):
            raise refuse(field, f"a JSON {type(hf[field]).__name__} where {field} needs "
                                f"{getattr(kinds, '__name__', 'number')}")
    if family not in FAMILIES:
        raise refuse("model_type", f"not a LLaMA model ({', '.join(FAMILIES)})")
    # the hub's files: rope_theta beside rope_scaling; transformers >= 5: both in rope_parameters.
    # Read as transformers reads them: a dict's own rope_theta before the top-level one. Of two
    # dicts transformers takes rope_scaling, other readers rope_parameters: they must agree
    rope_field = "rope_parameters" if hf.get("rope_parameters") else "rope_scaling"
    # (transformers' Qwen3 fails on a dict nested by layer type: its RoPE reads the top level)
    if any(isinstance(v, dict) for v in (hf.get(rope_field) or {}).values()):
        raise refuse(rope_field, "a RoPE per layer type (nested dicts) is not implemented: write "
                                 "one dict of rope_type, rope_theta, factor, ...")
    if hf.get("layer_types") is not None and len(hf["layer_types"]) != hf["num_hidden_layers"]:
        raise refuse("layer_types", f"{len(hf['layer_types'])} layer types for "
                                    f"num_hidden_layers={hf['num_hidden_layers']}: one a layer")
    both = [{**{k: v for k, v in r.items() if k != "type"},
             "rope_type": r.get("rope_type", r.get("type", "default")),
             "rope_theta": r.get("rope_theta", hf.get("rope_theta", 10000.0))}
            for r in (hf.get("rope_scaling"), hf.get("rope_parameters")) if r]
    if len(both) == 2 and both[0] != both[1]:
        raise refuse("rope_scaling", "it and rope_parameters both describe the rotary embedding, "
                                     "and differ (readers disagree on which wins); keep one")
    rope = (both[0] if both
            else {"rope_type": "default", "rope_theta": hf.get("rope_theta", 10000.0)})
    rope_type = rope["rope_type"]
    if rope_type not in ROPE_TYPES:
        raise refuse(rope_field,
                     f"rope_type {rope_type!r} is not implemented (only {', '.join(ROPE_TYPES)})")
    scaling = dict(rope_type=rope_type)
    numbers = [("rms_norm_eps", hf.get("rms_norm_eps", 1e-6)), ("rope_theta", rope["rope_theta"])]
    if rope_type != "default":
        factor = rope.get("factor") if rope_type != "yarn" else yarn_factor(rope, hf)
        numbers.append(("rope_factor", factor))
    if rope_type == "llama3":
        numbers += [("rope_low_freq", rope.get("low_freq_factor")),
                    ("rope_high_freq", rope.get("high_freq_factor"))]
    if rope_type in ("llama3", "yarn"):
        numbers.append(("rope_original_len", original_len(rope, hf)))
    # rope's base, factor and length at least 1: a base of 1e-300 trains NaN
    for field, value in numbers:
        low = 1 if field in ("rope_theta", "rope_factor", "rope_original_len") else 0
        high = MAX_SIZES.get(field, 1e30)
        # a length is a whole number (int() would truncate 8192.5; transformers keeps the float)
        whole = (field != "rope_original_len" or type(value) is int
                 or type(value) is float and value.is_integer())
        if (type(value) is bool or not isinstance(value, (int, float))
                or not (value > 0 and low <= value < high) or not whole):
            blame = (field if field in hf and field not in (hf.get(rope_field) or {})
                     else rope_field)
            raise refuse(blame, f"{field} must be a positive "
                         + ("whole number" if field == "rope_original_len" else "number")
                         + (" of at least 1" if low else "") + f" below {high:g}")
        scaling[field] = float(value) if field != "rope_original_len" else int(value)
    if rope_type == "llama3" and not scaling["rope_low_freq"] < scaling["rope_high_freq"]:
        raise refuse(rope_field, "low_freq_factor must be below high_freq_factor")
    if rope_type == "yarn":  # hf_rope.py
        scaling.update(yarn_fields(rope, scaling["rope_factor"], refuse, rope_field))
    if hf.get("mlp_bias"):
        raise refuse("mlp_bias", "MLP biases are not implemented")
    if hf.get("attention_bias"):  # LLaMA's also biases o_proj; Qwen2's q/k/v biases need no flag
        raise refuse("attention_bias",
                     "an output-projection bias is not implemented (Qwen2's q/k/v biases are)")
    if hf.get("hidden_act", "silu") != "silu":
        raise refuse("hidden_act", "only silu (SwiGLU) is implemented")
    n_embd, n_head = hf["hidden_size"], hf["num_attention_heads"]
    # Mixtral, Qwen2-MoE: hf_moe.py
    moe = config_fields(hf, refuse) if family in MOE_FAMILIES else {}
    return dict(**moe, vocab_size=hf["vocab_size"], n_layer=hf["num_hidden_layers"], n_head=n_head,
                n_kv_head=hf.get("num_key_value_heads") or n_head, n_embd=n_embd,
                ffn_dim=hf["intermediate_size"], norm_eps=scaling.pop("rms_norm_eps"), **scaling,
                # as transformers reads it: Qwen3's class says 128, the others hidden_size / heads
                # (0 where that is no whole number: ModelConfig says so in config.json's names)
                head_dim=hf.get("head_dim") or (128 if family == "qwen3" else n_embd // n_head
                                                 if n_embd % n_head == 0 else 0),
                qk_norm=family in ("qwen3", "qwen3_moe"),
                tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
                sliding_window=hf_window(hf, refuse),
                qkv_bias=family == "qwen2" or family == "qwen2_moe" and hf.get("qkv_bias", True),
                max_position=hf.get("max_position_embeddings") or 0,
                hf_model_type=family)


def hf_window(hf, refuse):
    """The sliding window of a config.json (0: none): Mistral's applies to every layer; Qwen2's
    only with use_sliding_window, to the layers layer_types says (transformers 5 writes them;
    older files: the layers from max_window_layers on), all or none of them here."""
    if hf["model_type"] == "llama" or hf.get("sliding_window") is None:
        return 0
    if hf["model_type"] in ("mistral", "mixtral"):
        return hf["sliding_window"]
    if not hf.get("use_sliding_window"):
        return 0
    first = hf.get("max_window_layers", 0)
    kinds = hf.get("layer_types") or ["sliding_attention" if type(first) is int and i >= first
                                      else "full_attention"
                                      for i in range(hf["num_hidden_layers"])]
    if set(map(str, kinds)) == {"full_attention"}:
        return 0
    if set(map(str, kinds)) != {"sliding_attention"} or len(kinds) != hf["num_hidden_layers"]:
        raise refuse("layer_types",
                     "a sliding window on some layers only is not implemented (all or none)")
    return hf["sliding_window"]


def expected_shapes(cfg):
    """{our name: shape} of every weight a checkpoint of this config holds (a tied head is the
    embedding, not a weight of its own). Built on the meta device: no memory, no init."""
    with torch.device("meta"):
        model = Transformer(cfg)
    shapes = {name: tuple(t.shape) for name, t in model.state_dict().items()
              if not name.endswith("expert_bias")}
    if cfg.tie_embeddings:
        del shapes["output.weight"]
    return shapes


def _read(path, file):
    guard_chat.check_in_model_dir(os.path.join(path, file), "copy or download it again")
    return read_json(os.path.join(path, file), "copy or download it again")


def weight_files(path):
    """The files of the Hugging Face directory `path` that hold its weights: the shards that its
    model.safetensors.index.json names, or model.safetensors."""
    if os.path.isfile(os.path.join(path, "model.safetensors.index.json")):
        weight_map = _read(path, "model.safetensors.index.json").get("weight_map")
        # a shard is a file of this directory: not ../elsewhere, not /proc/self/environ
        if not isinstance(weight_map, dict) or not all(
                isinstance(f, str) and os.path.basename(f) == f and f.endswith(".safetensors")
                for f in weight_map.values()):
            raise UserError(f"{path}/model.safetensors.index.json: weight_map is not a map of "
                            f"names to .safetensors "
                            f"files in that directory: copy or download it again")
        return sorted(set(weight_map.values()))
    if os.path.isfile(os.path.join(path, "model.safetensors")):
        return ["model.safetensors"]
    raise UserError(f"{path}: no model.safetensors or model.safetensors.index.json; only "
                    "safetensors weights are read: re-save the model with "
                    "save_pretrained(..., safe_serialization=True)")


def hf_index(path):
    """(ModelConfig kwargs, {our name: (HF name, file, data_start, header entry)}) of the Hugging
    Face LLaMA model that save_pretrained wrote into directory `path`: config.json and
    model.safetensors, or model.safetensors.index.json and the shards its weight_map names. Reads
    config.json and the safetensors headers only, and checks that the tensors are exactly the
    model's, of the right shapes; load_hf or load_hf_parts read the data."""
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise UserError(f"{path}: no config.json; point at a Hugging Face model directory "
                        f"(what save_pretrained writes)")
    kwargs = hf_config_to_ours(_read(path, "config.json"))
    files = weight_files(path)
    hf_tensors = {}  # HF name -> (file, data_start, header entry)
    for file in files:
        guard_chat.check_in_model_dir(os.path.join(path, file), "copy or download it again")
        if not os.path.isfile(os.path.join(path, file)):
            raise UserError(f"{path}: the shard {file} that model.safetensors.index.json names is "
                            f"missing: copy or download it")
        data_start, entries = read_safetensors_header(os.path.join(path, file))
        hf_tensors.update({name: (os.path.join(path, file), data_start, e)
                           for name, e in entries.items()})

    try:
        cfg = ModelConfig(**kwargs)
    except ValueError as e:  # the shape's rules name our keys: say the file's
        names = {"n_embd": "hidden_size", "n_head": "num_attention_heads",
                 "n_kv_head": "num_key_value_heads"}
        said = re.sub(r"\b(n_embd|n_head|n_kv_head)\b", lambda m: names[m[1]], str(e))
        raise UserError(f"{path}/config.json: {said}") from None
    expected = expected_shapes(cfg)
    # the 3-D expert weights: hf_moe.py
    sd = index_experts(hf_tensors, expected, path) if cfg.n_experts else {}
    for name, t in hf_tensors.items():
        ours = rename(name, HF_NAMES) or (rename(name, HF_MOE_NAMES) if cfg.n_experts else None)
        if ours == "output.weight" and cfg.tie_embeddings:
            continue  # a tied head that was saved anyway: it is the embedding
        if ours not in expected:
            raise UserError(f"{path}: unknown tensor '{name}' for a {cfg.n_layer}-layer LLaMA; "
                            "the checkpoint is not a plain LlamaForCausalLM, or config.json does "
                            "not match its weights")
        file, data_start, entry = t
        if ours in sd or tuple(entry[3]) != expected[ours]:  # entry: (begin, end, dtype, shape)
            raise UserError(f"{path}: tensor '{name}' has shape {tuple(entry[3])}, but "
                            f"config.json implies "
                            f"{expected[ours]}; config.json does not match the weights")
        # a float's bytes relabelled as integers load as huge weights
        if not entry[2].is_floating_point:
            raise UserError(f"{file}: tensor '{name}' is {entry[2]}, but a model's weights are "
                            "floating point: the header is damaged or the file is not these "
                            "weights; copy or download it again")
        sd[ours] = (name, file, data_start, entry)
    missing = [rename(n, {v: k for k, v in HF_NAMES.items()}) or n for n in expected
               if n not in sd]
    if missing:
        raise UserError(f"{path}: missing "
                        f"tensors {', '.join(missing[:5])}{' ...' if len(missing) > 5 else ''}; "
                        f"the checkpoint is incomplete (a shard missing from weight_map?): copy "
                        f"or download it again")
    return kwargs, sd


@torch.no_grad()
def load_hf_parts(index, parts):
    """Reads into each (name, local, full_shape, dim, start, stop) of `parts` (see
    build.local_parts) its slice of the tensor that `index` (hf_index) maps that name
    to, converted to local's dtype: a rank reads only the bytes of what it holds (whole rows
    of an FSDP shard: one byte range per tensor)."""
    files, opened = {}, contextlib.ExitStack()

    def read(t, dim, start, stop):  # (a slice of) one tensor of the files
        hf_name, file, data_start, entry = t
        f = files.get(file) or files.setdefault(file, opened.enter_context(open_safetensors(file)))
        return read_safetensors_part(f, file, data_start, hf_name, entry, dim, start, stop)
    with opened:
        for name, local, _, dim, start, stop in parts:
            if name.endswith("expert_bias"):  # no routing bias in Mixtral, Qwen2-MoE
                local.zero_()
            # a MoE layer's 3-D weight, of several tensors or half of one
            elif index[name][0] == "experts":
                local.copy_(read_experts(index[name][1], read, dim, start, stop))
            else:
                local.copy_(read(index[name], dim, start, stop))


def load_hf(path):
    """(ModelConfig kwargs, state dict in our names) of the Hugging Face LLaMA model in
    directory `path` (see hf_index), read whole. Tensors keep the dtype of the file;
    load_state_dict converts them to the model's."""
    kwargs, index = hf_index(path)
    sd = {}
    for ours, shape in expected_shapes(ModelConfig(**kwargs)).items():
        first = index[ours] if index[ours][0] != "experts" else next(iter(index[ours][1].values()))
        sd[ours] = torch.empty(shape,
                               dtype=(first[0] if isinstance(first[0], tuple) else first)[3][2])
    for name, b in (Transformer(ModelConfig(**kwargs)).named_buffers() if kwargs.get("n_experts")
                    else ()):
        if name.endswith("expert_bias"):  # no routing bias in the files: zero
            sd[name] = torch.zeros_like(b)
    load_hf_parts(index, [(name, t, tuple(t.shape), None, 0, 0) for name, t in sd.items()])
    return kwargs, sd


def save_hf(path, state_dict, cfg, enc=None, shard_mb=5000.0):
    """Writes our state dict (plain tensors, our names, a whole model) as a Hugging Face
    LLaMA directory (or Mistral, Qwen2: cfg.hf_model_type) that AutoModelForCausalLM loads:
    config.json and model.safetensors (float32; no lm_head when the embeddings are tied), or, past
    shard_mb megabytes (10**6 bytes, as HF counts them) of weights, shards
    model-0000i-of-0000N.safetensors and model.safetensors.index.json, as save_pretrained writes
    them. With `enc` (the run's tiktoken encoding) also tokenizer.json and tokenizer_config.json
    (see hf_tokenizer), so that AutoTokenizer.from_pretrained loads the same directory. Written
    into a temp directory renamed into place at the end; `path` must not exist or be empty, so
    nothing of the user's is ever overwritten."""
    if os.path.exists(path) and (not os.path.isdir(path) or os.listdir(path)):
        raise UserError(f"{path} already exists and is not an empty directory: remove it or "
                        f"export elsewhere")
    expected, to_hf = expected_shapes(cfg), {v: k for k, v in HF_NAMES.items()}
    missing = sorted(set(expected) - set(state_dict))
    if missing:
        raise ValueError(f"save_hf: state dict lacks {', '.join(missing[:5])}: it must hold a "
                         f"whole model")
    tensors = {rename(name, to_hf): state_dict[name] for name in expected if rename(name, to_hf)}
    # the MoE layers: hf_moe.py
    tensors.update(tensors_out(state_dict, cfg) if cfg.n_experts else {})
    tensors = {k: t.detach().to("cpu", torch.float32).contiguous() for k, t in tensors.items()}
    hf_config = {
        "architectures": [FAMILIES[export_type(cfg)]], "model_type": export_type(cfg),
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.n_embd, "intermediate_size": cfg.ffn_dim,
        "num_hidden_layers": cfg.n_layer, "num_attention_heads": cfg.n_head,
        "num_key_value_heads": cfg.n_kv_head, "head_dim": cfg.head_dim,
        "rms_norm_eps": cfg.norm_eps, "rope_theta": cfg.rope_theta,
        "rope_scaling": rope_scaling_out(cfg),
        "max_position_embeddings": cfg.max_position or cfg.block_size,
        "tie_word_embeddings": cfg.tie_embeddings,
        "hidden_act": "silu", "torch_dtype": "float32", **hf_family_fields(cfg),
        **(config_out(cfg) if cfg.n_experts else {}),
    }
    more = {}
    if enc is not None:
        # every id a row (a padded embedding has rows past the ids)
        if enc.n_vocab > cfg.vocab_size:
            raise ValueError(f"save_hf: tokenizer {enc.name} has {enc.n_vocab} ids but the model "
                             f"has vocab_size={cfg.vocab_size}")
        more["tokenizer.json"], tok_config = hf_tokenizer(enc, cfg.max_position or cfg.block_size)
        more["tokenizer_config.json"] = tok_config
        more["special_tokens_map.json"] = {k: tok_config[k]
                                           for k in ("bos_token", "eos_token", "unk_token",
                                                     "pad_token")
                                           if tok_config.get(k) is not None}
        # the tokenizer config's own: with our tiktoken encodings <|endoftext|> closes every
        # packed document, so it is also what the next one follows (hf_tokenizer names it bos)
        bos = tok_config.get("bos_token")
        bos = bos.get("content") if isinstance(bos, dict) else bos
        hf_config["bos_token_id"] = None if bos is None else enc.encode_single_token(bos)
        hf_config["eos_token_id"] = enc.eot_token
    write_export_dir(path, "config.json", hf_config, "model.safetensors", tensors,
                     shard_bytes=int(shard_mb * 10 ** 6), more_files=more)


def export_type(cfg):
    """The model_type an export declares: the family it came from (Qwen3 for a LLaMA of ours with
    q/k norms); a MoE model of ours, Mixtral, Qwen2-MoE or Qwen3-MoE (hf_moe.family)."""
    if cfg.n_experts:
        return hf_moe.family(cfg)
    return "qwen3" if cfg.qk_norm else cfg.hf_model_type


def hf_family_fields(cfg):
    """config.json's fields of the model's family: LLaMA's bias switches, Mistral's window,
    Qwen2's window switch (its q/k/v biases are implied)."""
    window, kind = cfg.sliding_window or None, export_type(cfg)
    assert ((cfg.qkv_bias == (kind == "qwen2") or kind == "qwen2_moe")
            and (kind != "llama" or not window)), \
        f"a {kind} model with qkv_bias={cfg.qkv_bias}, sliding_window={cfg.sliding_window}"
    if kind == "llama":
        return {"attention_bias": False, "mlp_bias": False}
    if kind in ("mistral", "mixtral"):
        return {"sliding_window": window}
    # Qwen3's attention_bias would bias q, k, v and o: none here
    qwen3 = {"attention_bias": False} if kind.startswith("qwen3") else {}
    layers = ["sliding_attention" if window else "full_attention"] * cfg.n_layer
    return {"use_sliding_window": window is not None, "sliding_window": window,
            "max_window_layers": 0,
            "layer_types": layers, **qwen3}


def write_export_dir(path, config_name, config, weights_name, tensors, shard_bytes=0,
                     more_files=None):
    """A directory of one JSON config and one safetensors file (what save_pretrained writes),
    built under a temp name and renamed into place (replacing an empty directory), so a crash
    never leaves half an export under `path`. more_files: {file name: JSON object} written
    beside them. shard_bytes > 0 and weights larger than that: shards instead of one file
    (see shard_names)."""
    tmp = f"{os.path.normpath(path)}.tmp{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    try:
        for name, obj in {config_name: config, **(more_files or {})}.items():
            with open(os.path.join(tmp, name), "w", encoding="utf-8") as f:
                json.dump(obj, f, indent=2, ensure_ascii=False)
        total = sum(t.numel() * t.element_size() for t in tensors.values())
        weight_map = (shard_names(tensors, shard_bytes, weights_name) if 0 < shard_bytes < total
                      else {})
        if not weight_map:
            write_safetensors(os.path.join(tmp, weights_name), tensors, {"format": "pt"})
        else:
            for file in sorted(set(weight_map.values())):
                write_safetensors(os.path.join(tmp, file),
                                  {n: t for n, t in tensors.items() if weight_map[n] == file},
                                  {"format": "pt"})
            with open(os.path.join(tmp, f"{weights_name}.index.json"), "w") as f:
                json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f,
                          indent=2)
        os.replace(tmp, path)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def shard_names(tensors, shard_bytes, weights_name="model.safetensors"):
    """{tensor name: shard file} as save_pretrained splits weights: whole tensors, greedily in
    name order, a new shard when the next tensor would take this one past shard_bytes (a
    tensor larger than that gets a shard of its own); files model-00001-of-00003.safetensors ..."""
    shards, size = [[]], 0
    for name in sorted(tensors):
        nbytes = tensors[name].numel() * tensors[name].element_size()
        if shards[-1] and size + nbytes > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    stem, ext = weights_name.rsplit(".", 1)
    return {name: f"{stem}-{i + 1:05d}-of-{len(shards):05d}.{ext}"
            for i, shard in enumerate(shards) for name in shard}


# ---------------------------------------------------------------------------------------------
# The tokenizer, for Hugging Face: our tiktoken encoding as the tokenizer.json that the
# `tokenizers` library (AutoTokenizer's fast tokenizers) reads, written by hand from the ranks.
#
# tiktoken's BPE: split text with the pattern pat_str, then in each piece repeatedly join the
# adjacent pair whose concatenation has the lowest rank (a piece that is a token as a whole is
# that token). HF's byte-level BPE does the same given (1) the same split (a Split
# pre-tokenizer on pat_str), (2) vocabulary strings in GPT-2's byte -> printable-character map,
# (3) merges ordered so that "lowest merge index first" is "lowest rank of the result first",
# and (4) ignore_merges, the whole-piece shortcut. For (3) we list, for every token, every
# split of it into two tokens, ordered by the token's rank (transformers' TikTokenConverter
# does the same): the usual one merge per token (the pair its own bytes' BPE ends with) would
# miss the pairs that reach a token by another route inside a longer piece.


def bytes_to_unicode():
    """GPT-2's map from the 256 bytes to printable characters: printable Latin-1 bytes are
    themselves, the rest (controls, space, ...) are shifted to U+0100 and up."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
            *range(ord("®"), ord("ÿ") + 1)]
    shifted = [b for b in range(256) if b not in keep]
    return {**{b: chr(b) for b in keep}, **{b: chr(256 + i) for i, b in enumerate(shifted)}}


def hf_tokenizer(enc, max_length):
    """(tokenizer.json, tokenizer_config.json) as dicts for the tiktoken encoding `enc` (see
    tokenizer.get_tokenizer: a possibly truncated BPE, its special tokens, extra tokens).

    Special tokens in text behave as tokenizer.encode treats them: <|endoftext|> (and tiktoken's
    other special tokens) written in a text is ordinary text, split into byte-level tokens
    (tokenizer_config's split_special_tokens), while the extra tokens (the chat template's
    among them) become their ids; they are added tokens that are not "special" to HF, which is
    also why decode(..., skip_special_tokens=True) keeps them and drops only <|endoftext|>."""
    # a model's tokenizer.json (hf_tokenizer.HFTokenizer): itself, grown
    if hasattr(enc, "export"):
        tokenizer, config = enc.export(max_length)
        return tokenizer, {**config, **chat_template(enc)}
    ranks = enc._mergeable_ranks
    byte_char = bytes_to_unicode()

    def text(token):
        return "".join(byte_char[b] for b in token)

    merges = []
    for token, rank in ranks.items():
        for i in range(1, len(token)):
            left, right = token[:i], token[i:]
            if left in ranks and right in ranks:
                merges.append((rank, ranks[left], ranks[right], text(left), text(right)))
    merges.sort()
    # Oniguruma (the tokenizers library's regex engine) reads "{1,3}+" as "({1,3})+", any
    # number of digits, not as fancy-regex's (tiktoken's) possessive "{1,3}"; alone at the end
    # of its alternative a bounded repeat needs no possessive, so the plain one is the same
    pattern = re.sub(r"(\{\d+,\d+\})\+", r"\1", enc._pat_str)
    extra = set(getattr(enc, "extra_tokens", ()))
    added = [{"id": i, "content": t, "single_word": False, "lstrip": False, "rstrip": False,
              "normalized": False,
              "special": t not in extra}
             for t, i in sorted(enc._special_tokens.items(), key=lambda kv: kv[1])]
    vocab = {text(token): rank for token, rank in sorted(ranks.items(), key=lambda kv: kv[1])}
    # the added tokens are in the vocabulary too: `tokenizers` numbers an added token that is
    # not, whatever its "id" says, after the vocabulary (wrong past a gap: cl100k_base has no
    # id 100256). The BPE never produces them: the extra tokens are matched before it, and
    # pat_str splits the special ones ("<|" from "endoftext" from "|>")
    vocab.update({a["content"]: a["id"] for a in added})
    tokenizer = {
        "version": "1.0", "truncation": None, "padding": None, "added_tokens": added,
        "normalizer": None,
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": pattern}, "behavior": "Isolated",
             "invert": False},
            {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True,
             "use_regex": False}]},
        "post_processor": None,
        "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True,
                    "use_regex": True},
        "model": {"type": "BPE", "dropout": None, "unk_token": None,
                  "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False,
                  "ignore_merges": True,
                  "vocab": vocab,
                  "merges": [[m[3], m[4]] for m in merges]},
    }
    names = {i: t for t, i in enc._special_tokens.items()}
    # a model's tokenizer: hf_tokenizer.py
    eot, bos = names[enc.eot_token], getattr(enc, "bos_token", None)
    if bos is not None:  # documents start with it, as the model's own tokenizer does
        tokenizer["post_processor"] = {"type": "TemplateProcessing",
                                       "single": [{"SpecialToken": {"id": names[bos],
                                                                    "type_id": 0}},
                                                  {"Sequence": {"id": "A", "type_id": 0}}],
                                       "pair": [{"SpecialToken": {"id": names[bos], "type_id": 0}},
                                                {"Sequence": {"id": "A", "type_id": 0}},
                                                {"Sequence": {"id": "B", "type_id": 1}}],
                                       "special_tokens": {names[bos]: {"id": names[bos],
                                                                       "ids": [bos],
                                                                       "tokens": [names[bos]]}}}
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": max_length,
        "bos_token": eot if bos is None else names[bos], "eos_token": eot, "pad_token": eot,
        "unk_token": None,
        "add_bos_token": bos is not None, "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "split_special_tokens": True,
        "added_tokens_decoder": {str(a["id"]): {k: v for k, v in a.items() if k != "id"}
                                 for a in added},
    }
    return tokenizer, {**config, **chat_template(enc)}


def chat_template(enc):
    """{"chat_template": tokenizer.render_chat's template} when `enc` has its tokens as extra
    tokens, else {}."""
    roles = ("<|system|>", "<|user|>", "<|assistant|>", "<|end|>")  # tokenizer.CHAT_TOKENS
    if not all(t in getattr(enc, "extra_tokens", ()) for t in roles):
        return {}
    # as prepare starts each document
    bos = "{{ bos_token }}" if getattr(enc, "bos_token", None) is not None else ""
    return {"chat_template": bos + "{% for m in messages %}{{ '<|' + m['role'] + '|>' + "
                                   "m['content'] + '<|end|>' }}{% endfor %}{% if "
                                   "add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"}
