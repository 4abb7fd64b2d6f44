"""Generation from the default model (sample.py's model.generate) with and without the KV cache:
tokens/s at batch 1 and 8, for as many new tokens as block_size leaves and for twice block_size
(where the cached path re-runs the window every step)."""

import time

import torch

from model import ModelConfig, Transformer

from bench.base import MODEL


def table_sample(batches=(1, 8), repeats=3):
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(0)
    model = Transformer(ModelConfig(**MODEL)).to(device).eval()
    block = MODEL["block_size"]
    print("\n## sampling (model.generate, temperature 0.8, top_k 50) from a 1-token prompt, the "
          f"default model (block_size={block}), with and without the KV cache, best of {repeats}")
    print(f"{'batch':>5} | {'new tokens':>10} | {'no cache tok/s':>14} | {'KV cache tok/s':>14} | "
          f"{'speedup':>7}")
    print("-" * 64)
    for batch in batches:
        for new in (block - 1, 2 * block):
            rates = {}
            for kv_cache in (False, True):
                times = []
                for _ in range(repeats):
                    idx = torch.zeros(batch, 1, dtype=torch.long, device=device)
                    t0 = time.perf_counter()
                    # .tolist(): wait for the GPU
                    model.generate(idx, new, 0.8, 50, kv_cache=kv_cache).tolist()
                    times.append(time.perf_counter() - t0)
                rates[kv_cache] = batch * new / min(times)
            print(f"{batch:5} | {new:10} | {rates[False]:14,.0f} | {rates[True]:14,.0f} | "
                  f"{rates[True] / rates[False]:6.2f}x")
    print(f"past block_size every step re-runs the last {block} tokens (their positions shift), "
          f"with or without the cache: the second row of each batch mixes {block - 1} cached "
          f"steps with {block + 1} full ones")
