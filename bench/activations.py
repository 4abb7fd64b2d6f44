"""Activation memory by policy (techniques/activations.py): each `ac` with and without
offload_activations on the default model's shape (4 x 128 tokens a micro-batch, float32): the
bytes a step keeps for backward on the device (activations.SavedBytes) beside the memory plan's
count (techniques/memory_plan.py), ms per forward + backward (the recompute's cost against
none), and the peak memory above the weights (CUDA: max allocated; CPU: max RSS) beside the
plan's (on CUDA the plan's check against the allocator), each row in a fresh process. Then
SmolLM2-135M's shape (random weights) at long rows: the counter after one forward against the
plan, where the CPU can run it."""

import torch

from model import ModelConfig, Transformer
from techniques import activations, memory_plan

from bench.base import MODEL, SMOKE, in_subprocess, peak_and_median

POLICIES = ("none", "layers:2", "op", "full")
SMOL = dict(vocab_size=49152, n_layer=30, n_head=9, n_kv_head=3, n_embd=576, ffn_dim=1536,
            tie_embeddings=True)
# the memory plan's keys of one process, float32
PLAN = dict(ffn_dim=0, head_dim=0, tie_embeddings=False, tp=1, cp=1, pp=1, sp=False,
            dtype="float32", grad_ckpt=False, loss_chunk=0, loss_recompute=True,
            grad_accum_steps=1, pp_virtual=1, pp_schedule="1f1b", pp_layers="", fsdp=False, zero=0,
            lora_rank=0)


def activations_row(model, batch, T, ac, offload, timed=True, loss_chunk=0):
    """{saved_mb, offloaded_mb, planned_mb} of one step, and with `timed` {ms, peak_mb}."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(0)
    net = Transformer(ModelConfig(**{**model, "block_size": T, "loss_chunk": loss_chunk}))
    net = net.to(device).train()
    activations.apply(net, ac, offload)
    x = torch.randint(0, model["vocab_size"], (batch, T), device=device)
    with activations.SavedBytes(net) as saved:
        _, loss = net(x, x)
    del loss
    c = {**PLAN, **model, "batch_size": batch, "block_size": T, "ac": ac,
         "offload_activations": offload, "loss_chunk": loss_chunk}
    # the plan's peak above the weights, no optimizer here: on CUDA the check against the
    # allocator's max (peak_mb); a CPU's max RSS is only a rough one
    p = memory_plan.plan(c, 1)
    row = {"saved_mb": saved.device / 2 ** 20, "offloaded_mb": saved.offloaded / 2 ** 20,
           "planned_mb": memory_plan.activation_bytes(c, 1) / 2 ** 20,
           "plan_peak_mb": (p["peak"] - p["weights"] - p["optimizer"]) / 2 ** 20}
    if timed:
        row.update(peak_and_median(lambda: net(x, x)[1].backward(), device))
    return row


def table_activations(batch=4, T=128, long=(1024, 2048)):
    model = {k: MODEL[k] for k in ("vocab_size", "n_layer", "n_head", "n_kv_head", "n_embd")}
    print(f"\n## activation memory: the default model ({model['n_layer']} layers, width "
          f"{model['n_embd']}), {batch} x {T} tokens a micro-batch, float32; kept for backward "
          "(the counter) and the plan; ms per forward + backward and peak, each row a fresh "
          "process")
    print(f"{'ac':>9} | {'offload':>7} | {'kept MB':>8} | {'plan MB':>8} | {'to CPU MB':>9} | "
          f"{'ms':>7} | {'x none':>6} | {'peak MB':>8} | {'plan peak':>9}")
    print("-" * 92)
    base = None
    for ac in POLICIES:
        for offload in (False, True):
            r = in_subprocess("activations", model=model, batch=batch, T=T, ac=ac,
                              offload=offload)
            base = base or r["ms"]
            print(f"{ac:>9} | {str(offload):>7} | {r['saved_mb']:8.1f} | {r['planned_mb']:8.1f} "
                  f"| {r['offloaded_mb']:9.1f} | {r['ms']:7.1f} | {r['ms'] / base:6.2f} | "
                  f"{r['peak_mb']:8.0f} | {r['plan_peak_mb']:9.0f}", flush=True)
    smol = model if SMOKE else SMOL
    print(f"\n## activation memory at long rows: SmolLM2-135M's shape, 1 row, float32, "
          f"loss_chunk=1024; the counter after one forward against the plan (GiB)")
    print(f"{'tokens':>7} | " + " | ".join(f"{ac:>13}" for ac in POLICIES))
    print("-" * 72)
    for t in long:
        rows = [in_subprocess("activations", model=smol, batch=1, T=t, ac=ac, offload=False,
                              timed=False, loss_chunk=1024) for ac in POLICIES]
        print(f"{t:7,} | " + " | ".join(
            f"{r['saved_mb'] / 1024:5.2f} / {r['planned_mb'] / 1024:5.2f}" for r in rows),
              flush=True)
