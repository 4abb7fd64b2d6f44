"""
Benchmarks, printed as tables. Not tests: timings on shared machines are noisy, so each
table compares rows measured in the same run.

    python bench.py                  # every table
    python bench.py single           # one table by name
    python bench.py --smoke          # every table at a tiny size, to check that it runs (numbers mean nothing);
                                     # key=value after it go to its train.py runs, e.g. dataset=data/mine

single: throughput of one process on the default model (train.py's defaults), with and
        without activation checkpointing: ms/iter, tokens/s, MFU against this machine's
        measured matmul rate, and peak memory. Each row runs in a fresh process so that its
        peak memory (max RSS on CPU) is its own.
dp:     data parallel at 2 ranks (gloo on CPU, nccl on GPUs), the same model and global
        batch: our naive and bucketed all-reduce against torch's DistributedDataParallel,
        measured in interleaved rounds, plus how much of the bucketed all-reduce time is
        hidden behind backward.
pp:     pipeline parallel with 2 and 4 stages (one process per stage) and m = 4 and 8
        micro-batches, on the default model and on a 16-layer one of the same width: our GPipe,
        1F1B on the even and the cost-balanced layer split, and interleaved 1F1B (2 chunks per
        stage, where the layers allow), against torch.distributed.pipelining's Schedule1F1B and
        ScheduleInterleaved1F1B on the same layers; the measured
        bubble against (p-1)/(m+p-1) (interleaved: (p-1)/(V*m+p-1)), the micro-batches alive
        at once per stage, and the bytes autograd saves for one micro-batch (saved_tensors_hooks).
lora:   full fine-tuning against LoRA at r=8 (alpha 16, on wq,wk,wv,wo) on the default model,
        one process each: ms/iter, trainable parameters, optimizer bytes, peak memory.
tp:     tensor parallel at 1, 2 and 4 ranks, the default model and one global batch: ms/iter,
        per-rank parameter bytes and activation bytes (what autograd saves for one
        micro-batch), and the all-reduce volume of one iteration counted at dist.all_reduce
        against the theory.
long:   long sequences: activation bytes per rank (what autograd saves for backward) and ms of
        forward + backward at T = 512, 1024, 2048 for one process, tp=2, tp=2 with sequence
        parallelism, and cp=2 by the ring and by the all-gather (a small model, gloo ranks).
sample: generation from the default model (sample.py's model.generate) with and without the
        KV cache: tokens/s at batch 1 and 8, for as many new tokens as block_size leaves
        and for twice block_size (where the cached path re-runs the window every step).
memory: the default model at 1, 2 and 4 ranks as dp, ZeRO 1 and 2 (and 2 with optimizer offload),
        fsdp and pp, the same global batch:
        per-rank bytes of parameters, gradients and optimizer state, the peak memory
        (max RSS above the process's size before the model was built, on CPU), and ms/iter.
race:   side by side on the default corpus, one after the other: nanoGPT's own train.py with
        its README's CPU recipe (its files in ./nanogpt or $NANOGPT_DIR: train.py, model.py,
        configurator.py, config/train_shakespeare_char.py), then the default job launched as the
        README's quickstart launches it (`python train.py`, one process), the same in float32 (no
        bf16 autocast: what dtype=auto's bf16 buys), and under torchrun with 2 processes. Both
        sides scored by one evaluator (val_score: every 64-token block of the whole val split):
        nanoGPT's final model is the
        finish line; ours is scored at a checkpoint every 25 iterations, the time to the line
        interpolated between two. The ratio of the times, the load average around each side, and
        apart, labelled, each side's own estimate (~9 minutes: run it on a quiet machine).
checkpoint: how long the loop is blocked per checkpoint save, plain (ckpt_async=False) vs
        async (ckpt_async=True: copying the state to CPU memory, then the finish once the
        background write is done), at the default model and one ~10x larger, 1 and 2 ranks
        (dp), weights and AdamW state; plus how long the background write took.
reading: what a reader must read to follow one plain iteration of `python train.py` (one
        process, one dataset, max_iters=1): the entry script up to its last executed line, plus
        the full span of every project function entered (each once; nested ones inside a
        counted span are not counted again), to the first optimizer step and for the whole
        1-iteration run (eval, a checkpoint), with the split per file. --functions lists them.
memory2d: the 2D layouts at 4 ranks beside tp=2 and fsdp=4 (and one process): per-rank bytes
        of parameters, gradients and optimizer state (AdamW) against the whole model's, which
        tp=2 x fsdp=2 and tp=2 x zero=2 should cut to about 1/(tp x dp); then Muon (the default)
        on dp=4, zero=2 (4 ranks), fsdp=4, tp=2 (x dp=2) and tp=2 x fsdp=2: the Newton-Schulz
        FLOPs each rank does per step (its share of the whole) and the ms that
        orthogonalizing takes (gathering, the Newton-Schulz steps, sharing the results).
head:   the output head + cross-entropy alone, forward and backward, at vocab 8k, 32k and 128k
        (train.py's micro-batch of rows, its width): all logits at once (loss_chunk=0) against
        model.ChunkedCrossEntropy (loss_chunk=128), ms and the peak memory above the inputs
        (CUDA: max allocated; CPU: max RSS), each row in a fresh process.
gpu:    (a CUDA device only) a GPT-2-small-shaped LLaMA (12 layers, width 768, 12 heads, block
        1024, vocab 50304, batch 12: nanoGPT's bench.py shape) in bf16 autocast, compiled, flash
        SDPA, fused AdamW: ms/iter, tokens/s and MFU against the GPU's dense bf16 peak, beside
        nanoGPT's own bench.py (GPT-2 124M) run on the same GPU in the same run (its files in
        ./nanogpt or $NANOGPT_DIR: bench.py, model.py, configurator.py; its MFU, printed against
        the A100's 312 TFLOP/s, is rescaled to this GPU's peak); then the same model under FSDP2
        on one rank, its checkpoint saves plain vs async, and the head + loss at vocab 128k.
mfu:    the default job's own step, as train.py times it and logs it (`python train.py`, one
        process, the machine's threads): the median ms/iter and tokens/s of metrics.jsonl's
        iterations after the first 20, eager and with compile=True, two runs of each alternated,
        and MFU against the best matmul rate the runs measured; each run's wall time.
profile: where one step of the default job goes, in one process on the CPU (train.py's model,
        batch and optimizer, Muon; glibc tuned as train.py tunes it): its MFU against the measured
        matmul rate, and torch.profiler's self time per kind of work (the head's matmuls, the
        blocks' matmuls, log-softmax and its backward, attention, the optimizer, the rest).
tokenize: encoding the default corpus (its first ~30 MB) with the default tokenizer (cl100k_base
        cut to 8,192 ids) through tiktoken, and with the same BPE exported as a tokenizer.json
        (hf.hf_tokenizer) read back by tokenizer.load (how a model's tokenizer.json is read: its
        tiktoken twin where that is exact, as here) and through the `tokenizers` library alone,
        data.encode_batch on the machine's threads, best of 3: tokens/s and MB/s; the ids are
        checked equal.
build:  peak tensor bytes per rank while building the model (fresh weights) and while importing a
        Hugging Face copy of it, at 1, 2, 4 ranks as fsdp and pp: train.py's meta-device build
        against building the whole model first, on a model whose layers dominate.
"""

import atexit
import copy
import json
from contextlib import nullcontext
import math
import os
import resource
import shutil
import socket
import subprocess
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import build
import checkpoint
import configurator
import context_parallel
import data
import data_parallel
import fsdp
import parallel
import pipeline
import prepare
import tensor_parallel
import workarounds
import zero
from lora import apply_lora
from model import ModelConfig, Transformer, cross_entropy_losses
from optim import AdamW
from parallel import measure_matmul_flops

TRAIN_PY = os.path.join(os.path.dirname(os.path.abspath(__file__)), "train.py")


def default_threads_env(**extra):
    """os.environ without OMP_NUM_THREADS (torch's default: the machine's threads), plus `extra`."""
    return {**{k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}, **extra}


# the default model and batch of train.py, read from its defaults block
TRAIN = configurator.script_defaults(TRAIN_PY)
MODEL = {k: TRAIN[k] for k in ("vocab_size", "n_layer", "n_head", "n_kv_head", "n_embd")}
MODEL["block_size"] = 128  # the tables below were measured on 128-token sequences (the default job trains 64)
BATCH, ACCUM = 16, 2  # 4096 tokens/iter, as the tables below were measured (the default job trains 1024/iter)
WARMUP, ITERS = 3, 10
SMOKE = "--smoke" in sys.argv or os.environ.get("BENCH_SMOKE") == "1"  # every table tiny (see the end of this file)
RUN_KEYS = []  # key=value for the train.py runs of race, mfu and reading (--smoke: a tiny model's, then the command's)


def peak_memory_mb(device):
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated() / 2 ** 20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


def median_step_time(model, opt, x, autocast, keep_grads=False):
    """Seconds per training step (ACCUM micro-steps of x, then AdamW), the median of ITERS after
    WARMUP: robust to a noisy neighbour. keep_grads: the last step's gradients stay, to be counted."""
    times = []
    for i in range(WARMUP + ITERS):
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        for k in range(ACCUM):
            with autocast:
                _, loss = model(x[k, :, :-1], x[k, :, 1:])
            (loss / ACCUM).backward()
        opt.step()
        loss.item()
        times.append(time.perf_counter() - t0)
    if not keep_grads:
        opt.zero_grad(set_to_none=True)
    return sorted(times[WARMUP:])[ITERS // 2]


def single_row(grad_ckpt):
    """One training configuration, timed in this process: a dict of measurements."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(0)
    model = Transformer(ModelConfig(**MODEL, grad_ckpt=grad_ckpt)).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randint(0, MODEL["vocab_size"], (ACCUM, BATCH, MODEL["block_size"] + 1), device=device)
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else torch.autocast("cpu", enabled=False)
    dt = median_step_time(model, opt, x, autocast)
    tokens = ACCUM * BATCH * MODEL["block_size"]
    peak = measure_matmul_flops(device, torch.bfloat16 if device.type == "cuda" else torch.float32)
    return {"grad_ckpt": grad_ckpt, "ms_iter": dt * 1000, "tok_s": tokens / dt,
            "mfu": model.flops_per_token() * tokens / dt / peak, "peak_gflops": peak / 1e9,
            "peak_mb": peak_memory_mb(device), "params_m": model.num_params() / 1e6}


def in_subprocess(table, **kw):
    """Runs one row in a fresh interpreter (own peak memory) and returns its dict."""
    if SMOKE:  # a tiny row: its peak memory means nothing anyway
        return ROWS[table](**kw)
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", str(os.cpu_count()))}
    out = subprocess.run([sys.executable, __file__, "--row", table, json.dumps(kw)], env=env,
                         capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def table_single():
    cfg = ", ".join(f"{k}={v}" for k, v in MODEL.items())
    print(f"\n## single process: {cfg}, batch {BATCH} x {ACCUM} micro-steps "
          f"({BATCH * ACCUM * MODEL['block_size']} tokens/iter), median of {ITERS} iterations")
    rows = [in_subprocess("single", grad_ckpt=g) for g in (False, True)]
    print(f"{'grad_ckpt':>9} | {'ms/iter':>8} | {'tokens/s':>9} | {'MFU':>6} | {'matmul peak':>12} | {'peak mem':>9}")
    print("-" * 68)
    for r in rows:
        print(f"{str(r['grad_ckpt']):>9} | {r['ms_iter']:8.1f} | {r['tok_s']:9,.0f} | {r['mfu']:6.1%} | "
              f"{r['peak_gflops']:7.1f} GF/s | {r['peak_mb']:6.0f} MB")
    print(f"model: {rows[0]['params_m']:.2f}M parameters; grad_ckpt=True costs "
          f"{rows[1]['ms_iter'] / rows[0]['ms_iter']:.2f}x the time (one more forward per block)")


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
    x = torch.randint(0, MODEL["vocab_size"], (ACCUM, BATCH, MODEL["block_size"] + 1), device=device)
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else torch.autocast("cpu", enabled=False)
    dt = median_step_time(model, opt, x, autocast, keep_grads=True)
    mem = parallel.memory_bytes(model, opt)
    return {"rank": rank, "ms_iter": dt * 1000,
            "trainable": sum(p.numel() for p in trainable), "params": model.num_params(),
            "optim_bytes": mem["optimizer"], "peak_mb": peak_memory_mb(device)}


def table_lora():
    print(f"\n## full fine-tuning vs LoRA (r=8, alpha 16, wq,wk,wv,wo), the default model, batch {BATCH} x {ACCUM} "
          f"micro-steps, median of {ITERS} iterations, one process each")
    rows = [in_subprocess("lora", rank=r) for r in (0, 8)]
    print(f"{'':<16} | {'ms/iter':>8} | {'trainable params':>16} | {'optimizer bytes':>15} | {'peak mem':>9}")
    print("-" * 76)
    for r in rows:
        name = "full fine-tune" if r["rank"] == 0 else f"LoRA r={r['rank']}"
        print(f"{name:<16} | {r['ms_iter']:8.1f} | {r['trainable']:16,} | {r['optim_bytes']:15,} | {r['peak_mb']:6.0f} MB")
    print(f"LoRA trains {rows[1]['trainable'] / rows[1]['params']:.2%} of {rows[1]['params']:,} parameters; "
          f"the base still runs forward and backward (for the activations' gradients), so the time does not "
          f"drop by that factor")


def run_ranks(worker, world, *args):
    """Runs worker(*args) on `world` spawned ranks (gloo on CPU, nccl on GPUs) and returns what
    rank 0's call returned (JSON-able)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        # smoke on a CPU: forked ranks start at once (no interpreter to start, no imports again)
        how = "fork" if SMOKE and not torch.cuda.is_available() else "spawn"
        mp.start_processes(_rank_main, args=(world, port, worker, args, out), nprocs=world, start_method=how)
        with open(out) as f:
            return json.load(f)


def _rank_main(rank, world, port, worker, args, out_path):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(world))
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))  # the cores, shared out
    result = worker(*args)
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(result, f)
    workarounds.exit_now()  # skip the interpreter's shutdown, where gloo's threads can abort


