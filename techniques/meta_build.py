"""
The meta-device build: train.py builds the model with shapes only, cuts its pipeline stage,
applies tensor parallel and FSDP there, and only then gives each rank storage for what it
holds (materialize) and fills it: fresh weights drawn per parameter name (the same bits a
single process draws), or its part of an imported file or a checkpoint, each rank reading only
its own part (local_parts says which part of which full tensor that is). No rank ever holds the
whole model.
"""

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from model import init_tensor
from techniques.fsdp import keeping_marks


def materialize(model, device):
    """Real (uninitialized) storage on `device` for the meta parameters and buffers of
    `model`, in place. FSDP2 re-points its shards at the new storage in its own to_empty.
    Otherwise we swap each Parameter by hand: nn.Module.to_empty would make new Parameters
    per module, which unties a tied head from the embedding and drops the attributes that
    tensor_parallel sets (_split_dim, _split_group)."""
    if any(isinstance(m, FSDPModule) for m in model.modules()):
        keeping_marks(model, lambda: model.to_empty(device=device))  # fsdp x tp (and x ep)
        for b in model.buffers():  # (as below: zero; a derived one is computed again, init_rope)
            b.zero_()
        return model
    new = {}  # meta Parameter -> its replacement (a tied weight is one Parameter under two names)
    for m in model.modules():
        for key, p in m._parameters.items():
            if p is not None and p.is_meta:
                if p not in new:
                    new[p] = nn.Parameter(torch.empty_like(p, device=device),
                                          requires_grad=p.requires_grad)
                    new[p].__dict__.update(p.__dict__)
                m._parameters[key] = new[p]
        for key, b in m._buffers.items():
            if b is not None and b.is_meta:
                # (a derived one is computed again: init_rope)
                m._buffers[key] = torch.zeros_like(b, device=device)
    return model


def local_parts(model):
    """(name, local, full_shape, dim, start, stop) for each parameter of `model` (a tied one
    once, under the embedding's name): `local` is the tensor this rank holds, the slice [start,
    stop) along `dim` of the full tensor of shape full_shape; dim None: the whole tensor. A
    tensor-parallel slice is one chunk along its _split_dim; an FSDP shard is a chunk along the
    dimension of its Shard (torch.chunk's split, as DTensor cuts): rows, or under fsdp x tp a
    chunk of the tp slice along the same _split_dim (fsdp.py shards it so), which is again one
    range of the full tensor."""
    for name, p in model.named_parameters():
        # a pipeline's last stage: its tied head
        if name == "output.weight" and model.cfg.tie_embeddings:
            # is the embedding (drawn, imported as it)
            name = "tok_embeddings.weight"
        n_tp, r_tp = ((dist.get_world_size(p._split_group), dist.get_rank(p._split_group))
                      if hasattr(p, "_split_dim") else (1, 0))
        if isinstance(p, DTensor):
            assert len(p.placements) == 1 and p.placements[0].is_shard(), (
                f"{name}: {p.placements}, not FSDP's Shard")
            dim = p.placements[0].dim
            assert n_tp == 1 or dim == p._split_dim, (
                f"{name}: FSDP's Shard({dim}) across the tp cut {p._split_dim}")
            local, n, r = p.to_local(), p.device_mesh.size(), p.device_mesh.get_local_rank()
            size = -(-p.shape[dim] // n)  # torch.chunk's chunk size
            lo = min(r * size, p.shape[dim])
            start, stop = (r_tp * p.shape[dim] + lo,
                           r_tp * p.shape[dim] + min(lo + size, p.shape[dim]))
        elif n_tp > 1:
            local, dim = p, p._split_dim
            start, stop = r_tp * p.shape[dim], (r_tp + 1) * p.shape[dim]
        else:
            yield name, p, tuple(p.shape), None, 0, 0
            continue
        full = tuple(p.shape[:dim]) + (p.shape[dim] * n_tp,) + tuple(p.shape[dim + 1:])
        assert local.shape[dim] == stop - start, (
            f"{name}: local {tuple(local.shape)} is not {start}:{stop} of {full}")
        yield name, local, full, dim, start, stop


@torch.no_grad()
def init_weights(model, seed):
    """Fresh weights for the parameters this rank holds (after materialize): each one drawn
    whole on the CPU from its own generator (model.init_tensor: seeded by the run's seed and
    its name), and this rank's slice kept. The same bits as `Transformer(cfg)` with that seed
    in one process, whatever the layout; the price is one transient of the largest single
    parameter (the embedding or a SwiGLU matrix), not of the model."""
    for name, local, shape, dim, start, stop in local_parts(model):
        full = init_tensor(name, shape, model.cfg.n_layer, seed)
        local.copy_(full if dim is None else full.narrow(dim, start, stop - start))


def fill(model, src, seed, mesh, device):
    """Storage on `device` for the part of the meta-built `model` this rank holds, then its
    weights from `src` (origin.Source): a Hugging Face directory's tensors (of a shard only its
    rows), another run's checkpoint (DCP reads only what this rank holds), or fresh weights:
    this rank's slices of what a single process draws. A run that resumes starts from the
    fresh ones until its checkpoint is loaded, with the optimizer state, once that exists."""
    materialize(model, device)
    model.init_rope(mesh.device)  # buffers derived from the config, not loaded
    with torch.no_grad():
        if src.kind == "hf":
            from formats import hf
            hf.load_hf_parts(src.hf_index, local_parts(model))
        elif src.kind == "run":
            import checkpoint
            checkpoint.load(src.path, model)
        else:
            init_weights(model, seed)
