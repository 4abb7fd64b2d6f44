"""
The memory plan (`plan=True`): the bytes one rank holds in a step, counted from the config before
anything is built: weights, gradients, optimizer state, the activations a step keeps for backward
(as activations.SavedBytes measures them) and the peak. Megatron prints the same for a layout;
here it also says what would fit instead when the run does not.

What a dense block keeps per row of a micro-batch, in elements (e: the activations' bytes, 4 in
float32, 2 under bf16 autocast; the norms' and the log-sum-exp stay float32), read off the
counter on this model:
  none  each RMSNorm its input, 1/rms and output (3C + 1, twice), RoPE'd q and k, v, the
        attention's output (2 (H + KV) hd) and log-sum-exp (H), the SwiGLU's gate, up, SiLU and
        product (4F)
  op    the block's input (C), q, k, v and the attention's output (2 (H + KV) hd), its
        log-sum-exp (H), gate and up (2F): the matmuls' outputs but wo's and w2's
  full  the block's input (C)
tp divides H, KV and F (and with sp the rows of C); cp divides the rows; a pipeline stage keeps
its layers' activations for each micro-batch in flight (1F1B: min(pp - stage, m); interleaved:
the longer warmup's chunks; GPipe: all m). Dense blocks only: a mixture of experts' layer is
counted as its top_k experts' SwiGLUs.
"""

import math


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


def block_bytes(s, rows, kind, e, tp=1, sp=False):
    """What one block keeps for backward over `rows` rows under policy `kind`."""
    C, H, KV, hd, F = s["C"], s["H"] / tp, s["KV"] / tp, s["hd"], s["F"] / tp
    norm_rows = rows / tp if sp else rows
    if kind == "full":
        return norm_rows * C * 4
    attn = rows * (2 * (H + KV) * hd * e + 4 * H)
    # a mixture of experts: its tokens gathered in expert order (k C), their outputs back in
    # token order and weighted (2 k C), the router's logits and scores (2 E, float32)
    moe = rows * s["k"] * C * e * (1 if kind == "op" else 3) + rows * 8 * s["E"] * (kind != "op")
    if kind == "op":
        return norm_rows * C * 4 + attn + rows * 2 * F * e + moe
    # (each norm's input, 1/rms and float32 output, and the matmuls' copy of it: e bytes)
    return 2 * norm_rows * (8 * C + 4) + 2 * rows * C * e + attn + rows * 4 * F * e + moe


def in_flight(c, dp):
    """(micro-batches in flight at the first stage, layers of one) by the schedule."""
    pp, v = c["pp"], c["pp_virtual"]
    m = max(1, c["grad_accum_steps"] // dp)
    if pp == 1:
        return 1, c["n_layer"]
    if c["pp_schedule"] == "gpipe":
        return m, c["n_layer"] / pp
    if c["pp_schedule"] == "interleaved":
        return min((pp - 1) * 2 + (v - 1) * pp + 1, m * v), c["n_layer"] / (pp * v)
    return min(pp, m), c["n_layer"] / pp


def activation_bytes(c, world, s=None):
    """What the rank that keeps most keeps for backward after its forwards: the bytes on the
    device (offload_activations: none of them)."""
    if c["offload_activations"]:
        return 0
    s = s or shape_of(c)
    tp, cp, pp = c["tp"], c["cp"], c["pp"]
    dp = max(1, world // (tp * cp * pp))
    rows = c["batch_size"] * c["block_size"] / cp
    e = 4 if c["dtype"] in ("float32", "auto") else 2
    kind, _, k = ("full" if c["grad_ckpt"] else c["ac"]).partition(":")
    if kind == "layers":
        per = [block_bytes(s, rows, "full" if i % int(k) == 0 else "none", e, tp, c["sp"])
               for i in range(s["L"])]
    else:
        per = [block_bytes(s, rows, kind, e, tp, c["sp"])] * s["L"]
    flight, layers = in_flight(c, dp)
    blocks = flight * sum(per) / s["L"] * layers
    # the embedding's ids, the last norm, the head's loss (log-softmax, or the chunks' sums)
    chunked = c["loss_chunk"] > 0
    loss = (14 + (0 if c["loss_recompute"] else 4 * s["V"] / tp) if chunked
            else 4 * s["V"] / tp + 8)
    head = rows * (8 + 8 * s["C"] + 4 + s["C"] * e + loss)
    return blocks + head


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
