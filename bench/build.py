"""Peak tensor bytes per rank while building the model (fresh weights) and while importing a
Hugging Face copy of it, at 1, 2, 4 ranks as fsdp and pp: train.py's meta-device build against
building the whole model first, on a model whose layers dominate."""

import os
import tempfile
import weakref
from contextlib import nullcontext

import torch
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode

import parallel
from model import ModelConfig, Transformer
from techniques import fsdp
from techniques import meta_build

from bench.base import MODEL, run_ranks, sized


class TensorMemory(TorchDispatchMode):
    """Counts the bytes of CPU tensor storage created while active and still alive (`now`)
    and the most at any moment (`peak`): what a rank allocates while it builds or imports the
    model (this table, tests/test_meta.py). Storage that existed before is not counted."""

    def __init__(self):
        super().__init__()
        self.now = self.peak = 0
        self.seen = set()

    def _free(self, key, n):
        self.seen.discard(key)
        self.now -= n

    @staticmethod
    def _cpu_storages(tree):
        for t in torch.utils._pytree.tree_leaves(tree):
            t = t.to_local() if isinstance(t, DTensor) else t
            if isinstance(t, torch.Tensor) and t.device.type == "cpu":
                s = t.untyped_storage()
                yield (s.data_ptr(), s.nbytes()), s

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        # a view or an in-place result is not new
        old = {key for key, _ in self._cpu_storages((args, kwargs))}
        for key, s in self._cpu_storages(out):
            if key not in self.seen and key not in old and s.nbytes():
                self.seen.add(key)
                self.now += s.nbytes()
                self.peak = max(self.peak, self.now)
                weakref.finalize(s, self._free, key, s.nbytes())
        return out


# deeper and wider: the layers outweigh embedding and head
BUILD_MODEL = sized({**MODEL, "n_layer": 16, "n_embd": 256})


def build_worker(layout, hf_dir):
    """One rank of the build table: peak bytes of tensors this rank allocates while it builds
    the model with fresh weights and while it imports the Hugging Face copy, the meta way
    (train.py) and the old way (whole model first, then cut and shard)."""
    
    from formats import hf
    from techniques.pipeline import make_stage
    world = int(os.environ["WORLD_SIZE"])
    torch.set_num_threads(1)
    mesh = parallel.setup("cpu", 300, pp=world if layout == "pp" else 1)
    row = {}
    for meta in (True, False):
        for source in ("init", "import"):
            with TensorMemory() as mem:
                torch.manual_seed(0)
                with torch.device("meta") if meta else nullcontext():
                    model = Transformer(ModelConfig(**BUILD_MODEL))
                if source == "import" and not meta:
                    model.load_state_dict(hf.load_hf(hf_dir)[1])
                model = make_stage(model, mesh.pp_rank, mesh.pp)
                if layout == "fsdp" and world > 1:
                    fsdp.fully_shard_model(model, mesh)
                if meta:
                    meta_build.materialize(model, "cpu")
                    model.init_rope()
                    if source == "import":
                        hf.load_hf_parts(hf.hf_index(hf_dir)[1], meta_build.local_parts(model))
                    else:
                        meta_build.init_weights(model, 0)
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
    print(f"\n## building and importing the model, per rank: n_layer={cfg.n_layer}, "
          f"n_embd={cfg.n_embd}, vocab {cfg.vocab_size} ({model.num_params() / 1e6:.2f}M "
          f"parameters, fp32: {whole:.1f} MB whole, largest single parameter {largest:.1f} MB); "
          "peak MB of tensors a rank allocates (counted by TensorMemory), the busiest "
          "rank")
    print(f"{'layout':<6} {'ranks':>5} | {'whole/N':>7} | {'build':>6} | {'import':>6} | "
          f"{'old build':>9} | {'old import':>10}")
    print("-" * 62)
    from formats import hf
    with tempfile.TemporaryDirectory() as tmp:
        hf_dir = os.path.join(tmp, "hf")
        hf.save_hf(hf_dir, model.state_dict(), cfg)
        del model
        for layout, world in layouts:
            r = run_ranks(build_worker, world, layout, hf_dir)
            print(f"{layout:<6} {world:>5} | {whole / world:7.1f} | {r['meta_init']:6.1f} | "
                  f"{r['meta_import']:6.1f} | {r['whole_init']:9.1f} | {r['whole_import']:10.1f}")
    print("build/import: the meta-device build (train.py): the stage is cut and the shards made "
          "on the meta device, then each rank allocates and reads only its part. old: the whole "
          "model first (and the whole file read), then cut and sharded. pp's busiest rank is the "
          "stage with the embedding or the head.")
