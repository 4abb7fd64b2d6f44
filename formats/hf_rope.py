"""
The rotary embedding of a Hugging Face config.json, its YaRN scaling read and every scaling
written as transformers does (modeling_rope_utils); and a run's own rope_theta and
rope_scaling= over a base's (long-context continued pretraining). hf.py reads the other
scalings' fields and calls these; model.py computes the tables.
"""

import math

from guards.guard_errors import check

# rope_scaling='yarn:4' -> (rope_type, factor); '' keeps the base's, 'none' drops it
RUN_SCALINGS = ("none", "linear", "llama3", "yarn")


def original_len(rope, hf):
    """The context a llama3 or YaRN scaling stretches, as transformers' models read it: a
    config.json's top-level original_max_position_embeddings first (Phi-3 writes it there), then
    the rope dict's, then max_position_embeddings. transformers 5.24's config object shows the
    dict's, but its rotary embedding standardizes the rope parameters again as it is built,
    giving the top-level one priority; the logits follow the model, so ours do too."""
    if "original_max_position_embeddings" in hf:
        return hf["original_max_position_embeddings"]
    return rope.get("original_max_position_embeddings", hf.get("max_position_embeddings"))


def yarn_factor(rope, hf):
    """YaRN's factor, as transformers reads it: the dict's, else max_position_embeddings over
    the original length (original_len; DeepSeek-V3's files)."""
    if rope.get("factor") is not None:
        return rope["factor"]
    original = hf.get("original_max_position_embeddings",
                      rope.get("original_max_position_embeddings"))
    length = hf.get("max_position_embeddings")
    numbers = all(type(v) in (int, float) for v in (original, length))
    return length / original if numbers and original > 0 else None


def yarn_fields(rope, factor, refuse, field):
    """ModelConfig's YaRN fields (the ramp's betas, truncate, the attention factor) of a
    config.json's rotary dict `rope` whose factor is `factor` (checked by the caller)."""
    def number(key, default):
        value = rope.get(key)
        if value is None:
            return default
        if type(value) not in (int, float) or not 0 < value < 1e30:
            raise refuse(field, f"{key}={value!r}: YaRN's {key} must be a positive number")
        return float(value)

    # transformers: a missing or zero beta is its default ("or 32"); truncate defaults to True
    beta_fast, beta_slow = number("beta_fast", 32.0), number("beta_slow", 1.0)
    truncate = rope.get("truncate", True)
    if type(truncate) is not bool:
        raise refuse(field, f"truncate={truncate!r} is not a JSON bool")
    attention = number("attention_factor", None)
    if attention is None:  # the paper's 0.1 ln(s) + 1, or DeepSeek's ratio of two such
        mscale, all_dim = number("mscale", 0.0), number("mscale_all_dim", 0.0)
        attention = _mscale(factor, mscale) / _mscale(factor, all_dim) if mscale and all_dim \
            else _mscale(factor)
    return dict(rope_beta_fast=beta_fast, rope_beta_slow=beta_slow, rope_truncate=truncate,
                rope_attn_factor=float(attention))


def _mscale(scale, mscale=1.0):
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def rope_scaling_out(cfg):
    """config.json's rope_scaling for our rotary scaling (None: none), as the hub's files
    write it."""
    if cfg.rope_type == "default":
        return None
    scaling = {"rope_type": cfg.rope_type, "factor": cfg.rope_factor}
    if cfg.rope_type == "llama3":
        scaling.update(low_freq_factor=cfg.rope_low_freq, high_freq_factor=cfg.rope_high_freq,
                       original_max_position_embeddings=cfg.rope_original_len)
    if cfg.rope_type == "yarn":  # what differs from transformers' defaults (as a rule, the base's)
        scaling["original_max_position_embeddings"] = cfg.rope_original_len
        given = dict(beta_fast=cfg.rope_beta_fast, beta_slow=cfg.rope_beta_slow,
                     truncate=cfg.rope_truncate, attention_factor=cfg.rope_attn_factor)
        defaults = dict(beta_fast=32.0, beta_slow=1.0, truncate=True,
                        attention_factor=_mscale(cfg.rope_factor))
        scaling.update({k: v for k, v in given.items() if v != defaults[k]})
    return scaling


def parse_scaling(spec):
    """rope_scaling= as (rope_type, factor): '' (None: the base's), 'none', or 'TYPE:FACTOR' with
    TYPE linear, llama3 or yarn and 1 <= FACTOR < 1e6 (e.g. 'yarn:4')."""
    if spec in ("", "none"):
        return (None if spec == "" else "default"), 1.0
    kind, _, factor = spec.partition(":")
    try:
        value = float(factor)
    except ValueError:
        value = 0.0
    check(kind in RUN_SCALINGS[1:] and 1 <= value < 1e6,
          f"rope_scaling={spec!r}: write TYPE:FACTOR, TYPE one of linear, llama3, yarn and "
          f"FACTOR at least 1 and below 1000000 (e.g. rope_scaling=yarn:4), or 'none' to drop "
          f"the base's scaling")
    return kind, value


def check_run_rope(c):
    """The config's rope_theta (0, or a base of at least 1: below, the rotations barely
    turn) and rope_scaling."""
    check(c["rope_theta"] == 0 or 1 <= c["rope_theta"] < 1e30,
          f"rope_theta={c['rope_theta']}: give a base of at least 1 (e.g. 500000.0), or 0 for "
          f"the model's own")
    parse_scaling(c["rope_scaling"])


def with_run_rope(saved, rope_theta, rope_scaling, block_size):
    """ModelConfig fields `saved` (a base's, or another run's) with this run's rope_theta (0:
    the base's) and rope_scaling (parse_scaling; '': the base's). A new scaling stretches the
    context the base was trained on (the original length of its own llama3 or YaRN scaling,
    else its max_position) by its factor, and max_position becomes that, or block_size if
    longer: what an export declares."""
    kind, factor = parse_scaling(rope_scaling)
    out = dict(saved)
    if rope_theta:
        out["rope_theta"] = float(rope_theta)
    if kind is not None:
        base_len = saved.get("max_position") or saved.get("block_size") or block_size
        if saved.get("rope_type") in ("llama3", "yarn"):  # extended already: from its original
            base_len = saved.get("rope_original_len", base_len)
        out.update(rope_type=kind, rope_factor=factor, rope_original_len=int(base_len),
                   rope_attn_factor=_mscale(factor) if kind == "yarn" else 1.0)
        if kind == "default":
            out.update(rope_factor=1.0)
        out["max_position"] = max(int(base_len * factor), block_size)
    elif rope_theta:
        out["max_position"] = max(saved.get("max_position") or 0, block_size)
    return out
