"""
Activation memory, spent by choice: what a block keeps for backward (`ac`), and where it waits
(`offload_activations`). A block's forward leaves behind the tensors its backward reads; at long
context they are most of a step's memory. Each policy trades some of them for a second forward:

  none        everything kept (the plain run)
  full        every block recomputed whole in backward: only its input kept (grad_ckpt=True)
  op          every block recomputed but for its matmuls' and attention's outputs, which are
              kept; the cheap ops between them (norms, RoPE, SiLU, products) run again
              (torchtitan's selective checkpointing by operator)
  layers:K    every K-th block (layers 0, K, 2K, ... by their index, on any layout) recomputed
              whole, the others kept: memory and time between none and full

offload_activations moves what is kept to CPU memory in forward, and back in backward (TRL's
and torchtune's activation offloading; on CUDA through pinned buffers and a side stream).
SavedBytes counts what a step keeps, the measure the memory plan (memory_plan.py) is held to.
Applied to a built model from outside, after tensor and context parallelism (whose forwards the
recompute repeats, collectives included) and whatever the layout; nothing here changes a
number: the same losses and gradients as the plain run, in float32 exactly.
"""

import contextlib
import functools
import weakref

import torch
from torch.utils._pytree import tree_leaves
from torch.utils.checkpoint import CheckpointPolicy, checkpoint
from torch.utils.checkpoint import create_selective_checkpoint_contexts

aten = torch.ops.aten
# what `op` keeps: the outputs that cost a matmul to make again (attention's with its
# log-sum-exp); everything else a block computes is cheap next to them and recomputed
SAVED_OPS = {aten.mm.default, aten.addmm.default, aten.bmm.default, aten.baddbmm.default,
             aten._scaled_dot_product_flash_attention_for_cpu.default,
             aten._scaled_dot_product_flash_attention.default,
             aten._scaled_dot_product_efficient_attention.default,
             aten._scaled_dot_product_cudnn_attention.default}


def policy(spec):
    """'none', 'full', 'op' or 'layers:K' -> (kind, K); guard_config checks the spelling."""
    kind, _, k = spec.partition(":")
    return kind, int(k or 1)


def apply(model, ac, offload=False):
    """Gives each block of `model` (whole, or a pipeline stage's) the policy `ac`, and with
    `offload` runs the model's forward under the offloading hooks. Returns what it did, a line
    for the log."""
    kind, k = policy(ac)
    done, hooks = [], Offload(model) if offload else None
    for name, block in model.layers.items():
        if kind == "none" or kind == "layers" and int(name) % k:
            continue
        context = OpPolicy(block, hooks).contexts if kind == "op" else None
        block.forward = functools.partial(recomputed, block.forward, context)
        # the attention's own recompute (model.attend, CPU bf16) is this block's now
        block.attention.recompute = False
        done.append(name)
    if offload:
        model.forward = functools.partial(offloaded, model.forward, hooks)
    return (f"activations: ac={ac}, layers {','.join(done) or 'none'} recomputed in backward"
            + ("; what backward reads waits in CPU memory" if offload else ""))


def recomputed(forward, context_fn, *args, **kwargs):
    """A block's forward under torch.utils.checkpoint: what backward reads is made again from the
    block's input (and, under `op`, the kept outputs). Evaluation and generation keep nothing."""
    if not torch.is_grad_enabled():
        return forward(*args, **kwargs)
    extra = {"context_fn": context_fn} if context_fn else {}
    return checkpoint(forward, *args, use_reentrant=False, **extra, **kwargs)


