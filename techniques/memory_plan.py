"""
The memory plan (`plan=True`): the bytes one rank holds in a step, counted from the config (and
the shape of the model it trains) before anything is built: weights, gradients, optimizer
state, the activations a step keeps for backward (as activations.SavedBytes measures them) and
the peak. Megatron prints the same for a layout; here it also says what would fit instead when
the run does not.

What a dense block keeps per row of a micro-batch, in elements (e: the activations' bytes, 4 in
float32, 2 under bf16 autocast; the norms' and the log-sum-exp stay float32), read off the
counter on this model:
  none  each RMSNorm its input, 1/rms and output (3C + 1, twice), RoPE'd q and k, v, the
        attention's output (2 (H + KV) hd) and log-sum-exp (H), the SwiGLU's gate, up, SiLU and
        product (4F)
  op    the block's input (C), q, k, v and the attention's output (2 (H + KV) hd), its
        log-sum-exp (H), gate and up (2F): the matmuls' outputs but wo's and w2's
  full  the block's input (C)
tp divides H, KV and F (and with sp the rows of C); cp divides the rows, and its ring attention
keeps under `none` its float32 output and the copy wo reads (H hd), the positions and RoPE
tables of its rows, under `op` only q, k and v (the ring runs again in backward); a pipeline
stage keeps its layers' activations for each micro-batch in flight (1F1B: min(pp - stage, m);
GPipe: all m; interleaved: its chunks in flight, its order played). Dense blocks only: a
mixture of experts' layer is counted as its top_k experts' SwiGLUs.
"""

import math
import os
import sys

from guards import guard_config
from guards.guard_errors import check


def shape_of(c):
    """The model's sizes from config `c` (ffn_dim and head_dim as ModelConfig derives them)."""
    C, H = c["n_embd"], c["n_head"]
    ffn = c["ffn_dim"] or 32 * math.ceil(8 * C / 3 / 32)
    k = c.get("moe_top_k", 2) if c.get("n_experts") else 0
    if k:
        ffn = (c.get("moe_ffn_dim") or ffn) * k
    return dict(k=k, E=c.get("n_experts", 0), L=c["n_layer"], C=C, H=H, KV=c["n_kv_head"],
                hd=c["head_dim"] or C // H, F=ffn, V=c["vocab_size"] or 200_000,
                tie=c["tie_embeddings"])


def block_bytes(s, rows, kind, e, tp=1, sp=False, ring=0):
    """What one block keeps for backward over `rows` rows under policy `kind`; `ring`: the
    tokens of one sequence on this rank under cp's ring attention (0: no cp)."""
    C, H, KV, hd, F = s["C"], s["H"] / tp, s["KV"] / tp, s["hd"], s["F"] / tp
    norm_rows = rows / tp if sp else rows
    if kind == "full":
        return norm_rows * C * 4
    attn = rows * (2 * (H + KV) * hd * e + 4 * H)
    if ring and kind == "op":  # (the ring is no matmul of its own: recomputed, out and lse too)
        attn = rows * (H + 2 * KV) * hd * e
    elif ring:  # its output kept in float32 and copied for wo, its positions and RoPE tables
        attn += rows * H * hd * 4 + ring * (8 + 8 * hd)
    # a mixture of experts: its tokens gathered in expert order (k C), their outputs back in
    # token order and weighted (2 k C), the router's logits and scores (2 E, float32)
    moe = rows * s["k"] * C * e * (1 if kind == "op" else 3) + rows * 8 * s["E"] * (kind != "op")
    if kind == "op":
        return norm_rows * C * 4 + attn + rows * 2 * F * e + moe
    # (each norm's input, 1/rms and float32 output, and the matmuls' copy of it: e bytes)
    return 2 * norm_rows * (8 * C + 4) + 2 * rows * C * e + attn + rows * 4 * F * e + moe


