"""Full fine-tuning against LoRA at r=8 (alpha 16, on wq,wk,wv,wo) on the default model, one
process each: ms/iter, trainable parameters, optimizer bytes, peak memory."""

import torch

import parallel
from model import ModelConfig, Transformer
from techniques.lora import apply_lora

from bench.base import ACCUM, BATCH, ITERS, MODEL, in_subprocess, median_step_time, peak_memory_mb


def lora_row(rank):
    """One process trains the default model fully (rank 0) or with LoRA adapters of this rank."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(0)
    model = Transformer(ModelConfig(**MODEL))
    if rank:
        apply_lora(model, rank, 16.0, 0.0, ["wq", "wk", "wv", "wo"], seed=0)
    model.to(device)
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trainable, lr=1e-4)
    x = torch.randint(0, MODEL["vocab_size"], (ACCUM, BATCH, MODEL["block_size"] + 1),
                      device=device)
    autocast = (torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda"
                else torch.autocast("cpu", enabled=False))
    dt = median_step_time(model, opt, x, autocast, keep_grads=True)
    mem = parallel.memory_bytes(model, opt)
    return {"rank": rank, "ms_iter": dt * 1000,
            "trainable": sum(p.numel() for p in trainable), "params": model.num_params(),
            "optim_bytes": mem["optimizer"], "peak_mb": peak_memory_mb(device)}


def table_lora():
    print("\n## full fine-tuning vs LoRA (r=8, alpha 16, wq,wk,wv,wo), the default model, batch "
          f"{BATCH} x {ACCUM} micro-steps, median of {ITERS} iterations, one process each")
    rows = [in_subprocess("lora", rank=r) for r in (0, 8)]
    print(f"{'':<16} | {'ms/iter':>8} | {'trainable params':>16} | {'optimizer bytes':>15} | "
          f"{'peak mem':>9}")
    print("-" * 76)
    for r in rows:
        name = "full fine-tune" if r["rank"] == 0 else f"LoRA r={r['rank']}"
        print(f"{name:<16} | {r['ms_iter']:8.1f} | {r['trainable']:16,} | {r['optim_bytes']:15,} "
              f"| {r['peak_mb']:6.0f} MB")
    print(f"LoRA trains {rows[1]['trainable'] / rows[1]['params']:.2%} of {rows[1]['params']:,} "
          "parameters; the base still runs forward and backward (for the activations' gradients), "
          "so the time does not drop by that factor")