class OpPolicy:
    """`op`'s policy for one block: keep the matmuls' and attention's outputs, recompute the rest;
    but not the outputs of wo and w2, which only join the residual stream, where backward reads
    nothing of them (hooks on the two say when they run). With `offload` (an Offload), the kept
    outputs wait in CPU memory like the saved tensors."""

    def __init__(self, block, offload=None):
        self.residual, self.offload = False, offload
        for layer in (block.attention.wo, getattr(block.feed_forward, "w2", None)):
            # (a MoE's w2 is its experts' weight, no module: their outputs are weighted, and read)
            if isinstance(layer, torch.nn.Module):
                layer.register_forward_pre_hook(lambda *_: setattr(self, "residual", True))
                layer.register_forward_hook(lambda *_: setattr(self, "residual", False))

    def __call__(self, ctx, op, *args, **kwargs):
        # (with grad off: inside an autograd.Function's forward, cp's ring attention, whose
        # matmuls are its score blocks, T^2 / cp^2 each: recomputed, as the ring is)
        if op not in SAVED_OPS or self.residual or not torch.is_grad_enabled():
            return CheckpointPolicy.PREFER_RECOMPUTE
        # (what SAC keeps is no saved tensor: counted here, or by the Offload that moves it)
        if SavedBytes.active is not None and self.offload is None:
            SavedBytes.active.add_output(ctx.op_output)
        return CheckpointPolicy.MUST_SAVE

    def contexts(self):  # (a fresh pair for each forward: they hold its kept outputs)
        forward, recompute = create_selective_checkpoint_contexts(self)
        if self.offload is None:
            return forward, recompute
        return cache_moved(forward, self.offload, out=True), cache_moved(recompute, self.offload)


@contextlib.contextmanager
def cache_moved(mode, offload, out=False):
    """SAC's dispatch `mode`, its cache of kept outputs moved to CPU memory when the forward ends
    (`out`) or back before the recompute starts. The cache is SAC's own (mode.storage: op ->
    call -> the outputs, each in a wrapper holding it as .val and its version): no saved-tensor
    hook sees it, so it is moved here, through the same Offload."""
    if not out:
        move(mode.storage, offload.unpack)
    with mode:
        yield
    if out:
        move(mode.storage, offload.pack)


def move(storage, how):
    for kept in tree_leaves([list(calls.values()) for calls in storage.values()]):
        if getattr(kept, "version", None) is not None:  # (a tensor's: other outputs stay)
            kept.val = how(kept.val)
            kept.version = kept.val._version if torch.is_tensor(kept.val) else kept.version


def offloaded(forward, hooks, *args, **kwargs):
    with hooks:
        return forward(*args, **kwargs)


# ---- where the kept tensors wait, and what they weigh ----------------------------------------

class Keep(torch.autograd.graph.saved_tensors_hooks):
    """The saved-tensor hooks: pack is called for each tensor autograd keeps for backward (the
    weights aside, which stay where they are), unpack when backward reads it. This one keeps
    each where it is; Offload moves them. Weights and buffers (RoPE's tables) are never
    activations: they stay."""

    def __init__(self, model):
        # (through lambdas: SavedBytes counts what an Offload packs by wrapping its pack)
        super().__init__(lambda t: self.pack(t), lambda packed: self.unpack(packed))
        self.weights = {getattr(t, "_local_tensor", t).untyped_storage().data_ptr()  # (FSDP's)
                        for t in [*model.parameters(), *model.buffers()]}

    def is_weight(self, t):
        # (FSDP's gathered weights are Parameters made anew each forward, kept as views)
        return (isinstance(t, torch.nn.Parameter) or isinstance(t._base, torch.nn.Parameter)
                or t.untyped_storage().data_ptr() in self.weights)

    def pack(self, t):
        return t

    def unpack(self, t):
        return t