def in_flight(c, s, stage, dp):
    """Each moment pipeline stage `stage` has most in flight, as the chunks (0 .. pp_virtual-1)
    of the micro-batches whose forwards wait for their backwards, and the layers of each
    chunk. 1F1B: min(pp - stage, m) micro-batches; GPipe: all m; interleaved: after each
    forward, in its order (pipeline.interleaved_order: its longer warmup, then one forward
    and one backward)."""
    pp, v = c["pp"], c["pp_virtual"] if c["pp_schedule"] == "interleaved" else 1
    if pp == 1:
        return [[0]], [range(s["L"])]
    from types import SimpleNamespace

    from techniques import pipeline
    m = max(1, c["grad_accum_steps"] // dp)
    cfg = SimpleNamespace(n_layer=s["L"], n_embd=s["C"], n_head=s["H"], n_kv_head=s["KV"],
                          head_dim=s["hd"], ffn_dim=s["F"], vocab_size=s["V"],
                          block_size=c["block_size"])
    counts = ([int(n) for n in c["pp_layers"].split(",")] if c["pp_layers"].strip()
              else pipeline.pipeline_split(cfg, pp * v))
    chunks = [pipeline.stage_layers(counts, j * pp + stage) for j in range(v)]
    if c["pp_schedule"] == "gpipe":
        return [[0] * m], chunks
    if v == 1:
        return [[0] * min(pp - stage, m)], chunks
    alive, moments = [], []
    for kind, chunk, k in pipeline.interleaved_order(pp, stage, v, m):
        if kind == "F":
            alive.append((chunk, k))
            moments.append([j for j, _ in alive])
        else:
            alive.remove((chunk, k))
    return moments, chunks


def activation_bytes(c, world, s=None, stage=None):
    """What a rank of pipeline stage `stage` (None: the stage that keeps most) keeps for
    backward at most: the bytes on the device (offload_activations: none of them)."""
    if c["offload_activations"]:
        return 0
    s = s or shape_of(c)
    tp, cp, pp = c["tp"], c["cp"], c["pp"]
    if stage is None:
        return max(activation_bytes(c, world, s, r) for r in range(pp))
    dp = max(1, world // (tp * cp * pp))
    rows = c["batch_size"] * c["block_size"] / cp
    ring = c["block_size"] / cp if cp > 1 else 0
    e = 4 if c["dtype"] in ("float32", "auto") else 2
    kind, _, k = ("full" if c["grad_ckpt"] else c["ac"]).partition(":")
    per = [block_bytes(s, rows, "full" if kind == "layers" and i % int(k) == 0 else
                       "none" if kind == "layers" else kind, e, tp, c["sp"], ring)
           for i in range(s["L"])]
    # the embedding's ids (whole rows) on the first stage; on the last the final norm and the
    # head's loss (its log-softmax, or the chunks' sums)
    chunked = c["loss_chunk"] > 0
    loss = (14 + (0 if c["loss_recompute"] else 4 * s["V"] / tp) if chunked
            else 4 * s["V"] / tp + 8)
    ids = rows * cp * 8 + ring * 8  # (and cp's positions, which cut each row)
    head = rows * (8 * s["C"] + 4 + s["C"] * e + loss)
    moments, chunks = in_flight(c, s, stage, dp)
    v = len(chunks)
    held = [sum(per[i] for i in chunks[j]) + ids * (stage == 0 and j == 0)
            + head * (stage == pp - 1 and j == v - 1) for j in range(v)]
    return max(sum(held[j] for j in flight) for flight in moments)


def plan(c, world, s=None):
    """{part: bytes} of the rank that holds most: weights, gradients, optimizer state,
    activations (kept for backward), and the peak (those, one block's backward at work and the
    head's logits)."""
    s = s or shape_of(c)
    tp, cp, pp = c["tp"], c["cp"], c["pp"]
    dp = max(1, world // (tp * cp * pp))
    C, hd = s["C"], s["hd"]
    block = C * (s["H"] + 2 * s["KV"]) * hd + s["H"] * hd * C + 3 * C * s["F"] + 2 * C
    params = s["L"] * block / (tp * pp) + s["V"] * C * (1 if s["tie"] or pp > 1 else 2) / tp
    shard = dp if c["fsdp"] else 1
    weights = 4 * params / shard
    trained = params / shard if not c["lora_rank"] else 0.0
    grads = 4 * trained / (dp if c["zero"] == 2 else 1)
    optimizer = 8 * trained / (dp if c["zero"] else 1)
    acts = activation_bytes(c, world, s)
    rows = c["batch_size"] * c["block_size"] / cp
    e = 4 if c["dtype"] in ("float32", "auto") else 2
    logits = 8 * min(rows, c["loss_chunk"] or rows) * s["V"] / tp
    work = block_bytes(s, rows, "none", e, tp, c["sp"]) + logits
    return {"weights": weights, "gradients": grads, "optimizer": optimizer, "activations": acts,
            "peak": weights + grads + optimizer + acts + work}


def lines(c, world, s=None):
    p = plan(c, world, s)
    ac = "full" if c["grad_ckpt"] else c["ac"]
    return (f"memory plan per rank (ac={ac}, offload_activations={c['offload_activations']}, "
            f"{c['batch_size']} x {c['block_size']} tokens a micro-batch): "
            + ", ".join(f"{k} {v / 2 ** 30:,.2f} GiB" for k, v in p.items()))


def what_fits(c, world, have, s=None):
    """'' when the plan's peak fits in `have` bytes a rank, else what would: the largest
    batch_size, or the ac, cp or tp that does."""
    if plan(c, world, s)["peak"] <= have:
        return ""
    tries = [f"batch_size={b}" for b in range(c["batch_size"] - 1, 0, -1)
             if plan({**c, "batch_size": b}, world, s)["peak"] <= have][:1]
    tries += [f"ac={a}" for a in ("op", "full")
              if plan({**c, "ac": a, "grad_ckpt": False}, world, s)["peak"] <= have][:1]
    tries += [f"{k}={n} (on {world * n} ranks)" for k in ("cp", "tp") for n in (2, 4, 8)
              if plan({**c, k: c[k] * n}, world * n, s)["peak"] <= have][:1]
    return ", or ".join(tries) or "a smaller model"


def check_fits(c, world, print_only=False):
    """train.py's memory-plan line, for the model this run trains (guard_config.model_shape: a
    checkpoint's or a model directory's shape, read without its weights): with plan=True
    prints the plan once (rank 0) and exits; else stops a run whose plan does not fit in a
    rank's memory here, naming what would."""
    c = guard_config.model_shape(c)
    if print_only:
        if os.environ.get("RANK", "0") == "0":
            print(lines(c, world))
        sys.exit(0)
    have = guard_config.rank_memory(c, world)
    fits = what_fits(c, world, have)
    check(not fits, f"{lines(c, world)}: over the {have / 2 ** 30:,.1f} GiB a rank has here; "
                    f"what would fit: {fits}")
