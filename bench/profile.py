"""Where one step of the default job goes, in one process on the CPU (train.py's model, batch and
optimizer, Muon; glibc tuned as train.py tunes it): its MFU against the measured matmul rate,
and torch.profiler's self time per kind of work (the head's matmuls, the blocks' matmuls,
log-softmax and its backward, attention, the optimizer, the rest)."""

import time

import torch

import parallel
import workarounds
from model import ModelConfig, Transformer
from parallel import peak_flops

from bench.base import TRAIN


def table_profile(steps=5):
    """Where one step of the default job goes, in float32 and under bf16 autocast (what dtype=auto
    picks on a CPU with AVX512-BF16; elsewhere bf16 is emulated, slowly), as train.py runs each
    (under CPU bf16 autocast attention stays float32: model.Attention)."""
    from torch.profiler import ProfilerActivity, profile

    import optim
    # as train.py on the CPU (it stays so for any table after this one)
    workarounds.keep_freed_memory()
    mesh = parallel.setup("cpu")
    cfg = ModelConfig(**{k: TRAIN[k] for k in ("vocab_size", "block_size", "n_layer", "n_head",
                                               "n_kv_head", "n_embd")})
    accum, batch, V = TRAIN["grad_accum_steps"], TRAIN["batch_size"], cfg.vocab_size
    x = torch.randint(0, V, (accum, batch, cfg.block_size + 1),
                      generator=torch.Generator().manual_seed(0))
    tokens = accum * batch * cfg.block_size
    for dtype in (torch.float32, torch.bfloat16):
        torch.manual_seed(0)
        model = Transformer(cfg)
        opt, _ = optim.build_optimizer(model, model, mesh, TRAIN)
        autocast = torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32)

        def step():
            for k in range(accum):
                with autocast:
                    _, loss = model(x[k, :, :-1], x[k, :, 1:])
                (loss / accum).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        for _ in range(3):
            step()
        times = []
        for _ in range(steps * 3):
            t0 = time.perf_counter()
            step()
            times.append(time.perf_counter() - t0)
        dt = sorted(times)[len(times) // 2]
        mfu = (model.flops_per_token() * tokens / dt
               / peak_flops(torch.device("cpu"), dtype)[0])
        with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
            for _ in range(steps):
                step()
        kinds = {}
        for e in prof.key_averages(group_by_input_shape=True):
            shapes = str(e.input_shapes)
            kind = ("head matmuls (vocab x width)"
                    if e.key in ("aten::mm", "aten::addmm") and str(V) in shapes else
                    "other matmuls (blocks, Newton-Schulz)"
                    if e.key in ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm") else
                    "log-softmax, its backward, nll's zero-fill"
                    if "softmax" in e.key or (e.key == "aten::fill_" and str(V) in shapes) else
                    "casts (autocast's copies)" if e.key in ("aten::copy_", "aten::_to_copy") else
                    "attention (SDPA)" if "scaled_dot_product" in e.key
                    else "the rest (elementwise, norms, rope, ...)")
            kinds[kind] = kinds.get(kind, 0.0) + e.self_cpu_time_total
        total = sum(kinds.values())
        print(f"\n## profile: one step of the default job in one process ({tokens} tokens, "
              f"{torch.get_num_threads()} threads, {str(dtype).removeprefix('torch.')}): "
              f"{dt * 1000:.0f} ms (median of {len(times)}), MFU {mfu:.1%} of the measured "
              f"{str(dtype).removeprefix('torch.')} matmul rate; self CPU time by kind")
        for kind, t in sorted(kinds.items(), key=lambda kv: -kv[1]):
            print(f"  {kind:<45} {t / total:6.1%}")
    # Muon's matrices
    gs = [p.detach() for g in opt.param_groups if g["muon"] for p in g["params"]]

    def ns_ms(stacked, dtype=torch.float32):  # the median of 9
        times = []
        for _ in range(9):
            t0 = time.perf_counter()
            (optim.newton_schulz_each(gs, dtype) if stacked
             else [optim.newton_schulz(g, dtype=dtype) for g in gs])
            times.append(time.perf_counter() - t0)
        return sorted(times)[4] * 1000
    threads, ms = torch.get_num_threads(), {}
    for n in sorted({threads, 1}):
        torch.set_num_threads(n)
        for stacked in (True, False):
            ms[n, stacked] = ns_ms(stacked)
    torch.set_num_threads(threads)
    print(f"Muon's Newton-Schulz on the {len(gs)} matrices, per step: " + "; ".join(
        f"{n} thread{'s' if n > 1 else ''}: {ms[n, True]:.1f} ms stacked by shape "
        f"(optim.newton_schulz_each), {ms[n, False]:.1f} ms one by one"
        for n in sorted({threads, 1}))
        + f"; in bfloat16, stacked, {threads} threads: {ns_ms(True, torch.bfloat16):.1f} ms "
        f"(float32 on a CPU: see optim.py)")
