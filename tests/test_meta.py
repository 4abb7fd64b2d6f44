"""Meta-device build: initial weights that do not depend on the layout, and a rank that never
allocates (or reads from a Hugging Face file) more than its share of the model."""

from contextlib import nullcontext
from types import SimpleNamespace

import torch
from conftest import spawn
from test_fsdp import check_one_nth, one_step_memory
from torch.distributed.device_mesh import init_device_mesh

import parallel
from bench.build import TensorMemory
from model import ModelConfig, Transformer
from formats import hf
from techniques import fsdp
from techniques import meta_build
from techniques import tensor_parallel
from techniques.pipeline import make_stage

# layers dominate (16 of them, a 64-token vocabulary), so 1/4 of the model is well above the
# fixed overhead of one parameter drawn whole
CFG = dict(vocab_size=64, block_size=16, n_layer=16, n_head=4, n_kv_head=2, n_embd=64)


def build_model(cfg, meta=True, dp_mesh=None, stage=0, pp=1, tp=None, hf_dir=None):
    """train.py's model section at one layout: (model, peak bytes of tensors allocated).
    meta=False: the old way, the whole model built (and imported) first, then cut and sharded."""
    with TensorMemory() as mem:
        torch.manual_seed(0)
        with torch.device("meta") if meta else nullcontext():
            model = Transformer(ModelConfig(**cfg))
        if hf_dir and not meta:
            model.load_state_dict(hf.load_hf(hf_dir)[1])
        model = make_stage(model, stage, pp)
        if tp is not None:
            tensor_parallel.tensor_parallel(model, tp)
        if dp_mesh is not None:
            fsdp.fully_shard_model(model,
                                   SimpleNamespace(dp_mesh=dp_mesh, device=torch.device("cpu")))
        if meta:
            meta_build.materialize(model, "cpu")
            model.init_rope()
            if hf_dir:
                hf.load_hf_parts(hf.hf_index(hf_dir)[1], meta_build.local_parts(model))
            else:
                meta_build.init_weights(model, 0)
    return model, mem.peak


def full_tensors(model):
    """{name: the full tensor} of what this rank holds (a stage's), gathered over FSDP / tp."""
    out = {}
    for name, p in model.named_parameters():
        # fsdp x tp: the tp slice, then gathered
        t = p.full_tensor() if isinstance(p, parallel.DTensor) else p
        out[name] = (parallel.tp_gather(t, p) if hasattr(p, "_split_dim") else t).detach().clone()
    return out


def layouts(mesh, hf_dir):
    """On 4 ranks: fsdp=4, pp=4, fsdp=2 x pp=2, tp=2 x pp=2 and fsdp=2 x tp=2, each built on
    meta; the import at fsdp=4, pp=4 and fsdp=2 x tp=2 (a parameter split both ways: a rank's
    part starts at its tp slice's offset plus its shard's); and the old whole-then-shard build
    and import, for their peaks. (dp=2 builds the whole model on each rank,
    as one process does.)"""
    # x: a pipeline stage or a tp group
    grid = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "x"))
    x = grid["x"].get_local_rank()
    tp = SimpleNamespace(tp=2, tp_rank=x, tp_group=grid["x"].get_group())
    runs = {"fsdp4": dict(dp_mesh=mesh.dp_mesh), "pp4": dict(stage=mesh.rank, pp=4),
            "fsdp2_pp2": dict(dp_mesh=grid["dp"], stage=x, pp=2),
            "tp2_pp2": dict(tp=tp, stage=grid["dp"].get_local_rank(), pp=2),
            "fsdp2_tp2": dict(dp_mesh=grid["dp"], tp=tp),
            "hf_fsdp2_tp2": dict(dp_mesh=grid["dp"], tp=tp, hf_dir=hf_dir),
            "hf_fsdp4": dict(dp_mesh=mesh.dp_mesh, hf_dir=hf_dir),
            "hf_pp4": dict(stage=mesh.rank, pp=4, hf_dir=hf_dir),
            "before_fsdp4": dict(meta=False, dp_mesh=mesh.dp_mesh),
            "before_hf_pp4": dict(meta=False, stage=mesh.rank, pp=4, hf_dir=hf_dir)}
    out = {}
    for key, kw in runs.items():
        model, peak = build_model(CFG, **kw)
        out[key] = {"peak": peak, "weights": full_tensors(model)}
    return out, one_step_memory(mesh, True)  # test_fsdp's check at fsdp=4, on these processes


def test_meta_build_is_layout_free_and_holds_a_quarter_per_rank(tmp_path):
    torch.manual_seed(0)
    one = Transformer(ModelConfig(**CFG))  # one process: what every layout must start from
    whole = {n: p.detach() for n, p in one.named_parameters()}
    model_bytes = sum(t.numel() * t.element_size() for t in whole.values())
    largest = max(t.numel() * t.element_size() for t in whole.values())
    # an imported model: other weights than the fresh ones
    hf_dir = str(tmp_path / "hf")
    hf.save_hf(hf_dir, Transformer(ModelConfig(**CFG), seed=1).state_dict(), ModelConfig(**CFG))
    imported = hf.load_hf(hf_dir)[1]
    assert not torch.equal(imported["layers.0.attention.wq.weight"],
                           whole["layers.0.attention.wq.weight"])

    ranks, steps = zip(*spawn(layouts, 4, hf_dir))
    check_one_nth(steps)
    # a quarter, plus a fixed overhead: one parameter drawn whole (and copies)
    bound = model_bytes / 4 + 4 * largest
    for key in ranks[0]:
        want = imported if key.startswith(("hf_", "before_hf")) else whole
        seen = set()
        for r in ranks:
            for name, t in r[key]["weights"].items():
                assert torch.equal(t, want[name]), (key, name)  # bit-identical, not just close
                seen.add(name)
        assert seen == set(want), (key, set(want) - seen)
        peaks = [r[key]["peak"] for r in ranks]
        # the old way holds the whole model on every rank: it fails the bound
        if key.startswith("before"):
            assert min(peaks) > bound and max(peaks) >= model_bytes, (key, peaks, bound)
        else:
            assert 0 < max(peaks) <= bound, (key, peaks, bound, model_bytes)
