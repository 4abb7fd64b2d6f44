"""
FSDP2 (ZeRO-3) with torch's fully_shard, applied to a built model (or pipeline stage) from
outside: each transformer block is one unit, then the root (embedding, final norm, head).
"""

import torch
from torch.distributed.fsdp import (
    CPUOffloadPolicy,
    FSDPModule,
    MixedPrecisionPolicy,
    OffloadPolicy,
    fully_shard,
)
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Shard

# Each dp rank keeps 1/dp of every parameter, of its gradient and of its optimizer state.
# A block's full weights exist only while it runs: all-gathered before its forward (and
# again before its backward, if resharded after forward), and its gradients are
# reduce-scattered back to shards after its backward. Wrapping each block separately is
# what bounds the memory: only one block is whole at a time, and the next block's
# all-gather overlaps the current block's compute.


def fully_shard_model(model, mesh, reshard_after_forward=True, offload=False):
    """Shards `model` (a whole model or a pipeline stage) over mesh.dp_mesh, in place: each
    transformer block, then the root (embedding, final norm, head). Parameters, gathered
    weights and gradient reduction stay in fp32 whatever dtype= says: with dtype=bfloat16
    autocast runs the matmuls in bf16, exactly as in one process (MixedPrecisionPolicy's
    param_dtype=bf16 would also cast every weight, the embedding output and so the whole
    residual stream to bf16: iteration 0 off by 5.1e-6 against dp's 5.3e-8. The price:
    all-gathers of fp32 weights, twice the bytes of bf16 ones). offload: the
    parameter shards (so the optimizer state and its step too) live in CPU memory and are
    copied to the GPU for each block's use (CPUOffloadPolicy); on a CPU device there is
    nothing to move and it is not set.
    fsdp x tp (2D): the model holds tensor-parallel slices, and FSDP shards each slice over
    the dp ranks along the tp cut (Shard(_split_dim)), so that a rank's part is one range of
    the full matrix (build.local_parts); the slices keep their tp marks."""
    mp = MixedPrecisionPolicy()  # fp32 throughout: bf16 is autocast's business (see above)
    kw = dict(mesh=mesh.dp_mesh, reshard_after_forward=reshard_after_forward, mp_policy=mp,
              offload_policy=CPUOffloadPolicy() if offload and mesh.device.type != "cpu"
              else OffloadPolicy())
    kw["shard_placement_fn"] = (lambda p: Shard(p._split_dim) if hasattr(p, "_split_dim")
                                else Shard(0))

    def shard():
        # expert parallel (expert_parallel.py): a rank's experts are its own, sharded over the
        # ranks that hold the same ones (their _ep group)
        for experts in [m for m in model.modules()
                        if any(hasattr(p, "_ep") for p in m.parameters(recurse=False))]:
            group = next(iter(experts.parameters()))._ep
            fully_shard(experts, **{**kw, "mesh": DeviceMesh.from_group(group, mesh.device.type)})
        for block in model.layers.values():
            fully_shard(block, **kw)
        fully_shard(model, **kw)
        # the reduce-scatters sum: the loss weights already make the mean (train.py's
        # token_weights), as torchtitan asks of FSDP2 with the same call; by SUM alone (gloo has
        # no PREMUL_SUM)
        for m in model.modules():
            if isinstance(m, FSDPModule):
                m.set_gradient_divide_factor(1.0)
                m.set_force_sum_reduction_for_comms(True)
    return keeping_marks(model, shard)


def keeping_marks(model, change):
    """Runs change(), which gives `model` new parameters (fully_shard's DTensors, to_empty's
    storage), and marks each new one as its predecessor was: a tensor-parallel slice (_split_dim,
    _split_group), and expert parallel's experts (_ep)."""
    marks = [(m, k,
              {a: getattr(p, a) for a in ("_split_dim", "_split_group", "_ep") if hasattr(p, a)})
             for m in model.modules() for k, p in m._parameters.items()
             if p is not None and hasattr(p, "_split_dim")]
    change()
    for m, k, attrs in marks:
        m._parameters[k].__dict__.update(attrs)
    return model


def reshard(model):
    """Frees gathered FSDP weights. With reshard_after_forward=False a forward leaves them
    gathered for its backward; after a forward without backward (evaluation) nothing else
    would free them, and the parameters would not be the optimizer's shards."""
    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.reshard()