class Offload(Keep):
    """Each kept tensor's storage copied to CPU memory in forward and back in backward: once,
    however many views of it are kept (a block's normed input feeds wq, wk and wv). On CUDA the
    copies go to pinned memory on a side stream, so they overlap the forward that follows, and
    the device memory is reused once its copy is done. On a CPU the same hooks run, the copy a
    plain one: it is how they are tested."""

    def __init__(self, model):
        super().__init__(model)
        self.stream = torch.cuda.Stream() if torch.cuda.is_available() else None
        # storage address -> (a weakref to the storage: while it lives, the address is its),
        # (its bytes in CPU memory, the copy's event)
        self.copies, self.back = {}, {}

    def pack(self, t):
        if self.is_weight(t) or t.device.type == "cpu" and self.stream is not None:
            return t
        ptr = t.untyped_storage().data_ptr()
        seen = self.copies.get(ptr)
        if seen is None or seen[0]() is None:
            self.copies = {p: s for p, s in self.copies.items() if s[0]() is not None}
            seen = self.copies[ptr] = (weakref.ref(t.untyped_storage()), self.to_host(t))
        return (*seen[1], t.device, t.dtype, t.storage_offset(), t.shape, t.stride())

    def to_host(self, t):
        raw = torch.empty(0, dtype=torch.uint8, device=t.device).set_(t.untyped_storage())
        if self.stream is None:
            return raw.clone(), None
        self.stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.stream):
            host = torch.empty(raw.shape, dtype=torch.uint8, pin_memory=True)
            host.copy_(raw, non_blocking=True)
            raw.record_stream(self.stream)  # (its memory is reused once the copy is done)
            return host, self.stream.record_event()

    def unpack(self, packed):
        if torch.is_tensor(packed):
            return packed
        host, done, device, dtype, offset, shape, stride = packed
        raw = self.back.get(id(host))  # (views of one storage come back as one)
        raw = raw() if raw is not None else None
        if raw is None:
            if done is not None:
                done.synchronize()
            raw = host.to(device, non_blocking=True) if done is not None else host
            self.back = {i: r for i, r in self.back.items() if r() is not None}
            self.back[id(host)] = weakref.ref(raw)
        return torch.empty(0, dtype=dtype, device=device).set_(raw.untyped_storage(), offset,
                                                               shape, stride)


class SavedBytes(Keep):
    """Counts the bytes one step keeps for backward, on the device and offloaded: each kept
    tensor's storage once (views of one storage are one), the weights aside, and the outputs
    `op` keeps; and the most kept at once (peak), each storage's bytes counted out when it is
    freed. Use it around each forward (one object over a pipeline's micro-batches):

        with SavedBytes(model) as saved:
            loss = model(x, y)[1]
        saved.device, saved.offloaded, saved.peak  # bytes
    """
    active = None

    def __init__(self, model):
        super().__init__(model)
        self.seen, self.device, self.offloaded, self.live, self.peak = set(), 0, 0, 0, 0
        self.offload = next((f.args[1] for f in [getattr(model, "forward", None)]
                             if isinstance(f, functools.partial) and f.func is offloaded), None)

    def __enter__(self):
        SavedBytes.active = self
        if self.offload is not None:  # count what the model's Offload packs
            inner = self.offload.pack
            self.offload.pack = lambda t: self.count(t, inner(t))
        super().__enter__()
        return self

    def __exit__(self, *exc):
        SavedBytes.active = None
        if self.offload is not None:
            del self.offload.pack
        return super().__exit__(*exc)

    def pack(self, t):
        return self.count(t, t)

    def count(self, t, packed):
        if not self.is_weight(t):
            moved = not torch.is_tensor(packed)
            self.add(packed[0] if moved else t, moved)
        return packed

    def add(self, t, moved=False):
        storage = t.untyped_storage()
        if storage.data_ptr() not in self.seen:
            self.seen.add(storage.data_ptr())
            if moved:
                self.offloaded += storage.nbytes()
            else:
                self.device += storage.nbytes()
            self.live += storage.nbytes()
            self.peak = max(self.peak, self.live)
            # (freed once its backward has run: then its address may hold another)
            weakref.finalize(storage, self.freed, storage.data_ptr(), storage.nbytes())

    def freed(self, ptr, nbytes):
        self.seen.discard(ptr)
        self.live -= nbytes

    def add_output(self, out):
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if torch.is_tensor(t):
                self.add(t)