def dp_worker(bucket_sizes):
    """One rank of the dp table: every implementation, interleaved round by round so that a
    noisy neighbour hurts them all alike."""
    mesh = parallel.setup("auto", 300)
    dev = mesh.device
    variants = [("none", None), ("naive", None), *[("bucketed", mb) for mb in bucket_sizes], ("torch", bucket_sizes[0])]
    models = {}
    for impl, mb in variants:
        torch.manual_seed(0)
        model = Transformer(ModelConfig(**MODEL)).to(dev)
        if impl == "none":  # no communication at all: the compute-only floor
            ddp = model
        elif impl == "torch":
            ddp = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=mb)
        else:
            ddp = data_parallel.NaiveDataParallel(model, mesh) if impl == "naive" else data_parallel.DataParallel(model, mesh, mb)
        models[(impl, mb)] = (ddp, torch.optim.AdamW(model.parameters(), lr=1e-4))
    micro = ACCUM // mesh.dp
    x = torch.randint(0, MODEL["vocab_size"], (micro, BATCH, MODEL["block_size"] + 1), device=dev,
                      generator=torch.Generator(dev).manual_seed(mesh.rank))
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    times = {v: [] for v in variants}
    waits = {v: [] for v in variants}
    for rnd in range(WARMUP + ITERS):
        for v in variants:
            ddp, opt = models[v]
            dist.barrier()
            t0 = time.perf_counter()
            for k in range(micro):
                ddp.require_backward_grad_sync = k == micro - 1
                _, loss = ddp(x[k, :, :-1], x[k, :, 1:])
                (loss / micro).backward()
            sync()
            t1 = time.perf_counter()
            if v[0] in ("naive", "bucketed"):
                ddp.wait()  # what backward did not hide: naive's whole all-reduce, bucketed's last bucket(s)
            sync()
            t2 = time.perf_counter()
            opt.step()
            opt.zero_grad(set_to_none=True)
            sync()
            if rnd >= WARMUP:
                times[v].append(time.perf_counter() - t0)
                waits[v].append(t2 - t1)
    # the all-reduce time alone: every bucket of the bucketed layout, synchronously, no backward
    comm = {}
    for v in variants:
        if v[0] == "bucketed":
            flats = [b.flat for b in models[v][0].buckets]
            ts = []
            for _ in range(ITERS):
                dist.barrier()
                t0 = time.perf_counter()
                for f in flats:
                    dist.all_reduce(f)
                sync()
                ts.append(time.perf_counter() - t0)
            comm[v] = sorted(ts)[ITERS // 2]
    med = lambda xs: sorted(xs)[len(xs) // 2]  # noqa: E731
    rows = [{"impl": impl, "bucket_mb": mb, "ms_iter": med(times[(impl, mb)]) * 1000,
             "wait_ms": med(waits[(impl, mb)]) * 1000, "comm_ms": comm.get((impl, mb), 0) * 1000,
             "buckets": len(models[(impl, mb)][0].buckets) if impl == "bucketed" else None}
            for impl, mb in variants]
    parallel.teardown(mesh)
    return rows


def table_dp(world=2, bucket_sizes=(4.0, 1.0, 25.0)):
    tokens = ACCUM * BATCH * MODEL["block_size"]
    n_params = Transformer(ModelConfig(**MODEL)).num_params()
    print(f"\n## data parallel, {world} ranks ({'nccl' if torch.cuda.is_available() else 'gloo'}), same model, "
          f"global batch {BATCH} x {ACCUM} micro-batches ({tokens} tokens/iter), {n_params * 4 / 2 ** 20:.1f} MB "
          f"of fp32 gradients, median of {ITERS} interleaved rounds")
    rows = run_ranks(dp_worker, world, list(bucket_sizes))
    ms = {(r["impl"], r["bucket_mb"]): r["ms_iter"] for r in rows}
    torch_ms, floor = ms[("torch", bucket_sizes[0])], ms[("none", None)]
    bucketed_ms = ms[("bucketed", bucket_sizes[0])]
    comm_alone = rows[2]["comm_ms"]
    print(f"{'implementation':<26} | {'ms/iter':>8} | {'tokens/s':>9} | {'vs torch':>8} | {'exposed comm':>12} | "
          f"{'wait after bwd':>14} | {'hidden':>6}")
    print("-" * 102)
    for r in rows:
        name = {"none": "no sync (compute only)", "naive": "naive (per parameter)",
                "torch": "torch DDP"}.get(r["impl"], "bucketed")
        if r["bucket_mb"] is not None:
            name += f", {r['bucket_mb']:g} MB" + (f" ({r['buckets']} bkt)" if r["buckets"] else "")
        exposed = r["ms_iter"] - floor
        hidden = (f"{min(1.0, max(0.0, 1 - r['wait_ms'] / comm_alone)):6.0%}" if r["impl"] in ("naive", "bucketed")
                  else f"{'':>6}")
        wait = f"{r['wait_ms']:11.1f} ms" if r["impl"] in ("naive", "bucketed") else f"{'':>14}"
        print(f"{name:<26} | {r['ms_iter']:8.1f} | {tokens / r['ms_iter'] * 1000:9,.0f} | "
              f"{r['ms_iter'] / torch_ms:7.2f}x | {exposed:9.1f} ms | {wait} | {hidden}")
    print(f"bucketed ({bucket_sizes[0]:g} MB) / torch DDP: {bucketed_ms / torch_ms:.2f} (goal <= 1.05); naive / "
          f"bucketed: {ms[('naive', None)] / bucketed_ms:.2f}. The same all-reduces run alone take {comm_alone:.1f} ms; "
          f"hidden = 1 - wait after backward / alone;\nexposed comm = ms/iter - compute only, which also counts compute slowed by the communication threads.")


def pp_worker(ms, model):
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    from pipeline import make_stage, pipeline_split
    mesh = parallel.setup("auto", 300, pp=int(os.environ["WORLD_SIZE"]))
    workarounds.keep_freed_memory()  # as train.py does on a CPU
    dev, T, V = mesh.device, model["block_size"], model["vocab_size"]
    n, pp = model["n_layer"], mesh.pp
    splits = {"even": [n // pp + (s < n % pp) for s in range(pp)],  # the old split: layer counts only
              "balanced": pipeline_split(ModelConfig(**model), pp)}  # the head and loss counted on the last stage

    def new_stage(split="balanced", virtual=1):
        torch.manual_seed(0)
        counts = splits[split] if virtual == 1 else pipeline_split(ModelConfig(**model), pp * virtual)
        return make_stage(Transformer(ModelConfig(**model)), mesh.pp_rank, pp, counts, virtual).to(dev)

    class Logits(torch.nn.Module):  # torch's stages return one tensor; ours return (output, loss)
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, inp):
            return self.inner(inp)[0]

    rows = []
    for m in ms:
        data = torch.randint(0, V, (m, PP_BATCH, T + 1), device=dev, generator=torch.Generator(dev).manual_seed(0))
        x, y = data[..., :-1], data[..., 1:]
        micro = [(x[k], y[k], None, None) for k in range(m)]
        act = (PP_BATCH, T, model["n_embd"])
        # name -> (schedule, split, chunks per stage); interleaved where every virtual stage gets a
        # layer and m is a multiple of pp
        kinds = {"gpipe": ("gpipe", "balanced", 1), "1f1b even": ("1f1b", "even", 1),
                 "1f1b": ("1f1b", "balanced", 1)}
        if 2 * pp <= n and m % pp == 0:
            kinds["interleaved"] = ("interleaved", "balanced", 2)
        variants = list(kinds)
        ours = {v: new_stage(*kinds[v][1:]) for v in variants}
        loss_fn = lambda logits, tgt: torch.nn.functional.cross_entropy(logits.flatten(0, 1), tgt.flatten())  # noqa: E731
        # torch's peers on the same layers: Schedule1F1B on our balanced stage, and (where ours runs
        # interleaved) ScheduleInterleaved1F1B on one module per virtual stage of the same split
        tstage = new_stage()
        peers = {"torch 1F1B": (Schedule1F1B(PipelineStage(Logits(tstage), mesh.pp_rank, pp, dev), m, loss_fn=loss_fn),
                                list(tstage.parameters()))}
        kinds["torch 1F1B"] = ("torch 1F1B", "balanced", 1)
        if "interleaved" in kinds:
            from torch.distributed.pipelining import ScheduleInterleaved1F1B
            counts, chunks = pipeline_split(ModelConfig(**model), 2 * pp), []
            for v in range(2):
                torch.manual_seed(0)
                chunks.append(make_stage(Transformer(ModelConfig(**model)), v * pp + mesh.pp_rank, 2 * pp, counts).to(dev))
            pipes = [PipelineStage(Logits(c), v * pp + mesh.pp_rank, 2 * pp, dev) for v, c in enumerate(chunks)]
            peers["torch interleaved"] = (ScheduleInterleaved1F1B(pipes, m, loss_fn=loss_fn),
                                          [p for c in chunks for p in c.parameters()])
            kinds["torch interleaved"] = ("torch interleaved", "balanced", 2)

        def torch_step(sched):
            if mesh.first_stage:
                sched.step(x.reshape(m * PP_BATCH, T))
            elif mesh.last_stage:
                sched.step(target=y.reshape(m * PP_BATCH, T))
            else:
                sched.step()

        times = {v: [] for v in variants + list(peers)}
        peaks, bubbles = {}, {v: [] for v in variants}
        for rnd in range(WARMUP + ITERS):
            for v in times:
                dist.barrier()
                t0 = time.perf_counter()
                trace = [] if v not in peers else None
                if v in peers:
                    torch_step(peers[v][0])
                else:
                    _, peaks[v] = pipeline.pipeline_step(kinds[v][0], ours[v], mesh, micro, act, trace=trace,
                                                         virtual=kinds[v][2])
                dist.barrier()
                if rnd >= WARMUP:
                    times[v].append(time.perf_counter() - t0)
                    if trace is not None:
                        traces = parallel.all_gather_object(trace, mesh)
                        bubbles[v].append(pipeline.pipeline_timeline(traces, m, virtual=kinds[v][2])[1])
                for p in (peers[v][1] if v in peers else ours[v].parameters()):
                    p.grad = None
        # bytes autograd keeps for one micro-batch's forward on this stage
        saved = []

        def pack(t):
            saved.append(t.numel() * t.element_size())
            return t
        stage = ours["1f1b"]
        inp = x[0] if mesh.first_stage else torch.randn(act, device=dev, requires_grad=True)
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            stage(inp, y[0] if mesh.last_stage else None)
        per_micro = sum(saved)
        med = lambda xs: sorted(xs)[len(xs) // 2]  # noqa: E731
        mine = {"stage": mesh.pp_rank, "per_micro_mb": per_micro / 2 ** 20, "peak": peaks}
        every = parallel.all_gather_object(mine, mesh)
        if mesh.master:
            rows.append({"pp": pp, "m": m, "splits": splits, "kinds": kinds,
                         "ms": {v: med(t) * 1000 for v, t in times.items()},
                         "bubble": {v: med(b) for v, b in bubbles.items()}, "stages": every})
        # one traced iteration of each 1F1B to draw
        for v in variants[1:]:
            trace = []
            pipeline.pipeline_step(kinds[v][0], ours[v], mesh, micro, act, trace=trace, virtual=kinds[v][2])
            traces = parallel.all_gather_object(trace, mesh)
            if mesh.master:
                rows[-1].setdefault("text", {})[v] = pipeline.pipeline_timeline(traces, m, width=100,
                                                                                virtual=kinds[v][2])[0]
    parallel.teardown(mesh)
    return rows


PP_BATCH = 8


# pipelines are for deep models: 16 layers of the default width, where the 8192 x 128 head and its
# loss weigh about 8 layers (model.stage_costs) instead of more than the other 4 together
DEEP_MODEL = {**MODEL, "n_layer": 16}


def table_pp(stages=(2, 4), ms=(4, 8), model=MODEL, title="the default model"):
    print(f"\n## pipeline parallel ({'nccl' if torch.cuda.is_available() else 'gloo'}), {title} "
          f"({model['n_layer']} layers), one process per stage, micro-batches of {PP_BATCH} x {model['block_size']} "
          f"tokens, median of {ITERS} interleaved rounds")
    rows = []
    for pp in stages:
        rows += run_ranks(pp_worker, pp, list(ms), model)
    print(f"{'pp':>2} {'m':>2} | {'schedule':<21} | {'layers':<9} | {'ms/iter':>8} | {'vs torch':>8} | "
          f"{'bubble':>7} | {'theory':>6} | {'peak alive per stage':<20}")
    print("-" * 105)
    for r in rows:
        pp, m = r["pp"], r["m"]
        torch_ms = r["ms"]["torch 1F1B"]
        for v, (name, split, virtual) in r["kinds"].items():
            layers = ",".join(map(str, r["splits"][split])) if virtual == 1 else f"{virtual} chunks"
            sched = name if virtual == 1 else f"{name} V={virtual}"
            bubble = f"{r['bubble'][v]:7.1%}" if v in r["bubble"] else f"{'':>7}"
            peak = " ".join(str(st["peak"][v]) for st in r["stages"]) if v in r["stages"][0]["peak"] else ""
            print(f"{pp:>2} {m:>2} | {sched:<21} | {layers:<9} | {r['ms'][v]:8.1f} | {r['ms'][v] / torch_ms:7.2f}x | "
                  f"{bubble} | {(pp - 1) / (virtual * m + pp - 1):6.1%} | {peak:<20}")
    print("bubble: the mean idle share of the stages in the traced iterations (median); theory: the same share for "
          "balanced stages and free communication, (p-1)/(m+p-1), and (p-1)/(V*m+p-1) interleaved (Narayanan et al.'s "
          "(p-1)/(V*m) is that idle time relative to the bubble-free time). layers: counts per stage, even (the old "
          "split) or balanced by estimated cost (model.pipeline_split). peak alive: micro-batches (interleaved: "
          "micro-batch chunks) whose activations are kept at once, per stage.")
    for r in rows:
        st = r["stages"][0]
        print(f"pp={r['pp']} m={r['m']}: stage 0 keeps {st['per_micro_mb']:.1f} MB of activations per micro-batch "
              f"(balanced split)")
    for v, text in rows[0]["text"].items():
        name, split, virtual = rows[0]["kinds"][v]
        print(f"\n{name}, {split} split{f', V={virtual}' if virtual > 1 else ''}:\n{text}")


def table_pp_both(stages=(2, 4), ms=(4, 8), deep_ms=(8,)):
    table_pp(stages, ms)
    if deep_ms:
        table_pp(stages, deep_ms, DEEP_MODEL, "a deeper model")


def tp_worker():
    """One rank of the tp table: the default model sharded over all ranks (tp = world)."""
    world = int(os.environ["WORLD_SIZE"])
    torch.set_num_threads(1)
    mesh = parallel.setup("auto", 300, tp=world)
    dev = mesh.device
    torch.manual_seed(0)
    model = tensor_parallel.tensor_parallel(Transformer(ModelConfig(**TP_MODEL)).to(dev), mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randint(0, MODEL["vocab_size"], (TP_ACCUM, TP_BATCH, MODEL["block_size"] + 1), device=dev,
                      generator=torch.Generator(dev).manual_seed(0))
    # count what enters an all-reduce, forward and backward, by wrapping the collective
    volume, phase, all_reduce = {"forward": 0, "backward": 0}, ["forward"], dist.all_reduce

    def counting(t, *args, **kwargs):
        volume[phase[0]] += t.numel() * t.element_size()
        return all_reduce(t, *args, **kwargs)
    times = []
    for i in range(WARMUP + ITERS):
        dist.barrier()
        if i == WARMUP:  # one iteration counted
            dist.all_reduce = counting  # parallel.py calls dist.all_reduce through the module
        t0 = time.perf_counter()
        for k in range(TP_ACCUM):
            phase[0] = "forward"
            _, loss = model(x[k, :, :-1], x[k, :, 1:])
            phase[0] = "backward"
            (loss / TP_ACCUM).backward()
        dist.all_reduce = all_reduce
        parallel.clip_grad_norm_(model.parameters(), 1.0, mesh)
        opt.step()
        opt.zero_grad(set_to_none=True)
        dist.barrier()
        times.append(time.perf_counter() - t0)
    saved = []

    def pack(t):
        saved.append(t.numel() * t.element_size())
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(x[0, :, :-1], x[0, :, 1:])
    row = {"ms": sorted(times[WARMUP:])[ITERS // 2] * 1000,
           "params_mb": sum(p.numel() * p.element_size() for p in model.parameters()) / 2 ** 20,
           "act_mb": sum(saved) / 2 ** 20,
           "fwd_mb": volume["forward"] / 2 ** 20, "bwd_mb": volume["backward"] / 2 ** 20}
    parallel.teardown(mesh)
    return row


TP_BATCH, TP_ACCUM = 8, 2
TP_MODEL = {**MODEL, "n_kv_head": MODEL["n_head"]}  # tp=4 needs 4 key/value heads: plain multi-head attention


def table_tp(worlds=(1, 2, 4)):
    B, T, C, L = TP_BATCH, TP_MODEL["block_size"], TP_MODEL["n_embd"], TP_MODEL["n_layer"]
    one = 4 * B * T * C  # bytes of one fp32 (B, T, n_embd) activation: what each f or g all-reduces
    # per micro-batch: forward 2 g per block + the embedding's g + the loss's (max, sum-exp,
    # target logit: 3 floats per token); backward 2 f per block + the head's f
    theory = {"fwd": TP_ACCUM * ((2 * L + 1) * one + 3 * 4 * B * T), "bwd": TP_ACCUM * (2 * L + 1) * one}
    print(f"\n## tensor parallel (gloo), tp = ranks, the default model with n_kv_head={TP_MODEL['n_kv_head']}, "
          f"global batch {B} x {TP_ACCUM} micro-batches "
          f"({B * TP_ACCUM * T} tokens/iter), one core per rank, median of {ITERS} iterations")
    print(f"{'tp':>3} | {'ms/iter':>8} | {'params MB':>9} | {'activations MB':>14} | {'all-reduce fwd MB':>17} | "
          f"{'bwd MB':>6} | {'theory fwd / bwd MB':>19}")
    print("-" * 96)
    for world in worlds:
        r = run_ranks(tp_worker, world)
        th = (f"{theory['fwd'] / 2 ** 20:7.2f} / {theory['bwd'] / 2 ** 20:6.2f}" if world > 1 else "0 / 0")
        print(f"{world:>3} | {r['ms']:8.1f} | {r['params_mb']:9.2f} | {r['act_mb']:14.1f} | {r['fwd_mb']:17.2f} | "
              f"{r['bwd_mb']:6.2f} | {th:>19}")
    print(f"theory: per block and direction 2 all-reduces of B x T x n_embd fp32 = 2 x {one / 2 ** 20:.2f} MB per "
          f"micro-batch, plus the embedding (forward) and the head (backward), plus 3 floats per token for the loss; "
          f"MB entering the all-reduce (a ring sends 2 (tp-1)/tp of it per rank). The clip's one float is left out.")


LONG_MODEL = dict(vocab_size=512, n_layer=2, n_head=4, n_kv_head=2, n_embd=128)  # blocks, not the head, dominate
LONG_BATCH = 2


def long_worker(layout, lengths):
    """One rank of the long table: for each sequence length T, the bytes that autograd saves for
    one micro-batch's backward on this rank (distinct storages, parameters and buffers left
    out: the activations), and the median ms of forward + backward."""
    world = int(os.environ["WORLD_SIZE"])
    torch.set_num_threads(1)
    workarounds.keep_freed_memory()  # as train.py on a CPU
    split = world if layout != "one process" else 1
    mesh = parallel.setup("auto", 300, tp=split if layout.startswith("tp") else 1,
                          cp=split if layout.startswith("cp") else 1)
    rows = {}
    for T in lengths:
        torch.manual_seed(0)
        model = Transformer(ModelConfig(**LONG_MODEL, block_size=T)).to(mesh.device)
        tensor_parallel.tensor_parallel(model, mesh, sp=layout == "tp=2 sp")
        context_parallel.context_parallel(model, mesh, ring=layout == "cp=2 ring")
        x = torch.randint(0, LONG_MODEL["vocab_size"], (LONG_BATCH, T + 1), device=mesh.device,
                          generator=torch.Generator(mesh.device).manual_seed(0))
        skip = {t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers()]}
        saved = {}

        def pack(t):
            if t.untyped_storage().data_ptr() not in skip:
                saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t
        times = []
        for i in range(3):
            dist.barrier()
            t0 = time.perf_counter()
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t) if i == 0 else nullcontext():
                _, loss = model(x[:, :-1], x[:, 1:])
            loss.backward()
            times.append(time.perf_counter() - t0)
        rows[T] = {"act_mb": sum(saved.values()) / 2 ** 20, "ms": sorted(times)[1] * 1000}
    rows = parallel.all_gather_object(rows, mesh)
    parallel.teardown(mesh)
    return {T: {k: max(r[T][k] for r in rows) for k in rows[0][T]} for T in lengths}  # the busiest rank


def table_long(lengths=(512, 1024, 2048)):
    B, C, L = LONG_BATCH, LONG_MODEL["n_embd"], LONG_MODEL["n_layer"]
    print(f"\n## long sequences (gloo): activation MB per rank (what autograd saves for backward, parameters left "
          f"out) and ms of one forward + backward, by sequence length T; {L} layers, width {C}, batch {B}, "
          f"vocab {LONG_MODEL['vocab_size']}, fp32, one core per rank")
    layouts = [("one process", 1), ("tp=2", 2), ("tp=2 sp", 2), ("cp=2 ring", 2), ("cp=2 all-gather", 2)]
    results = {name: run_ranks(long_worker, world, name, list(lengths)) for name, world in layouts}
    print(f"{'T':>6} | " + " | ".join(f"{name:>19}" for name, _ in layouts))
    print("-" * (9 + 22 * len(layouts)))
    for T in lengths:
        print(f"{T:>6} | " + " | ".join(f"{r[str(T)]['act_mb']:7.1f} MB {r[str(T)]['ms']:5.0f} ms"
                                       for r in results.values()))
    one = 4 * B * C / 2 ** 20  # MB of one fp32 (B, 1, n_embd) slice: per token of T
    print(f"communication per layer and micro-batch, forward (backward the same), for T tokens: tp: 2 all-reduces "
          f"of (B, T, C); tp + sp: 2 all-gathers + 2 reduce-scatters of (B, T, C) (the same bytes on a ring: an "
          f"all-reduce is a reduce-scatter then an all-gather); cp: (cp - 1) passes of this rank's K and V, "
          f"2 x (B, T/cp, n_kv_head x head_dim) each ({one * 2 * LONG_MODEL['n_kv_head'] / LONG_MODEL['n_head']:.4f} "
          f"MB per token of T here), backward twice that (K/V and their gradients).")


def layout_worker(layout):
    from pipeline import make_stage
    world = int(os.environ["WORLD_SIZE"])
    torch.set_num_threads(1)
    with open("/proc/self/statm") as f:
        base_mb = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2 ** 20
    mesh = parallel.setup("auto", 300, pp=world if layout == "pp" else 1)
    dev = mesh.device
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    torch.manual_seed(0)
    model = make_stage(Transformer(ModelConfig(**MODEL)), mesh.pp_rank, mesh.pp).to(dev)
    if layout == "fsdp":
        fsdp.fully_shard_model(model, mesh)
    wrapped = data_parallel.DataParallel(model, mesh, 4.0) if layout == "dp" and world > 1 else model
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    clip = list(model.parameters())
    if layout.startswith("zero"):  # "zero1", "zero2", "zero2+offload"
        wrapped = zero.ZeroDataParallel(model, mesh, 4.0, stage=int(layout[4]))
        opt = zero.ZeroOptimizer(wrapped, [{"params": list(model.parameters())}], offload="offload" in layout, lr=1e-4)
        clip = opt.params
    micro = MEM_ACCUM // mesh.dp
    x = torch.randint(0, MODEL["vocab_size"], (micro, MEM_BATCH, MODEL["block_size"] + 1), device=dev,
                      generator=torch.Generator(dev).manual_seed(mesh.dp_rank))
    times, mem = [], None
    for i in range(WARMUP + ITERS):
        dist.barrier()
        t0 = time.perf_counter()
        if layout == "pp":
            pipeline.pipeline_step("1f1b", wrapped, mesh, [(xk[:, :-1], xk[:, 1:], None, None) for xk in x],
                                   (MEM_BATCH, MODEL["block_size"], MODEL["n_embd"]))
        else:
            for k in range(micro):
                parallel.set_grad_sync(wrapped, k == micro - 1)
                (wrapped(x[k, :, :-1], x[k, :, 1:])[1] / micro).backward()
            if isinstance(wrapped, data_parallel.DataParallelBase):
                wrapped.wait()
        parallel.clip_grad_norm_(clip, 1.0, mesh, sharded=layout.startswith("zero"))
        opt.step()
        mem = parallel.memory_bytes(model, opt)
        opt.zero_grad(set_to_none=True)
        dist.barrier()
        times.append(time.perf_counter() - t0)
    peak = (torch.cuda.max_memory_allocated() / 2 ** 20 if dev.type == "cuda"
            else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024 - base_mb)
    row = {**{k: v / 2 ** 20 for k, v in mem.items()}, "peak_mb": peak, "ms": sorted(times[WARMUP:])[ITERS // 2] * 1000}
    rows = parallel.all_gather_object(row, mesh)
    parallel.teardown(mesh)
    return {k: max(r[k] for r in rows) for k in row}  # the busiest rank


MEM_BATCH, MEM_ACCUM = 8, 4


def table_memory(layouts=(("dp", 1), ("dp", 2), ("dp", 4), ("zero1", 2), ("zero1", 4), ("zero2", 2), ("zero2", 4),
                          ("zero2+offload", 2), ("fsdp", 2), ("fsdp", 4), ("pp", 2), ("pp", 4))):
    tokens = MEM_BATCH * MEM_ACCUM * MODEL["block_size"]
    print(f"\n## memory and speed per layout: the default model ({Transformer(ModelConfig(**MODEL)).num_params() / 1e6:.2f}M "
          f"parameters, fp32), global batch {MEM_BATCH} x {MEM_ACCUM} micro-batches ({tokens} tokens/iter), "
          f"one core per rank; the most loaded rank's numbers")
    print(f"{'layout':<13} {'ranks':>5} | {'params MB':>9} | {'grads MB':>8} | {'optim MB':>8} | {'p+g+o':>6} | "
          f"{'peak MB':>7} | {'ms/iter':>8} | {'tokens/s':>8}")
    print("-" * 97)
    for layout, world in layouts:
        r = run_ranks(layout_worker, world, layout)
        total = r["params"] + r["grads"] + r["optimizer"]
        print(f"{layout:<13} {world:>5} | {r['params']:9.2f} | {r['grads']:8.2f} | {r['optimizer']:8.2f} | {total:6.1f} | "
              f"{r['peak_mb']:7.0f} | {r['ms']:8.1f} | {tokens / r['ms'] * 1000:8,.0f}")
    print("zero1 at N ranks holds 1/N of the optimizer state, zero2 also 1/N of the gradients; fsdp 1/N of params, "
          "grads and optimizer state; pp holds the busiest stage's share (the last stage carries the head). "
          "offload keeps the optimizer state in CPU memory: on a CPU-only machine it is the zero2 row again. Peak is max RSS above the process size before the model on CPU "
          "(activations, buffers, allocator slack included), max_memory_allocated on GPU.")


def layout2d_worker(layout, optim_name):
    """One model per `layout` ('dp', 'zero1', 'zero2', 'fsdp', each with an optional 'tp2+'
    prefix) trained ITERS2 steps through train.py's own pieces (tensor_parallel, fsdp, zero,
    optim.build_optimizer); returns the busiest rank's bytes and the Newton-Schulz work."""
    import optim
    world = int(os.environ["WORLD_SIZE"])
    torch.set_num_threads(1)
    tp = 2 if layout.startswith("tp2+") else 1
    shard = layout.removeprefix("tp2+")
    mesh = parallel.setup("auto", 300, tp=tp)
    dev = mesh.device
    torch.manual_seed(0)
    model = Transformer(ModelConfig(**MODEL)).to(dev)
    tensor_parallel.tensor_parallel(model, mesh)
    if shard == "fsdp" and mesh.dp > 1:
        fsdp.fully_shard_model(model, mesh)
    use_zero = shard.startswith("zero") and mesh.dp > 1
    wrapped = model
    if use_zero:  # as train.py picks them: ZeRO's wrapper and optimizer, or plain data parallel
        wrapped = zero.ZeroDataParallel(model, mesh, 4.0, int(shard[4]))
    elif mesh.dp > 1 and shard != "fsdp":
        wrapped = data_parallel.wrap(model, mesh, "bucketed", 4.0)
    c = dict(optim=optim_name, weight_decay=0.1, embed_lr_scale=10.0, beta1=0.9, beta2=0.95, offload=False,
             learning_rate=1e-4, muon_momentum=0.95)
    opt, clip = optim.build_optimizer(model, wrapped, mesh, c, zero.ZeroOptimizer if use_zero else None)
    work = {"flops": 0.0, "ms": 0.0}
    ns = optim.newton_schulz

    def counted(g, **kw):  # 5 steps of X X^T (s x s from s x l), G G (s^3), (.) X (s x s times s x l), 2 FLOPs a MAC
        *k, m, n = g.shape  # one matrix, or a stack of k (newton_schulz_each)
        s, l = min(m, n), max(m, n)
        work["flops"] += math.prod(k) * 5 * 2 * (2 * s * s * l + s ** 3)
        return ns(g, **kw)
    optim.newton_schulz = counted
    inner = getattr(opt, "optimizer", opt)  # ZeroOptimizer's MuonWithAdamW
    if hasattr(inner, "orthogonalize"):
        plain = inner.orthogonalize

        def timed(params, gs):
            t0 = time.perf_counter()
            out = plain(params, gs)
            work["ms"] += (time.perf_counter() - t0) * 1000
            return out
        inner.orthogonalize = timed
    micro = MEM_ACCUM // mesh.dp
    x = torch.randint(0, MODEL["vocab_size"], (micro, MEM_BATCH, MODEL["block_size"] + 1), device=dev,
                      generator=torch.Generator(dev).manual_seed(mesh.dp_rank))
    for _ in range(ITERS2):
        for k in range(micro):
            parallel.set_grad_sync(wrapped, k == micro - 1)
            (wrapped(x[k, :, :-1], x[k, :, 1:])[1] / micro).backward()
        parallel.wait_grad_sync(wrapped)
        parallel.clip_grad_norm_(clip, 1.0, mesh, sharded=use_zero)
        opt.step()
        mem = parallel.memory_bytes(model, opt)
        opt.zero_grad(set_to_none=True)
    row = {**{k: v / 2 ** 20 for k, v in mem.items()}, "ns_gflop": work["flops"] / ITERS2 / 1e9,
           "ns_ms": work["ms"] / ITERS2}
    rows = parallel.all_gather_object(row, mesh)
    parallel.teardown(mesh)
    return {k: max(r[k] for r in rows) for k in row}


ITERS2 = 3


LAYOUTS_2D = (("tp=2", "tp2+dp", 2), ("fsdp=4", "fsdp", 4), ("tp=2 x fsdp=2", "tp2+fsdp", 4),
              ("tp=2 x zero=2", "tp2+zero2", 4), ("tp=2 x zero=1", "tp2+zero1", 4))
MUON_2D = (("dp=4", "dp", 4), ("zero=2", "zero2", 4), ("fsdp=4", "fsdp", 4), ("tp=2 (x dp=2)", "tp2+dp", 4),
           ("tp=2 x fsdp=2", "tp2+fsdp", 4))


def table_memory2d(layouts=LAYOUTS_2D, muon_layouts=MUON_2D):
    whole = run_ranks(layout2d_worker, 1, "dp", "adamw")
    total = whole["params"] + whole["grads"] + whole["optimizer"]
    n = Transformer(ModelConfig(**MODEL)).num_params()
    print(f"\n## 2D layouts: bytes per rank, the default model ({n / 1e6:.2f}M "
          f"parameters, fp32, AdamW), 4 ranks; the busiest rank")
    print(f"{'layout':<16} {'ranks':>5} | {'params MB':>9} | {'grads MB':>8} | {'optim MB':>8} | {'p+g+o':>6} | "
          f"{'of one process':>14}")
    print("-" * 82)
    for name, layout, world in (("one process", "dp", 1), *layouts):
        r = whole if world == 1 else run_ranks(layout2d_worker, world, layout, "adamw")
        sum_ = r["params"] + r["grads"] + r["optimizer"]
        print(f"{name:<16} {world:>5} | {r['params']:9.2f} | {r['grads']:8.2f} | {r['optimizer']:8.2f} | {sum_:6.2f} | "
              f"{sum_ / total:14.2f}")
    print("tp slices every matmul, the embedding and the head (norm gains are whole on every tp rank); fsdp and zero "
          "then shard each slice over the 2 dp ranks: about 1/(tp x dp) = 0.25 of params, grads and optimizer state "
          "(zero=2: grads and optimizer; zero=1: optimizer only).")
    print(f"\n## Muon per step: Newton-Schulz work per rank (the busiest) and the time in orthogonalize "
          f"(gathers, Newton-Schulz, sharing), 4 ranks unless noted")
    print(f"{'layout':<16} {'ranks':>5} | {'NS GFLOP/rank':>13} | {'share of all':>12} | {'orthogonalize ms':>16}")
    print("-" * 74)
    one = run_ranks(layout2d_worker, 1, "dp", "muon")
    for name, layout, world in (("one process", "dp", 1), *muon_layouts):
        r = one if world == 1 else run_ranks(layout2d_worker, world, layout, "muon")
        share = r["ns_gflop"] / one["ns_gflop"]
        print(f"{name:<16} {world:>5} | {r['ns_gflop']:13.3f} | {share:12.2f} | {r['ns_ms']:16.1f}")
    print("Each matrix is orthogonalized whole by one rank of its stage's dp x tp ranks, in rounds of largest "
          "first: a rank's share is about 1/world (more when the matrices do not divide evenly); the time "
          "includes assembling the matrices (zero: an all-reduce of pieces, fsdp: all-gathers, tp: all-gathers) "
          "and the all-gather of the results.")


def ckpt_worker(model_kw, saves):
    """One rank of the checkpoint table: `saves` plain saves, then `saves` async ones, of a model
    with AdamW state. Async: blocked = start_save (the copy to CPU) + finish_save, called once
    every rank has written (as the loop does); the time in between, when the loop would train,
    is the background write. Rank 0's times (it also writes the manifest and moves `latest`)."""
    mesh = parallel.setup("auto", 600)
    torch.manual_seed(0)
    model = Transformer(ModelConfig(**model_kw)).to(mesh.device)
    opt = AdamW(model.parameters(), lr=1e-4)  # optim.py's: it hands checkpoints its state by names
    x = torch.randint(0, model_kw["vocab_size"], (2, model_kw["block_size"] + 1), device=mesh.device)
    model(x[:, :-1], x[:, 1:])[1].backward()
    opt.step()  # AdamW state exists: a checkpoint holds weights, exp_avg and exp_avg_sq
    group = checkpoint.save_group(mesh)
    out = parallel.broadcast_object(tempfile.mkdtemp(prefix="bench_ckpt_") if mesh.master else None, mesh)
    row, it = {"params_m": sum(p.numel() for p in model.parameters()) / 1e6}, 0
    for mode in ("sync", "async"):
        blocked, background, copy = [], [], []
        for _ in range(saves):
            it += 1
            parallel.barrier(mesh)
            t0 = time.perf_counter()
            pending = checkpoint.start_save(out, it, model, opt, {"rng_cpu": []}, {"iter": it}, mesh,
                                            mode == "async", group)
            if mode == "async":
                t1 = time.perf_counter()
                while not checkpoint.written(pending):  # the loop trains meanwhile
                    time.sleep(0.005)
                background.append(time.perf_counter() - t1)
                parallel.barrier(mesh)  # every rank has written (the loop learns it in its all-reduce)
                t2 = time.perf_counter()
                checkpoint.finish_save(pending, 2)
                blocked.append(t1 - t0 + time.perf_counter() - t2)
                copy.append(t1 - t0)
            else:
                checkpoint.finish_save(pending, 2)
                blocked.append(time.perf_counter() - t0)
        row[mode] = sorted(blocked)[len(blocked) // 2] * 1000
        if background:
            row["background"] = sorted(background)[len(background) // 2] * 1000
            row["copy"] = sorted(copy)[len(copy) // 2] * 1000
    if mesh.master:
        final = os.path.join(out, "ckpt", f"iter_{it:07d}")
        row["ckpt_mb"] = sum(os.path.getsize(os.path.join(final, n)) for n in os.listdir(final)) / 2 ** 20
        import shutil
        shutil.rmtree(out, ignore_errors=True)
    parallel.teardown(mesh)
    return row


BIG = {**MODEL, "n_layer": 2 * MODEL["n_layer"], "n_embd": 4 * MODEL["n_embd"], "n_head": 2 * MODEL["n_head"],
       "n_kv_head": 2 * MODEL["n_kv_head"]}  # ~10x the default model's parameters


def table_checkpoint(worlds=(1, 2), saves=3, models=None):
    print(f"\n## checkpoint saves: ms the loop is blocked per save, plain vs async (ckpt_async=True), weights + AdamW "
          f"state, median of {saves} saves to local disk, dp ranks; async = copy to CPU memory + finish")
    print(f"{'model':<34} | {'params':>7} | {'ckpt MB':>7} | {'ranks':>5} | {'plain ms':>8} | {'async ms':>8} | "
          f"{'of which copy':>13} | {'background write ms':>19}")
    print("-" * 123)
    for kw in models or (MODEL, BIG):
        name = f"n_layer={kw['n_layer']} n_embd={kw['n_embd']} n_head={kw['n_head']}"
        for world in worlds:
            r = run_ranks(ckpt_worker, world, kw, saves)
            print(f"{name:<34} | {r['params_m']:6.1f}M | {r['ckpt_mb']:7.0f} | {world:>5} | {r['sync']:8.0f} | "
                  f"{r['async']:8.0f} | {r['copy']:13.0f} | {r['background']:19.0f}")
    print("plain: the whole write, the hashing and the manifest; async: the loop waits only for the copy of its "
          "state to CPU memory and for the finish (gathering the ranks' checksums, state.pt, meta.json, the manifest, "
          "the rename, `latest`); the write and the hashing run in a background thread while the loop trains "
          "(here it sleeps: with training the thread shares the cores)")


# ---- race: wall time to a val loss, nanoGPT's own train.py against the default job ------------
# Each recipe is a whole job (its own schedule ends at its max_iters) on the default corpus,
# launched as the README's quickstart launches the default (`python train.py`: one process with
# the machine's threads, as nanoGPT gets them), and the default job once more under torchrun with
# 2 processes. Both sides are SCORED ALIKE: one function (val_score) computes the mean
# cross-entropy over every 64-token block of the whole val split, in float32, for nanoGPT's final
# model (its own ckpt.pt through its own model.py) and for each of our checkpoints (one every
# RACE_CKPT iterations; their writing counts in our time). Each side's own estimate (a few val
# batches) moves the finish line by 0.03-0.1 on this 79k-token split, so it is printed apart.
RACE_CKPT = 25
RACE_TARGETS = (4.5, 4.25, 4.0)
RACE = {"default (python train.py)": (1, {}),  # name: (processes, the keys it sets); run after nanoGPT
        "default, dtype=float32 (no bf16 autocast)": (1, dict(dtype="float32")),
        "default, torchrun with 2 processes": (2, {})}


# nanoGPT's README "I only have a macbook" CPU recipe, on our default corpus (its vocabulary: 8,192);
# always_save_checkpoint: its ckpt.pt is the model it ends with (not the one its estimate liked best)
NANOGPT_CPU = ["config/train_shakespeare_char.py", "--device=cpu", "--compile=False", "--eval_iters=20",
               "--log_interval=1", "--block_size=64", "--batch_size=12", "--n_layer=4", "--n_head=4", "--n_embd=128",
               "--max_iters=2000", "--lr_decay_iters=2000", "--dropout=0.0", "--always_save_checkpoint=True"]


def timed_lines(cmd, patterns, **popen):
    """Runs cmd, timing its output from the launch: {name: [(seconds, *groups)]} for each line
    matching patterns[name], as the line is printed."""
    import re
    env = {**popen.pop("env", os.environ), "PYTHONUNBUFFERED": "1"}  # each line when it is printed, not in 8 KB blocks
    t0, rows = time.time(), {name: [] for name in patterns}
    with subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, **popen) as p:
        tail = []
        for line in p.stdout:
            tail = (tail + [line])[-20:]
            for name, pattern in patterns.items():
                m = re.search(pattern, line)
                if m:
                    rows[name].append((time.time() - t0, *m.groups()))
    if p.returncode or not all(rows.values()):
        raise SystemExit(f"{' '.join(cmd[:3])} ... failed ({p.returncode}) or printed no {patterns}:\n" + "".join(tail))
    return rows


@torch.no_grad()
def val_score(logits_of, tokens, block=64, batch=64):
    """The race's one evaluator: the mean cross-entropy (float32) of every target of every
    `block`-token block of `tokens` (x = tokens[i:i+block], y = the next token of each), for a
    model given as logits_of(x, y) -> (B, T, vocab). The same blocks and arithmetic for both sides."""
    n = (len(tokens) - 1) // block
    idx = torch.from_numpy(tokens[:n * block + 1].astype("int64"))
    x, y = idx[:-1].view(n, block), idx[1:].view(n, block)
    total = 0.0
    for i in range(0, n, batch):
        logits = logits_of(x[i:i + batch], y[i:i + batch]).float()
        total += torch.nn.functional.cross_entropy(logits.flatten(0, 1), y[i:i + batch].flatten(),
                                                   reduction="sum").item()
    return total / (n * block)


def nanogpt_model(src, ckpt_path):
    """nanoGPT's model from its own ckpt.pt, built by its own model.py (imported under another
    name: ours is `model` too). The checkpoint is read with weights_only=True (plain types and tensors)."""
    import importlib.util
    spec = importlib.util.spec_from_file_location("nanogpt_model", os.path.join(src, "model.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    ckpt = torch.load(ckpt_path, map_location="cpu", weights_only=True)
    model = mod.GPT(mod.GPTConfig(**ckpt["model_args"]))
    model.load_state_dict({k.removeprefix("_orig_mod."): v for k, v in ckpt["model"].items()})
    return model.eval(), ckpt["iter_num"]


def nanogpt_race(data_dir):
    """nanoGPT's own train.py with its README's CPU recipe on the prepared `data_dir`, timed from
    launch, its final model scored by val_score: (seconds to its last evaluation's line, iterations,
    the score, its own last estimate), or None when its files are not in ./nanogpt. It gets the
    machine's threads (torch's default), as it would."""
    import pickle
    src = nanogpt_dir("train.py", "model.py", "configurator.py", NANOGPT_CPU[0])
    if src is None:
        return None
    if not os.path.isfile(os.path.join(data_dir, "meta.json")):
        prepare.prepare("stdlib", data_dir, TRAIN["tokenizer"], TRAIN["vocab_size"], TRAIN["val_fraction"])
    meta = data.load_meta(data_dir)
    if meta["dtype"] != "uint16":
        raise SystemExit(f"nanoGPT reads uint16 tokens; {data_dir} holds {meta['dtype']}")
    work = tempfile.mkdtemp(prefix="nanogpt_race_")  # its cwd: nanoGPT reads configurator.py and data/ from there
    for f in ("train.py", "model.py", "configurator.py", "config"):
        os.symlink(os.path.join(os.path.abspath(src), f), os.path.join(work, f))
    os.makedirs(os.path.join(work, "data", "race"))
    for split in ("train", "val"):
        os.symlink(os.path.abspath(os.path.join(data_dir, f"{split}.bin")), os.path.join(work, "data", "race",
                                                                                          f"{split}.bin"))
    with open(os.path.join(work, "data", "race", "meta.pkl"), "wb") as f:  # the one thing nanoGPT reads besides the
        pickle.dump({"vocab_size": meta["vocab_size"]}, f)                  # tokens (written here, read by it)
    evals = timed_lines([sys.executable, "train.py", *NANOGPT_CPU, "--dataset=race", "--out_dir=out"],
                        {"eval": r"step (\d+): train loss [\d.]+, val loss ([\d.]+)"}, cwd=work,
                        env=default_threads_env())["eval"]
    model, iters = nanogpt_model(src, os.path.join(work, "out", "ckpt.pt"))
    score = val_score(lambda x, y: model(x, y)[0], val_tokens(data_dir))  # with targets, nanoGPT returns every position's logits
    shutil.rmtree(work)
    return evals[-1][0], iters, score, float(evals[-1][2])


def val_tokens(data_dir, cache={}):
    """The whole val split of a prepared dataset, as numpy tokens (read once)."""
    import numpy as np
    if data_dir not in cache:
        cache[data_dir] = np.fromfile(os.path.join(data_dir, "val.bin"), dtype=data.load_meta(data_dir)["dtype"])
    return cache[data_dir]


def our_race(out, procs, keys):
    """The default job (with `keys`) as the quickstart launches it, plus a checkpoint every
    RACE_CKPT iterations (all kept), each scored by val_score: [(seconds to its saved line, iter,
    score)], and the job's own evaluations [(seconds, iter, val loss)]."""
    launch = ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={procs}"] if procs > 1 else []
    threads = {"OMP_NUM_THREADS": "1"} if procs > 1 else {}  # one process: torch's default, as nanoGPT's
    args = [f"{k}={v}" for k, v in {"ckpt_interval": RACE_CKPT, "keep_ckpts": 0, **keys}.items()]
    lines = timed_lines([sys.executable, *launch, TRAIN_PY, f"out_dir={out}", "init_from=scratch", "sample_tokens=0",
                         *args, *RUN_KEYS],
                        {"ckpt": r"saved checkpoint (\S+)", "eval": r"iter (\d+): val loss ([\d.]+)"},
                        env=default_threads_env(**threads))
    scored = []
    for seconds, path in lines["ckpt"]:
        model, meta = checkpoint.load_whole(path.rstrip(":"))
        model.eval()
        scored.append((seconds, meta["iter"], val_score(lambda x, y: model(x)[0], val_tokens(meta["dataset"]),
                                                        block=min(64, model.cfg.block_size))))  # (--smoke: 16)
    return scored, [(s, int(i), float(v)) for s, i, v in lines["eval"]]


def crossing(scored, target):
    """(seconds, iteration) where the scores first reach `target`, linear between the two
    checkpoints around the crossing; None if they never do."""
    prev = None
    for t, it, s in scored:
        if s <= target:
            if prev is None:
                return t, it
            f = (prev[2] - target) / (prev[2] - s)
            return prev[0] + f * (t - prev[0]), prev[1] + f * (it - prev[1])
        prev = (t, it, s)
    return None


def table_race(recipes=None, extra=None):
    """nanoGPT's own train.py (README CPU recipe, when ./nanogpt holds it), then each recipe
    in this trainer, one after the other on the same corpus, all scored by val_score; the finish
    line: nanoGPT's final model's score."""
    recipes = {k: RACE[k] for k in recipes} if recipes else RACE
    root, data_dir = tempfile.mkdtemp(prefix="race_"), os.path.join("data", "stdlib")
    atexit.register(shutil.rmtree, root, ignore_errors=True)  # the recipes' out_dirs, also when a run fails
    load, loads = os.getloadavg()[0], {}  # the 1-minute load average before and after each side
    nano = None if SMOKE else nanogpt_race(data_dir)  # (--smoke: minutes of nanoGPT, and data/ written where it runs)
    loads["nanoGPT"] = (load, os.getloadavg()[0])
    targets = RACE_TARGETS + ((nano[2],) if nano else ())
    print(f"\n## race, scored alike: every side's model scored by one evaluator (mean cross-entropy over every "
          f"64-token block of the whole val split, float32); time from launch; ours: a "
          f"checkpoint every {RACE_CKPT} iterations (writes included), the crossing interpolated between two")
    if nano:
        print(f"nanoGPT's own train.py, README CPU recipe (1 process, its default threads): {nano[1]} iterations, "
              f"final model scores {nano[2]:.4f} (its own estimate said {nano[3]:.4f}) at {nano[0]:.0f} s: the "
              f"finish line; load average {loads['nanoGPT'][0]:.2f} before, {loads['nanoGPT'][1]:.2f} after")
    else:
        print("(nanoGPT's train.py is not in ./nanogpt or $NANOGPT_DIR: no nanoGPT row, no finish line)")
    print("| recipe | tokens/iter | iters | " + " | ".join(f"to {t:.4g}" for t in targets)
          + " | final score | total | load before/after |")
    print("|---|---|---|" + "---|" * len(targets) + "---|---|---|")
    results = {}
    for name, (procs, keys) in recipes.items():
        out = os.path.join(root, str(len(os.listdir(root))))
        keys = {**keys, **(extra or {})}
        load = os.getloadavg()[0]
        scored, evals = our_race(out, procs, keys)
        loads[name] = (load, os.getloadavg()[0])
        cfg = {**TRAIN, **keys}
        tpi = cfg["batch_size"] * cfg["grad_accum_steps"] * cfg["block_size"]
        hits = [crossing(scored, t) for t in targets]
        results[name] = (hits[-1], evals)
        print(f"| {name} | {tpi} | {cfg['max_iters']} | " + " | ".join(
            f"{h[0]:.0f} s (iter {h[1]:.0f})" if h else "-" for h in hits)
            + f" | {scored[-1][2]:.4f} | {scored[-1][0]:.0f} s | {loads[name][0]:.2f} / {loads[name][1]:.2f} |",
            flush=True)
        shutil.rmtree(out)
    if nano:
        print(f"to nanoGPT's final score {nano[2]:.4f}: nanoGPT {nano[0]:.0f} s; " + "; ".join(
            f"{name} {h[0]:.0f} s, {nano[0] / h[0]:.2f}x faster" if h else f"{name} never"
            for name, (h, _) in results.items()) + " (goal: 4x)")
        print(f"\nnot comparable, for reference only: each side's OWN estimate (nanoGPT: 20 random val batches; ours: "
              f"eval_iters fixed batches), time to the first estimate at or below nanoGPT's last estimate "
              f"{nano[3]:.4f}: " + "; ".join(
                  f"{name} " + next((f"{s:.0f} s (iter {i})" for s, i, v in evals if v <= nano[3]), "never")
                  for name, (_, evals) in results.items()))
    shutil.rmtree(root, ignore_errors=True)  # the recipes' out_dirs


def head_row(vocab, chunk, rows, width):
    """Head + loss forward and backward on `rows` rows of `width`: median ms, and the peak memory
    above the inputs' in MB."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    g = torch.Generator().manual_seed(0)
    h = torch.randn(1, rows, width, generator=g).to(device).requires_grad_()
    head = torch.nn.Linear(width, vocab, bias=False).to(device)
    y = torch.randint(0, vocab, (1, rows), generator=g).to(device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    h.grad, head.weight.grad = torch.zeros_like(h), torch.zeros_like(head.weight)  # the gradients exist in both
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")
    torch.backends.cuda.matmul.allow_tf32 = True  # as train.py on CUDA

    def step():
        with autocast:  # as train.py: bf16 matmuls on CUDA (the backward restores it), float32 on CPU
            losses = cross_entropy_losses(h, head, y, chunk)
        losses.mean().backward()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        step()
        peak = (torch.cuda.max_memory_allocated() - before) / 2 ** 20
    else:  # the first step in this fresh process (later ones may reuse memory the heap kept): its peak RSS
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM, the peak RSS, to the current RSS (Linux)
        before = vm_kb("VmRSS")
        step()
        peak = (vm_kb("VmHWM") - before) / 1024
    times = []
    for _ in range(WARMUP + ITERS):
        t0 = time.perf_counter()
        step()
        sync()
        times.append(time.perf_counter() - t0)
    return {"ms": sorted(times[WARMUP:])[ITERS // 2] * 1000, "peak_mb": peak}


def vm_kb(field):
    """This process's VmRSS or VmHWM (peak RSS) from /proc/self/status, in KiB."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))


def table_head(vocabs=(8192, 32768, 131072), chunk=128, rows=None, width=None):
    rows, width = rows or TRAIN["batch_size"] * TRAIN["block_size"], width or TRAIN["n_embd"]
    print(f"\n## head + loss: {rows} rows (batch x block) of width {width}, forward and backward, median of "
          f"{ITERS}; all logits at once vs chunks of {chunk} rows (model.ChunkedCrossEntropy)")
    print(f"{'vocab':>7} | {'logits':>9} | {'whole ms':>8} | {'chunked ms':>10} | {'whole peak':>10} | "
          f"{'chunked peak':>12}")
    print("-" * 72)
    for v in vocabs:
        whole, chunked = (in_subprocess("head", vocab=v, chunk=c, rows=rows, width=width) for c in (0, chunk))
        print(f"{v:7,} | {rows * v * 4 / 2 ** 20:6.0f} MB | {whole['ms']:8.1f} | {chunked['ms']:10.1f} | "
              f"{whole['peak_mb']:7.0f} MB | {chunked['peak_mb']:9.0f} MB", flush=True)


def table_mfu(iters=80, skip=20, rounds=2, modes=(False, True)):
    """The default job's own numbers: `python train.py` in one process (the machine's threads),
    logging every iteration; the median over iterations skip.. of metrics.jsonl's dt_ms, eager
    and with compile=True, alternated for `rounds` (a neighbour's load comes and goes), and MFU
    against the best matmul rate that the runs measured (each train.py measures its own)."""
    import re
    print(f"\n## mfu: the default job's step as train.py times it (python train.py, one process, "
          f"{os.cpu_count()} CPU threads; dtype=auto: bf16 autocast on CUDA and AVX512-BF16 CPUs, else float32), the "
          f"median of iterations "
          f"{skip}-{iters - 1}; eager and compiled runs alternated, {rounds} of each")
    rows = []
    for _ in range(rounds):
        for compile_ in modes:
            out = os.path.join(tempfile.mkdtemp(prefix="mfu_"), "out")
            t0 = time.time()
            p = subprocess.run([sys.executable, TRAIN_PY, f"out_dir={out}", f"max_iters={iters}", "log_interval=1",
                                "eval_iters=1", "sample_tokens=0", "init_from=scratch", f"compile={compile_}", *RUN_KEYS],
                               env=default_threads_env(), capture_output=True, text=True)
            if p.returncode == 0:
                with open(os.path.join(out, "metrics.jsonl")) as f:
                    logs = [r for r in map(json.loads, f) if "dt_ms" in r and r["iter"] >= skip]
            shutil.rmtree(os.path.dirname(out))
            if p.returncode:
                raise SystemExit(f"train.py compile={compile_} failed ({p.returncode}):\n{p.stderr[-2000:]}")
            mid = sorted(logs, key=lambda r: r["dt_ms"])[len(logs) // 2]
            peak = float(re.search(r"peak ([\d.]+) GFLOP/s", p.stdout)[1]) * 1e9
            rows.append((compile_, mid["dt_ms"], mid["tok_per_s"], mid["mfu"] * peak / mid["tok_per_s"], peak,
                         time.time() - t0))
    peak = max(r[4] for r in rows)  # the machine's matmul rate: the best any run measured
    print(f"{'compile':>7} | {'ms/iter':>8} | {'tokens/s':>9} | {'MFU':>6} | {'its own peak':>12} | {'whole run':>9}")
    print("-" * 74)
    for compile_, ms, tok_s, flops_per_token, own_peak, wall in rows:
        print(f"{str(compile_):>7} | {ms:8.1f} | {tok_s:9,.0f} | {flops_per_token * tok_s / peak:6.1%} | "
              f"{own_peak / 1e9:7.1f} GF/s | {wall:7.1f} s")
    best = {c: max(r[3] * r[2] for r in rows if r[0] == c) / peak for c in modes}
    print(f"MFU against {peak / 1e9:.1f} GFLOP/s, the best matmul rate the runs measured (train.py's own line divides "
          f"by the rate its run measured); the fastest run: " + ", ".join(
              f"{'compiled' if c else 'eager'} {m:.1%}" for c, m in best.items()) + f" (goal: 45%)."
          f" FLOPs: 6 per parameter per token plus attention. whole run: launch to exit (imports, two "
          f"evaluations, a checkpoint, and compile=True's compiling, which a run pays once)")


def table_profile(steps=5):
    """Where one step of the default job goes, in float32 and under bf16 autocast (what dtype=auto
    picks on a CPU with AVX512-BF16; elsewhere bf16 is emulated, slowly), as train.py runs each
    (under CPU bf16 autocast attention stays float32: model.Attention)."""
    from torch.profiler import ProfilerActivity, profile

    import optim
    workarounds.keep_freed_memory()  # as train.py on the CPU (it stays so for any table after this one)
    mesh = parallel.setup("cpu")
    cfg = ModelConfig(**{k: TRAIN[k] for k in ("vocab_size", "block_size", "n_layer", "n_head", "n_kv_head", "n_embd")})
    accum, batch, V = TRAIN["grad_accum_steps"], TRAIN["batch_size"], cfg.vocab_size
    x = torch.randint(0, V, (accum, batch, cfg.block_size + 1), generator=torch.Generator().manual_seed(0))
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
        mfu = model.flops_per_token() * tokens / dt / measure_matmul_flops(torch.device("cpu"), dtype)
        with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
            for _ in range(steps):
                step()
        kinds = {}
        for e in prof.key_averages(group_by_input_shape=True):
            shapes = str(e.input_shapes)
            kind = ("head matmuls (vocab x width)" if e.key in ("aten::mm", "aten::addmm") and str(V) in shapes else
                    "other matmuls (blocks, Newton-Schulz)" if e.key in ("aten::mm", "aten::addmm", "aten::bmm",
                                                                        "aten::baddbmm") else
                    "log-softmax, its backward, nll's zero-fill" if "softmax" in e.key or (e.key == "aten::fill_" and
                                                                                           str(V) in shapes) else
                    "casts (autocast's copies)" if e.key in ("aten::copy_", "aten::_to_copy") else
                    "attention (SDPA)" if "scaled_dot_product" in e.key else "the rest (elementwise, norms, rope, ...)")
            kinds[kind] = kinds.get(kind, 0.0) + e.self_cpu_time_total
        total = sum(kinds.values())
        print(f"\n## profile: one step of the default job in one process ({tokens} tokens, {torch.get_num_threads()} "
              f"threads, {str(dtype).removeprefix('torch.')}): {dt * 1000:.0f} ms (median of {len(times)}), MFU "
              f"{mfu:.1%} of the measured {str(dtype).removeprefix('torch.')} matmul rate; self CPU time by kind")
        for kind, t in sorted(kinds.items(), key=lambda kv: -kv[1]):
            print(f"  {kind:<45} {t / total:6.1%}")
    gs = [p.detach() for g in opt.param_groups if g["muon"] for p in g["params"]]  # Muon's matrices

    def ns_ms(stacked, dtype=torch.float32):  # the median of 9
        times = []
        for _ in range(9):
            t0 = time.perf_counter()
            optim.newton_schulz_each(gs, dtype) if stacked else [optim.newton_schulz(g, dtype=dtype) for g in gs]
            times.append(time.perf_counter() - t0)
        return sorted(times)[4] * 1000
    threads, ms = torch.get_num_threads(), {}
    for n in sorted({threads, 1}):
        torch.set_num_threads(n)
        for stacked in (True, False):
            ms[n, stacked] = ns_ms(stacked)
    torch.set_num_threads(threads)
    print(f"Muon's Newton-Schulz on the {len(gs)} matrices, per step: " + "; ".join(
        f"{n} thread{'s' if n > 1 else ''}: {ms[n, True]:.1f} ms stacked by shape (optim.newton_schulz_each), "
        f"{ms[n, False]:.1f} ms one by one" for n in sorted({threads, 1}))
        + f"; in bfloat16, stacked, {threads} threads: {ns_ms(True, torch.bfloat16):.1f} ms "
        f"(float32 on a CPU: see optim.py)")


GPU_MODEL = dict(vocab_size=50304, block_size=1024, n_layer=12, n_head=12, n_kv_head=12, n_embd=768)
GPU_BATCH = 12
# dense bf16 peaks from the vendors' data sheets, the first name found in the device's wins
# (the PCIe and NVL H100s before the SXM one); another GPU: its measured matmul rate
BF16_PEAK = {"H100 PCIe": 756e12, "H100 NVL": 835e12, "H100": 989e12, "H200": 989e12, "A100": 312e12}


def gpu_peak():
    name = torch.cuda.get_device_name()
    return next((v for k, v in BF16_PEAK.items() if k in name), None) or measure_matmul_flops(
        torch.device("cuda"), torch.bfloat16, n=8192)


def gpu_worker(use_fsdp, steps=20):
    """One rank: our model at GPU_MODEL, bf16 autocast, compiled, fused AdamW (use_fsdp: under
    FSDP2 over this one rank): the median ms of `steps` steps after 10 warm-up (compiling) ones."""
    mesh = parallel.setup("cuda", 600)
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True  # as train.py
    torch.manual_seed(0)
    model = Transformer(ModelConfig(**GPU_MODEL)).to(mesh.device)
    if use_fsdp:
        fsdp.fully_shard_model(model, mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=not use_fsdp)
    compiled = torch.compile(model)
    x = torch.randint(0, GPU_MODEL["vocab_size"], (GPU_BATCH, GPU_MODEL["block_size"] + 1), device=mesh.device)
    times = []
    for _ in range(10 + steps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            _, loss = compiled(x[:, :-1], x[:, 1:])
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    dt = sorted(times[10:])[steps // 2]
    return {"ms": dt * 1000, "flops_per_token": model.flops_per_token(),
            "peak_mb": torch.cuda.max_memory_allocated() / 2 ** 20}


def nanogpt_dir(*files):
    """./nanogpt or $NANOGPT_DIR when it holds nanoGPT's `files` (git-ignored: fetched by hand), else None."""
    src = os.environ.get("NANOGPT_DIR", os.path.join(os.path.dirname(os.path.abspath(__file__)), "nanogpt"))
    return src if all(os.path.isfile(os.path.join(src, f)) for f in files) else None


def nanogpt_row():
    """nanoGPT's own bench.py (fixed random data, compiled) in its directory: (ms/iter, its MFU
    against the A100's 312 TFLOP/s), or None when its files are not there."""
    import re
    src = nanogpt_dir("bench.py", "model.py", "configurator.py")
    if src is None:
        return None
    out = subprocess.run([sys.executable, "bench.py", "--real_data=False", "--compile=True"], cwd=src,
                         capture_output=True, text=True, check=True).stdout
    m = re.search(r"time per iteration: ([\d.]+)ms, MFU: ([\d.]+)%", out)
    if m is None:
        raise SystemExit(f"nanoGPT's bench.py printed no 'time per iteration' line; its output ended:\n{out[-2000:]}")
    return float(m[1]), float(m[2]) / 100


def table_gpu():
    if not torch.cuda.is_available():
        print("\n## gpu: no CUDA device here; this table needs one (see the docstring)")
        return
    peak, tokens = gpu_peak(), GPU_BATCH * GPU_MODEL["block_size"]
    print(f"\n## gpu: {torch.cuda.get_device_name()}, dense bf16 peak {peak / 1e12:.0f} TFLOP/s; GPT-2-small shape "
          f"({', '.join(f'{k}={v}' for k, v in GPU_MODEL.items())}), batch {GPU_BATCH} ({tokens:,} tokens/iter), "
          f"bf16 autocast, torch.compile, median step")
    print(f"{'run':<32} | {'ms/iter':>8} | {'tokens/s':>10} | {'MFU':>6} | {'peak mem':>9}")
    print("-" * 78)
    ours = {}
    for name, use_fsdp in (("ours", False), ("ours, fsdp=True on 1 rank", True)):
        r = ours[name] = run_ranks(gpu_worker, 1, use_fsdp)
        print(f"{name:<32} | {r['ms']:8.1f} | {tokens / r['ms'] * 1000:10,.0f} | "
              f"{r['flops_per_token'] * tokens / (r['ms'] / 1000) / peak:6.1%} | {r['peak_mb']:6.0f} MB", flush=True)
    nano = nanogpt_row()
    if nano is None:
        print("nanoGPT: its files are not in ./nanogpt (or $NANOGPT_DIR): no side-by-side row")
    else:
        mfu = nano[1] * 312e12 / peak  # nanoGPT prints its MFU against an A100
        ours_mfu = ours["ours"]["flops_per_token"] * tokens / (ours["ours"]["ms"] / 1000) / peak
        print(f"{'nanoGPT bench.py (GPT-2 124M)':<32} | {nano[0]:8.1f} | {tokens / nano[0] * 1000:10,.0f} | "
              f"{mfu:6.1%} | {'':>9}")
        print(f"ours / nanoGPT MFU: {ours_mfu / mfu:.2f}x (goal: at least 1.1x)")
    table_checkpoint(worlds=(1,), saves=3, models=(GPU_MODEL,))
    table_head(vocabs=(32768, 131072), chunk=1024, rows=tokens, width=GPU_MODEL["n_embd"])


BUILD_MODEL = {**MODEL, "n_layer": 16, "n_embd": 256}  # deeper and wider: the layers outweigh embedding and head


def build_worker(layout, hf_dir):
    """One rank of the build table: peak bytes of tensors this rank allocates while it builds
    the model with fresh weights and while it imports the Hugging Face copy, the meta way
    (train.py) and the old way (whole model first, then cut and shard)."""
    from contextlib import nullcontext

    import hf
    from pipeline import make_stage
    world = int(os.environ["WORLD_SIZE"])
    torch.set_num_threads(1)
    mesh = parallel.setup("cpu", 300, pp=world if layout == "pp" else 1)
    row = {}
    for meta in (True, False):
        for source in ("init", "import"):
            with build.TensorMemory() as mem:
                torch.manual_seed(0)
                with torch.device("meta") if meta else nullcontext():
                    model = Transformer(ModelConfig(**BUILD_MODEL))
                if source == "import" and not meta:
                    model.load_state_dict(hf.load_hf_llama(hf_dir)[1])
                model = make_stage(model, mesh.pp_rank, mesh.pp)
                if layout == "fsdp" and world > 1:
                    fsdp.fully_shard_model(model, mesh)
                if meta:
                    build.materialize(model, "cpu")
                    model.init_rope()
                    if source == "import":
                        hf.load_hf_parts(hf.hf_llama_index(hf_dir)[1], build.local_parts(model))
                    else:
                        build.init_weights(model, 0)
            row[f"{'meta' if meta else 'whole'}_{source}"] = mem.peak / 2 ** 20
            del model
    rows = parallel.all_gather_object(row, mesh)
    parallel.teardown(mesh)
    return {k: max(r[k] for r in rows) for k in row}  # the busiest rank


def table_build(layouts=(("-", 1), ("fsdp", 2), ("fsdp", 4), ("pp", 2), ("pp", 4))):
    cfg = ModelConfig(**BUILD_MODEL)
    torch.manual_seed(0)
    model = Transformer(cfg)
    whole = sum(p.numel() * p.element_size() for p in model.parameters()) / 2 ** 20
    largest = max(p.numel() * p.element_size() for p in model.parameters()) / 2 ** 20
    print(f"\n## building and importing the model, per rank: n_layer={cfg.n_layer}, n_embd={cfg.n_embd}, "
          f"vocab {cfg.vocab_size} ({model.num_params() / 1e6:.2f}M parameters, fp32: {whole:.1f} MB whole, "
          f"largest single parameter {largest:.1f} MB); peak MB of tensors a rank allocates (counted by "
          f"build.TensorMemory), the busiest rank")
    print(f"{'layout':<6} {'ranks':>5} | {'whole/N':>7} | {'build':>6} | {'import':>6} | {'old build':>9} | "
          f"{'old import':>10}")
    print("-" * 62)
    import hf
    with tempfile.TemporaryDirectory() as tmp:
        hf_dir = os.path.join(tmp, "hf")
        hf.save_hf_llama(hf_dir, model.state_dict(), cfg)
        del model
        for layout, world in layouts:
            r = run_ranks(build_worker, world, layout, hf_dir)
            print(f"{layout:<6} {world:>5} | {whole / world:7.1f} | {r['meta_init']:6.1f} | {r['meta_import']:6.1f} | "
                  f"{r['whole_init']:9.1f} | {r['whole_import']:10.1f}")
    print("build/import: the meta-device build (train.py): the stage is cut and the shards made on the meta "
          "device, then each rank allocates and reads only its part. old: the whole model first (and the whole "
          "file read), then cut and sharded. pp's busiest rank is the stage with the embedding or the head.")


def table_sample(batches=(1, 8), repeats=3):
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(0)
    model = Transformer(ModelConfig(**MODEL)).to(device).eval()
    block = MODEL["block_size"]
    print(f"\n## sampling (model.generate, temperature 0.8, top_k 50) from a 1-token prompt, the default model "
          f"(block_size={block}), with and without the KV cache, best of {repeats}")
    print(f"{'batch':>5} | {'new tokens':>10} | {'no cache tok/s':>14} | {'KV cache tok/s':>14} | {'speedup':>7}")
    print("-" * 64)
    for batch in batches:
        for new in (block - 1, 2 * block):
            rates = {}
            for kv_cache in (False, True):
                times = []
                for _ in range(repeats):
                    idx = torch.zeros(batch, 1, dtype=torch.long, device=device)
                    t0 = time.perf_counter()
                    model.generate(idx, new, 0.8, 50, kv_cache=kv_cache).tolist()  # .tolist(): wait for the GPU
                    times.append(time.perf_counter() - t0)
                rates[kv_cache] = batch * new / min(times)
            print(f"{batch:5} | {new:10} | {rates[False]:14,.0f} | {rates[True]:14,.0f} | "
                  f"{rates[True] / rates[False]:6.2f}x")
    print(f"past block_size every step re-runs the last {block} tokens (their positions shift), with or without "
          f"the cache: the second row of each batch mixes {block - 1} cached steps with {block + 1} full ones")


def table_tokenize(max_mb=30, repeats=3):
    import hf
    import prepare
    import tokenizer
    enc = data.get_tokenizer("cl100k_base", 8192)
    tmp = tempfile.mkdtemp()
    tj, config = hf.hf_tokenizer(enc, 256)
    for name, obj in (("tokenizer.json", tj), ("tokenizer_config.json", config)):
        with open(os.path.join(tmp, name), "w", encoding="utf-8") as f:
            json.dump(obj, f, ensure_ascii=False)
    ours = tokenizer.load(os.path.join(tmp, "tokenizer.json"))
    texts, size = [], 0
    for path in prepare.stdlib_files()[1]:
        with open(path, encoding="utf-8", errors="replace") as f:
            texts.append(f.read())
        size += len(texts[-1].encode())
        if size > max_mb * 1e6:
            break
    threads = os.cpu_count() or 1
    print(f"\n## encoding {len(texts)} files ({size / 1e6:.1f} MB) of the default corpus with cl100k_base/8192, "
          f"data.encode_batch on {threads} threads, best of {repeats}")
    print(f"{'backend':52} | {'tokens/s':>12} | {'MB/s':>6}")
    print("-" * 78)
    slow = copy.copy(ours)
    slow.twin = None
    got = {}
    for label, e in (("tiktoken (cl100k_base/8192)", enc),
                     ("tokenizer.load of its tokenizer.json (tiktoken twin)", ours),
                     ("the same, `tokenizers` alone (no twin)", slow)):
        best = min(timed(lambda: got.__setitem__(label, data.encode_batch(e, texts, threads))) for _ in range(repeats))
        n = sum(map(len, got[label]))
        print(f"{label:52} | {n / best:12,.0f} | {size / 1e6 / best:6.2f}")
    assert ours.twin is not None and len(set(map(str, got.values()))) == 1, "the backends gave different ids"


def timed(fn):
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


READING_PROBE = r"""
import json, os, runpy, sys
root, args = sys.argv[1], sys.argv[2:]
seen, entry, snap = {}, [0], {}
def project(path):  # the repository's own top-level .py files, bench.py aside
    p = os.path.abspath(path)
    return os.path.dirname(p) == root and p.endswith(".py") and os.path.basename(p) != "bench.py"
def hook(frame, event, arg):
    co = frame.f_code
    if event == "call" and co.co_name == "step" and not snap and ("optim" in co.co_filename or project(co.co_filename)):
        snap.update(seen=dict(seen), entry=entry[0])
    if event == "call" and co.co_flags & 0x1 and project(co.co_filename) and co not in seen:
        lines = [ln for _, _, ln in co.co_lines() if ln]
        seen[co] = (os.path.basename(co.co_filename), co.co_name, co.co_firstlineno, max(lines + [co.co_firstlineno]))
def trace(frame, event, arg):
    if frame.f_code.co_filename == os.path.join(root, "train.py") and frame.f_code.co_name == "<module>":
        entry[0] = max(entry[0], frame.f_lineno)
        return trace
sys.argv = ["train.py"] + args
sys.path.insert(0, root)
sys.setprofile(hook)
sys.settrace(trace)
try:
    runpy.run_path(os.path.join(root, "train.py"), run_name="__main__")
except SystemExit:
    pass
finally:
    sys.setprofile(None)
    sys.settrace(None)
out = {"first": [snap.get("entry", 0), list(snap.get("seen", {}).values())], "run": [entry[0], list(seen.values())]}
print("READING " + json.dumps(out), file=sys.__stderr__, flush=True)
"""


def reading_count(entry, funcs):
    """(total lines, {file: [(name, first, last)]}): train.py lines 1..entry plus every function
    span outside it; a span nested in another counted span of the same file is not counted again."""
    kept = []
    for t in sorted(set(map(tuple, funcs)), key=lambda t: (t[0], t[2], -t[3])):
        if t[0] != "train.py" and not (kept and kept[-1][0] == t[0] and kept[-1][2] <= t[2] and t[3] <= kept[-1][3]):
            kept.append(t)
    per_file = {}
    for f, name, a, b in kept:
        per_file.setdefault(f, []).append((name, a, b))
    return entry + sum(b - a + 1 for f, _, a, b in kept), per_file


def table_reading(functions=False):
    out = os.path.join(tempfile.mkdtemp(), "out")
    args = ["max_iters=1", "sample_tokens=0", "eval_interval=1000", f"out_dir={out}", *RUN_KEYS]
    root = os.path.dirname(os.path.abspath(__file__))
    p = subprocess.run([sys.executable, "-c", READING_PROBE, root] + args, capture_output=True, text=True)
    shutil.rmtree(os.path.dirname(out), ignore_errors=True)
    line = [x for x in p.stderr.splitlines() if x.startswith("READING ")]
    assert line, p.stderr[-2000:]
    res = json.loads(line[0][len("READING "):])
    print("## reading cost of one plain iteration: python train.py " + " ".join(args[:3]))
    print(f"{'':28} | {'lines':>6} | {'files':>5} | split per file (lines / functions)")
    print("-" * 100)
    for label, key in (("to the first optimizer step", "first"), ("the whole 1-iteration run", "run")):
        entry, funcs = res[key]
        total, per_file = reading_count(entry, funcs)
        split = [f"train.py 1-{entry}"] + [f"{f} {sum(b - a + 1 for _, a, b in v)}/{len(v)}"
                                            for f, v in sorted(per_file.items())]
        print(f"{label:28} | {total:6} | {len(per_file) + 1:5} | " + ", ".join(split))
        if functions:
            for f, v in sorted(per_file.items()):
                print(f"    {f}: " + ", ".join(f"{n} {b - a + 1}" for n, a, b in v))


TABLES = {"single": table_single, "dp": table_dp, "pp": table_pp_both, "tp": table_tp, "long": table_long,
          "memory": table_memory,
          "memory2d": table_memory2d,
          "lora": table_lora, "sample": table_sample, "build": table_build, "checkpoint": table_checkpoint,
          "race": table_race, "reading": table_reading, "head": table_head,
          "gpu": table_gpu, "mfu": table_mfu, "profile": table_profile, "tokenize": table_tokenize}
ROWS = {"single": single_row, "lora": lora_row, "head": head_row}

# --smoke: each table at a tiny model and a row or two of each kind, so that a test runs them all in
# one launch (tests/test_bench.py): what breaks shows, the numbers mean nothing
SMOKE_KEYS = dict(vocab_size=512, n_layer=8, n_head=4, n_kv_head=2, n_embd=32, block_size=16, batch_size=2,
                  grad_accum_steps=2, eval_iters=1)
SMOKE_ARGS = {"dp": dict(bucket_sizes=(1.0,)), "pp": dict(stages=(4,), ms=(4,), deep_ms=()), "tp": dict(worlds=(2,)),
              "memory": dict(layouts=(("zero2+offload", 2), ("fsdp", 2), ("pp", 2))),
              "memory2d": dict(layouts=(("tp=2 x zero=2", "tp2+zero2", 4),),
                               muon_layouts=(("tp=2 x fsdp=2", "tp2+fsdp", 4),)),
              "sample": dict(batches=(1,), repeats=1), "build": dict(layouts=(("fsdp", 2), ("pp", 2))),
              "checkpoint": dict(worlds=(2,), saves=1, models=(MODEL,)), "head": dict(vocabs=(512,)),
              "race": dict(recipes=("default (python train.py)",), extra=dict(max_iters=2, eval_interval=1)),
              "profile": dict(steps=1), "long": dict(lengths=(64,)), "tokenize": dict(max_mb=0.2, repeats=1),
              "mfu": dict(iters=3, skip=1, rounds=1, modes=(False,))}
if SMOKE:
    os.environ["BENCH_SMOKE"] = "1"  # the ranks and rows it starts import this file again: tiny there too
    WARMUP, ITERS, ITERS2, BATCH, PP_BATCH, TP_BATCH, MEM_BATCH = 0, 1, 1, 2, 2, 2, 2
    TRAIN.update(SMOKE_KEYS)
    for shape in (MODEL, DEEP_MODEL, BIG, BUILD_MODEL, TP_MODEL):  # in place: default arguments hold them
        shape.update({k: SMOKE_KEYS[k] for k in ("vocab_size", "block_size", "n_layer", "n_embd")})
    RUN_KEYS = [f"{k}={v}" for k, v in SMOKE_KEYS.items()] + [a for a in sys.argv[1:] if "=" in a]

if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--row":
        print(json.dumps(ROWS[sys.argv[2]](**json.loads(sys.argv[3]))))
        sys.exit(0)
    if {"-h", "--help"} & set(sys.argv[1:]):
        sys.exit(print(__doc__.strip()))
    unknown = sorted({a for a in sys.argv[1:] if a.startswith("-") and "=" not in a} - {"--smoke", "--functions"})
    if unknown:  # a typo such as --smok must not start the full-size tables
        sys.exit(f"error: unknown option {unknown[0]}: the options are --smoke, --functions (reading) and --help")
    names = [a for a in sys.argv[1:] if not a.startswith("-") and "=" not in a] or list(TABLES)
    for name in names:
        if name not in TABLES:
            sys.exit(f"error: unknown table '{name}': choose from {', '.join(TABLES)}")
    if SMOKE and not any(a.startswith("dataset=") for a in sys.argv[1:]):  # a tiny dataset of its own, in /tmp:
        smoke_data = os.path.join(tempfile.mkdtemp(prefix="smoke_"), "docs")  # data/stdlib may hold another vocabulary
        atexit.register(shutil.rmtree, os.path.dirname(smoke_data), ignore_errors=True)  # (also when a table fails)
        prepare.prepare(os.path.join(os.path.dirname(os.path.abspath(__file__)), "docs", "*.md"), smoke_data,
                        "cl100k_base", SMOKE_KEYS["vocab_size"], val_fraction=0.2, verbose=False)
        RUN_KEYS.append(f"dataset={smoke_data}")
    print(f"torch {torch.__version__}, {os.cpu_count()} CPU cores"
          + (f", {torch.cuda.get_device_name()}" if torch.cuda.is_available() else ""))
    for name in names:
        TABLES[name](**(SMOKE_ARGS.get(name, {}) if SMOKE else {}),
                     **({"functions": True} if name == "reading" and "--functions" in sys.argv else {}))
