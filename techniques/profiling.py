"""
The profiler (`profile_iters='5:8'`): torch.profiler over iterations 5, 6 and 7 (a Python
range), one chrome trace per rank in out_dir/trace/, and the top operators by self time.

Applied from outside, like the parallelisms: attach() labels what the TRAINING SECTION does
(forward, backward, grad sync, clip grad norm, optimizer step: record_function ranges, so the
trace reads like the loop) by wrapping the calls it makes, and steps the profiler after each
optimizer step, torchtitan's way: wait until the iteration before the window, warm up on it,
record the window. Open a trace in ui.perfetto.dev or chrome://tracing. On CUDA,
profile_memory=True also records the allocator's history and dumps a memory snapshot beside
the traces (drag it into pytorch.org/memory_viz).
"""

import functools
import os

import torch
from torch.profiler import ProfilerActivity, record_function

import parallel


def _labelled(fn, name):
    @functools.wraps(fn)
    def run(*args, **kwargs):
        with record_function(name):
            return fn(*args, **kwargs)
    return run


def _label_forward(model):
    """A "forward" range around each forward of `model` (a forward hook pair: the model is
    not touched), "forward (eval)" in evaluation."""
    ranges = []

    @torch.compiler.disable  # (compile=True: the hooks run eagerly, around the compiled forward)
    def enter(module, args):
        ranges.append(record_function("forward" if module.training else "forward (eval)"))
        ranges[-1].__enter__()

    @torch.compiler.disable
    def leave(module, args, out):
        ranges.pop().__exit__(None, None, None)

    model.register_forward_pre_hook(enter)
    model.register_forward_hook(leave)


def attach(profile_iters, start_iter, out_dir, mesh, model, optimizer, memory=False):
    """Profiles iterations a..b-1 of profile_iters='a:b' of the loop that starts at start_iter
    (a resumed run past a: nothing to profile, one line says so)."""
    a, b = (int(n) for n in profile_iters.split(":"))
    if a < start_iter:
        mesh.print0(f"profiler: profile_iters={profile_iters} starts before "
                    f"iteration {start_iter}, where this run resumed: nothing profiled")
        return None
    cuda = mesh.device.type == "cuda"
    trace_dir = os.path.join(out_dir, "trace")
    os.makedirs(trace_dir, exist_ok=True)
    if memory and cuda:
        torch.cuda.memory._record_memory_history(max_entries=100_000)
    elif memory:
        mesh.print0("profiler: profile_memory=True records CUDA's allocator; on the CPU: no "
                    "snapshot")
    ready = functools.partial(_write, trace_dir, mesh, f"{a}-{b - 1}", memory and cuda)
    # wait until the iteration before the window, warm up on it, record the window
    schedule = torch.profiler.schedule(wait=max(a - start_iter - 1, 0),
                                       warmup=min(a - start_iter, 1),
                                       active=b - a, repeat=1)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    prof = torch.profiler.profile(activities=activities, record_shapes=True, schedule=schedule,
                                  on_trace_ready=ready)
    _label_forward(model)
    # Tensor.backward calls torch.autograd.backward: one wrapper labels both
    torch.autograd.backward = _labelled(torch.autograd.backward, "backward")
    parallel.wait_grad_sync = _labelled(parallel.wait_grad_sync, "grad sync")
    parallel.clip_grad_norm_ = _labelled(parallel.clip_grad_norm_, "clip grad norm")
    step = optimizer.step

    def stepped(*args, **kwargs):  # each optimizer step ends an iteration: the profiler's step
        with record_function("optimizer step"):
            out = step(*args, **kwargs)
        prof.step()
        return out

    optimizer.step = stepped
    prof.start()
    return prof


def _write(trace_dir, mesh, iters, memory, prof):
    """The window is over: this rank's trace (and memory snapshot), the top operators (rank 0)."""
    path = os.path.join(trace_dir, f"rank{mesh.rank}.json")
    prof.export_chrome_trace(path)
    if memory:
        torch.cuda.memory._dump_snapshot(os.path.join(trace_dir, f"memory_rank{mesh.rank}.pickle"))
        torch.cuda.memory._record_memory_history(enabled=None)
    sort = "self_cuda_time_total" if mesh.device.type == "cuda" else "self_cpu_time_total"
    top = prof.key_averages().table(sort_by=sort, row_limit=12)
    mesh.print0(f"profiler: iterations {iters} traced, one chrome trace per rank: {path} ... "
                f"(ui.perfetto.dev); top operators by self time on rank 0:\n{top}")
