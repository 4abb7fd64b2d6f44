"""Pipeline parallel with 2 and 4 stages (one process per stage) and m = 4 and 8 micro-batches, on
the default model and on a 16-layer one of the same width: our GPipe, 1F1B on the even and the
cost-balanced layer split, and interleaved 1F1B (2 chunks per stage, where the layers allow),
against torch.distributed.pipelining's Schedule1F1B and ScheduleInterleaved1F1B on the same
layers; the measured bubble against (p-1)/(m+p-1) (interleaved: (p-1)/(V*m+p-1)), the
micro-batches alive at once per stage, and the bytes autograd saves for one micro-batch
(saved_tensors_hooks)."""

import os
import time

import torch
import torch.distributed as dist

import parallel
import workarounds
from model import ModelConfig, Transformer
from techniques import pipeline

from bench.base import ITERS, MODEL, SMOKE, WARMUP, run_ranks, sized


def pp_worker(ms, model):
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    from techniques.pipeline import make_stage, pipeline_split
    mesh = parallel.setup("auto", 300, pp=int(os.environ["WORLD_SIZE"]))
    workarounds.keep_freed_memory()  # as train.py does on a CPU
    dev, T, V = mesh.device, model["block_size"], model["vocab_size"]
    n, pp = model["n_layer"], mesh.pp
    # the old split: layer counts only
    splits = {"even": [n // pp + (s < n % pp) for s in range(pp)],
              # the head and loss counted on the last stage
              "balanced": pipeline_split(ModelConfig(**model), pp)}

    def new_stage(split="balanced", virtual=1):
        torch.manual_seed(0)
        counts = (splits[split] if virtual == 1
                  else pipeline_split(ModelConfig(**model), pp * virtual))
        return make_stage(Transformer(ModelConfig(**model)), mesh.pp_rank, pp, counts,
                          virtual).to(dev)

    class Logits(torch.nn.Module):  # torch's stages return one tensor; ours return (output, loss)
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, inp):
            return self.inner(inp)[0]

    rows = []
    for m in ms:
        data = torch.randint(0, V, (m, PP_BATCH, T + 1), device=dev,
                             generator=torch.Generator(dev).manual_seed(0))
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
        loss_fn = lambda logits, tgt: torch.nn.functional.cross_entropy(  # noqa: E731
            logits.flatten(0, 1), tgt.flatten())
        # torch's peers on the same layers: Schedule1F1B on our balanced stage, and (where ours
        # runs interleaved) ScheduleInterleaved1F1B on one module per virtual
        # stage of the same split
        tstage = new_stage()
        peers = {"torch 1F1B": (
            Schedule1F1B(PipelineStage(Logits(tstage), mesh.pp_rank, pp, dev), m, loss_fn=loss_fn),
            list(tstage.parameters()))}
        kinds["torch 1F1B"] = ("torch 1F1B", "balanced", 1)
        if "interleaved" in kinds:
            from torch.distributed.pipelining import ScheduleInterleaved1F1B
            counts, chunks = pipeline_split(ModelConfig(**model), 2 * pp), []
            for v in range(2):
                torch.manual_seed(0)
                chunks.append(make_stage(Transformer(ModelConfig(**model)), v * pp + mesh.pp_rank,
                                         2 * pp, counts).to(dev))
            pipes = [PipelineStage(Logits(c), v * pp + mesh.pp_rank, 2 * pp, dev)
                     for v, c in enumerate(chunks)]
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
                    _, peaks[v] = pipeline.pipeline_step(kinds[v][0], ours[v], mesh, micro, act,
                                                         trace=trace, virtual=kinds[v][2])
                dist.barrier()
                if rnd >= WARMUP:
                    times[v].append(time.perf_counter() - t0)
                    if trace is not None:
                        traces = parallel.all_gather_object(trace, mesh)
                        bubbles[v].append(
                            pipeline.pipeline_timeline(traces, m, virtual=kinds[v][2])[1])
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
            pipeline.pipeline_step(kinds[v][0], ours[v], mesh, micro, act, trace=trace,
                                   virtual=kinds[v][2])
            traces = parallel.all_gather_object(trace, mesh)
            if mesh.master:
                rows[-1].setdefault("text", {})[v] = pipeline.pipeline_timeline(
                    traces, m, width=100, virtual=kinds[v][2])[0]
    parallel.teardown(mesh)
    return rows


PP_BATCH = 2 if SMOKE else 8


# pipelines are for deep models: 16 layers of the default width, where the 8192 x 128 head and its
# loss weigh about 8 layers (pipeline.stage_costs) instead of more than the other 4 together
DEEP_MODEL = sized({**MODEL, "n_layer": 16})


def table_pp(stages=(2, 4), ms=(4, 8), model=MODEL, title="the default model"):
    print(f"\n## pipeline parallel ({'nccl' if torch.cuda.is_available() else 'gloo'}), {title} "
          f"({model['n_layer']} layers), one process per stage, micro-batches of {PP_BATCH} x "
          f"{model['block_size']} tokens, median of {ITERS} interleaved rounds")
    rows = []
    for pp in stages:
        rows += run_ranks(pp_worker, pp, list(ms), model)
    print(f"{'pp':>2} {'m':>2} | {'schedule':<21} | {'layers':<9} | {'ms/iter':>8} | "
          f"{'vs torch':>8} | {'bubble':>7} | {'theory':>6} | {'peak alive per stage':<20}")
    print("-" * 105)
    for r in rows:
        pp, m = r["pp"], r["m"]
        torch_ms = r["ms"]["torch 1F1B"]
        for v, (name, split, virtual) in r["kinds"].items():
            layers = (",".join(map(str, r["splits"][split])) if virtual == 1
                      else f"{virtual} chunks")
            sched = name if virtual == 1 else f"{name} V={virtual}"
            bubble = f"{r['bubble'][v]:7.1%}" if v in r["bubble"] else f"{'':>7}"
            peak = (" ".join(str(st["peak"][v]) for st in r["stages"])
                    if v in r["stages"][0]["peak"] else "")
            print(f"{pp:>2} {m:>2} | {sched:<21} | {layers:<9} | {r['ms'][v]:8.1f} | "
                  f"{r['ms'][v] / torch_ms:7.2f}x | {bubble} | "
                  f"{(pp - 1) / (virtual * m + pp - 1):6.1%} | {peak:<20}")
    print("bubble: the mean idle share of the stages in the traced iterations (median); theory: "
          "the same share for balanced stages and free communication, (p-1)/(m+p-1), and "
          "(p-1)/(V*m+p-1) interleaved (Narayanan et al.'s (p-1)/(V*m) is that idle time relative "
          "to the bubble-free time). layers: counts per stage, even (the old split) or balanced "
          "by estimated cost (pipeline.pipeline_split). peak alive: micro-batches (interleaved: "
          "micro-batch chunks) whose activations are kept at once, per stage.")
    for r in rows:
        st = r["stages"][0]
        print(f"pp={r['pp']} m={r['m']}: stage 0 keeps {st['per_micro_mb']:.1f} MB of activations "
              "per micro-batch (balanced split)")
    for v, text in rows[0]["text"].items():
        name, split, virtual = rows[0]["kinds"][v]
        print(f"\n{name}, {split} split{f', V={virtual}' if virtual > 1 else ''}:\n{text}")


def table_pp_both(stages=(2, 4), ms=(4, 8), deep_ms=(8,)):
    table_pp(stages, ms)
    if deep_ms:
        table_pp(stages, deep_ms, DEEP_MODEL, "a deeper model")
