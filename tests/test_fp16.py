"""dtype=float16: the hand-written loss scaler (loss_scale.py) step by step against torch's
GradScaler, then train.py's fp16 step on every layout against the single process, with an
overflow on one rank only, and resume (scale included) into the same and another layout."""

import json
import math
import shutil

import torch
from conftest import (REFERENCE, assert_same_curve, read_metrics, run_train, spawn, tiny_model,
                      torchrun)
from test_parallel import CLIP_CFG, clip_batch, clip_model_grads

from techniques import data_parallel
import faults
import parallel
from model import ModelConfig, Transformer
from guards.guard_ckpt import check_meta
from techniques import fsdp
from techniques import tensor_parallel
from techniques import zero
from techniques.loss_scale import LossScaler

# ---- the scaler against torch.amp.GradScaler, in one process ---------------------------


def poison(model, step, kind):
    """The forced overflows: an inf in one gradient (as fp16 gives when a value passes 65504),
    or a NaN."""
    p = next(model.parameters())
    p.grad.view(-1)[step % p.numel()] = math.inf if kind == "inf" else math.nan


def test_scaler_equals_torch_grad_scaler_step_by_step():
    """The same model, data and AdamW under CPU fp16 autocast, one copy stepped through torch's
    GradScaler (scale, unscale_, clip, step, update), one as train.py steps it (backward from
    loss x scale, unscale_, the clip, whose norm is the verdict, the step unless it is inf/NaN,
    update): at every step the same scale, the same growth tracker, the same skips and
    bit-identical weights. The run has injected infs and a NaN, a loss so large that its
    gradient overflows fp16 inside backward, two overflows in a row and growths
    (growth_interval 3)."""
    ours_model, torch_model = tiny_model(), tiny_model()
    ours_model.train(), torch_model.train()
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (ours_model, torch_model)]
    ours = LossScaler(init_scale=2.0 ** 10, growth_interval=3)
    ref = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10, growth_interval=3)
    g = torch.Generator().manual_seed(0)
    forced = {2: "inf", 6: "nan", 7: "inf", 13: "huge"}
    skips, scales = [], []
    for step in range(20):
        x = torch.randint(0, 97, (4, 16), generator=g)
        y = torch.randint(0, 97, (4, 16), generator=g)
        losses = []
        for model in (ours_model, torch_model):
            with torch.autocast("cpu", dtype=torch.float16):
                _, loss = model(x, y)
            # backward overflows fp16
            losses.append(loss * 2.0 ** 40 if forced.get(step) == "huge" else loss)
        (losses[0] * ours.scale).backward()
        ref.scale(losses[1]).backward()
        for model in (ours_model, torch_model):
            if forced.get(step) in ("inf", "nan"):
                poison(model, step, forced[step])
        assert ours.unscale_(ours_model.parameters(), losses[0]) == losses[0] / ours.scale
        ref.unscale_(opts[1])
        # train.py's verdict: the norm of the unscaled gradients is not finite (the clip is torch's
        # on both sides, so that the weights compare bit for bit;
        # parallel.clip_grad_norm_ is test_parallel's)
        found_inf = not math.isfinite(torch.nn.utils.clip_grad_norm_(ours_model.parameters(), 1.0))
        torch_norm = torch.nn.utils.clip_grad_norm_(torch_model.parameters(), 1.0)
        if not found_inf:
            opts[0].step()
        ref.step(opts[1])
        ours.update(found_inf)
        ref.update()
        assert (ours.scale == ref.get_scale()
                and ours.growth_tracker == ref._get_growth_tracker()), step
        assert found_inf == (not math.isfinite(torch_norm)), step
        for a, b in zip(ours_model.parameters(), torch_model.parameters()):
            assert torch.equal(a, b), step
        for opt in opts:
            opt.zero_grad(set_to_none=True)
        skips.append(found_inf)
        scales.append(ours.scale)
    # the run did what it is for: every forced step overflowed and nothing else did, and the scale
    # both backed off and grew
    assert [i for i, s in enumerate(skips) if s] == sorted(forced), skips
    steps = list(zip(scales, scales[1:]))
    assert any(b < a for a, b in steps) and any(b > a for a, b in steps), scales


def test_scaler_floor_and_ceiling():
    """Beyond GradScaler: the scale never backs off below min_scale, and an overflow there is
    not the scale's (update says False: train.py's NaN guard counts it); it grows no further
    than float32 can hold (as GradScaler, whose scale is a float32)."""
    s = LossScaler(init_scale=2.0, growth_interval=1)
    assert s.update(True) and s.scale == 1.0
    assert not s.update(True) and s.scale == 1.0 and s.growth_tracker == 0
    assert not s.update(False) and s.scale == 2.0
    s = LossScaler(init_scale=2.0 ** 127, growth_interval=1)
    s.update(False)
    assert s.scale == 2.0 ** 127 and s.growth_tracker == 0
    s.load_state_dict({"scale": 8.0, "growth_tracker": 5})
    assert s.state_dict() == {"scale": 8.0, "growth_tracker": 5}


# ---- the verdict is global: one inf in one rank's part of the gradient ------------------
# train.py's overflow verdict is the global gradient norm, which every layout already reduces
# over the ranks that hold different parts (pipeline stages, FSDP shards, ZeRO slices, tp
# slices). Each case puts an inf into ONE element of the LAST rank's own part, after the
# gradient sync, and every rank must see a non-finite norm (and without it a finite one).
# Replicas (plain data parallel, the norm gains on every tp rank) hold the all-reduced bits,
# the same on every rank, so there an inf is made before the sync, in one rank's backward.


def poison_last_rank(mesh, grads):
    if mesh.rank == mesh.world - 1:
        grads[0].view(-1)[-1] = math.inf


def verdicts_over_dp(mesh):
    """{kind: (norm finite without the inf, norm finite with it)} on this rank, 2 dp ranks."""
    rows = slice(2 * mesh.dp_rank, 2 * mesh.dp_rank + 2)
    out = {}
    for kind in ("dp", "fsdp", "zero1", "zero2"):
        finite = []
        for inf in (False, True):
            torch.manual_seed(0)
            model = Transformer(ModelConfig(**CLIP_CFG))
            if kind == "dp":  # before the sync: the last rank's loss (so its gradients) infinite
                ddp = data_parallel.DataParallel(model, mesh, 0.002)
                x, y = clip_batch()
                loss = ddp(x[rows], y[rows])[1]
                (loss * (math.inf if inf and mesh.rank == mesh.world - 1 else 1.0)).backward()
                ddp.wait()
                params = list(model.parameters())
            elif kind == "fsdp":
                clip_model_grads(fsdp.fully_shard_model(model, mesh), rows)
                params = list(model.parameters())
                if inf:
                    poison_last_rank(
                        mesh, [p.grad.to_local() for p in params if p.grad.to_local().numel()])
            else:
                ddp = zero.ZeroDataParallel(model, mesh, 0.002, stage=int(kind[-1]))
                clip_model_grads(ddp, rows).wait()
                params = zero.ZeroOptimizer(ddp, [{"params": list(model.parameters())}],
                                            lr=1e-3).params
                if inf:
                    poison_last_rank(mesh, [p.grad for p in params])
            finite.append(math.isfinite(
                parallel.clip_grad_norm_(params, 1.0, mesh, sharded=kind.startswith("zero"))))
        out[kind] = tuple(finite)
    return out


def verdicts_over_tp_and_pp(mesh):
    """tp=2 x pp=2: the stages split the parameters as in test_parallel's clipping test; the
    inf goes into the last rank's (last stage, second tp slice) slice of a tp-cut matrix."""
    finite = []
    for inf in (False, True):
        torch.manual_seed(0)
        model = clip_model_grads(
            tensor_parallel.tensor_parallel(Transformer(ModelConfig(**CLIP_CFG)), mesh))
        mine = [p for n, p in model.named_parameters()
                if n.startswith(("tok_embeddings.", "layers.0.")) == mesh.first_stage]
        if inf:
            poison_last_rank(mesh, [p.grad for p in mine if hasattr(p, "_split_dim")])
        finite.append(math.isfinite(parallel.clip_grad_norm_(mine, 1.0, mesh)))
    return tuple(finite)


def test_one_inf_in_one_ranks_part_is_seen_by_every_rank():
    for rank in spawn(verdicts_over_dp, 2):
        assert rank == {kind: (True, False) for kind in ("dp", "fsdp", "zero1", "zero2")}, rank
    assert spawn(verdicts_over_tp_and_pp, 4, pp=2, tp=2) == [(True, False)] * 4


# ---- train.py with dtype=float16: every layout, resume ---------------------------------
# REFERENCE in fp16 with real overflows: the first scale, 2**40, overflows fp16 in backward
# (so does 2**29 after one backoff of 2**-11), 2**18 does not, and 3 clean steps grow it: 2 steps
# skipped, then 2**19 from iteration 5 on (the overflow threshold of this run is ~2**21: the
# scales stay 4x below it, where every layout's rounding agrees on the verdict). The NaN guard
# is set to stop at its first incident: an overflow must not count as one. learning_rate=5e-4:
# see RTOL_FP16.
FP16 = [*REFERENCE, "dtype=float16", "loss_scale_init=1099511627776.0",
        "loss_scale_backoff=0.00048828125",
        "loss_scale_interval=3", "lr_decay_iters=8", "nan_max_consecutive=1", "nan_action=stop",
        "learning_rate=5e-4", "min_lr=5e-5"]
SCALES = {0: 2.0 ** 29, 1: 2.0 ** 18, 2: 2.0 ** 18, 3: 2.0 ** 18, 4: 2.0 ** 19, 5: 2.0 ** 19,
          6: 2.0 ** 19, 7: 2.0 ** 20}  # after each iteration
# A layout against the single process, both in fp16, and fp16 against float32: fp16 autocast
# rounds each matmul's output to 11 significant bits (relative 2**-11 at most; the sums inside
# run in float32), float32 does not, and a layout rounds elsewhere (tp: two half sums, each
# rounded, then added; ZeRO, FSDP, pipeline: other orders). The loss and the gradient norm are
# sums over many such values, whose roundings do not add up in one direction: they differ by
# less than one rounding, 2**-11 (measured: fp16 against float32 7.9e-5).
# That holds while training does not amplify the difference, and at REFERENCE's learning rate
# it does: AdamW's first steps are about lr x sign(g), so a near-zero gradient element that
# rounding flips moves by 2 lr (the embedding's: 10 lr). At 1e-2 one grad norm of zero=2 x
# tp=2 differed by 4.0e-4 on one CPU, 2.6e-3 on another (AVX512-BF16), 1.8e-2 at another seed;
# at 1e-3 by up to 3.4e-4 over seven seeds on the second CPU; at 5e-4 by up to 1.6e-4 (the
# three worst of those seeds).
RTOL_FP16 = 2.0 ** -11


def fp16_rows(out):
    """(train lines, {iter: the scale after it}, [overflow-skipped iterations]) of a run."""
    rows = read_metrics(out)
    scales = {r["iter"]: r["loss_scale"] for r in rows if "loss_scale" in r}
    return rows, scales, sorted(r["iter"] for r in rows if r.get("skipped") == "fp16 overflow")


def worst(a, b):
    """The largest relative difference of run b from run a over a's losses, grad norms and val
    losses (b may hold extra val lines: a run stopped early evaluates at its end)."""
    values = [
        {(r["iter"], "val_loss" in r, k): r[k] for r in rows
         for k in ("loss", "grad_norm", "val_loss") if r.get(k) is not None} for rows in (a, b)]
    assert values[0] and set(values[0]) <= set(values[1])
    return max(abs(values[1][i] - x) / abs(x) for i, x in values[0].items())


def test_fp16_layouts_equal_the_single_process(dataset, tmp_path):
    """The single process against float32 with the same two iterations skipped (by the NaN
    guard: float32 does not overflow), so with the same weights at each step: the same curve to
    fp16's rounding (fp16 against fp16 alone would pass a slip both sides carry, such as grad
    norms 2**19 too large from a loss unscaled without its gradients). Then dp=2 x tp=2 with
    ZeRO-2 and dp=2 x pp=2 with FSDP against one process: the same skipped iterations and
    scales, exactly, and the same curve to fp16's rounding."""
    single, f32 = str(tmp_path / "single"), str(tmp_path / "float32")
    run_train([*FP16, f"dataset={dataset}", f"out_dir={single}"], cwd=tmp_path, fork=True)
    want, scales, skipped = fp16_rows(single)
    assert scales == SCALES and skipped == [0, 1], (scales, skipped)
    run_train(
        [*FP16, f"dataset={dataset}", f"out_dir={f32}", "dtype=float32", "nan_max_consecutive=3"],
        cwd=tmp_path, script="tests/faults.py", env=faults.nan_at(0, 2))
    print("\nfp16 vs float32, one process: worst relative difference "
          f"{worst(read_metrics(f32), want):.1e}")
    assert_same_curve([r for r in read_metrics(f32) if "skipped" not in r],
                      [r for r in want if "skipped" not in r], rtol=RTOL_FP16)
    for name, layout in (("zero2-tp2", ["zero=2", "tp=2"]), ("fsdp-pp2", ["fsdp=True", "pp=2"])):
        out = str(tmp_path / name)
        torchrun(4, [*FP16, f"dataset={dataset}", f"out_dir={out}", *layout], cwd=tmp_path)
        rows, got_scales, got_skipped = fp16_rows(out)
        assert (got_scales, got_skipped) == (scales, skipped), name
        print(f"\nfp16 {name} vs one process: worst relative difference {worst(want, rows):.1e}")
        assert_same_curve([r for r in want if "skipped" not in r],
                          [r for r in rows if "skipped" not in r], rtol=RTOL_FP16)


def test_fp16_resume_is_exact_and_goes_into_another_layout(dataset, tmp_path):
    """Stopped at iteration 4 (scale 2**18, two clean steps counted towards growth; meta.json's
    loss_scale checked like the rest of the file) and resumed:
    the uninterrupted run exactly, the scale's growth at iteration 4 included (a fresh scaler
    would overflow there, one that lost its count would grow later); and from the same
    checkpoint on 2 data-parallel ranks: the same scales, the curve to fp16's rounding."""
    whole, stopped = str(tmp_path / "whole"), str(tmp_path / "stopped")
    run_train([*FP16, f"dataset={dataset}", f"out_dir={whole}"], cwd=tmp_path, fork=True)
    run_train([*FP16, f"dataset={dataset}", f"out_dir={stopped}", "max_iters=4"], cwd=tmp_path,
              fork=True)
    moved = str(tmp_path / "moved")
    shutil.copytree(stopped, moved)
    # the state as meta.json holds it, read as hostile:
    # a scale below its floor of 1 or past float32 is refused
    ckpt = f"{stopped}/ckpt/iter_0000004"
    meta = json.load(open(f"{ckpt}/meta.json"))
    assert (meta["loss_scale"] == {"scale": 2.0 ** 18, "growth_tracker": 2}
            and check_meta(meta, ckpt) is None)
    for bad in ({"scale": 0.5, "growth_tracker": 2}, {"scale": 1e39, "growth_tracker": 2},
                {"scale": "65536", "growth_tracker": 2}, {"scale": 2.0, "growth_tracker": -1},
                {"scale": 2.0}):
        assert "loss_scale" in check_meta({**meta, "loss_scale": bad}, ckpt), bad
    run_train([*FP16, f"dataset={dataset}", f"out_dir={stopped}"], cwd=tmp_path, fork=True)
    want, scales, skipped = fp16_rows(whole)
    got, got_scales, got_skipped = fp16_rows(stopped)
    assert (got_scales, got_skipped) == (scales, skipped) and scales == SCALES
    assert_same_curve(want, got, exact=True)
    torchrun(2, [*FP16, f"dataset={dataset}", f"out_dir={moved}"], cwd=tmp_path)
    rows, got_scales, got_skipped = fp16_rows(moved)
    assert (got_scales, got_skipped) == (scales, skipped)
    print("\nfp16 resumed on dp=2 vs one process: worst relative difference "
          f"{worst(want, rows):.1e}")
    assert_same_curve([r for r in want if "skipped" not in r],
                      [r for r in rows if "skipped" not in r], rtol=RTOL_FP16)


def test_fp16_nan_loss_is_the_nan_guards_not_an_overflow(dataset, tmp_path):
    """A non-finite loss (faults.nan_at poisons the forward's loss) is no overflow the scale
    answers for: the NaN guard counts it (here: stops at the first), though the scale backs off.
    A rollback takes the checkpoint's scale back with its weights: NaNs at 5 and 6 back the
    scale off to its floor of 1, and the run rolled back to iteration 4 goes on from 2**18 (and
    the two clean steps counted there) as the uninterrupted run did."""
    p = run_train([*FP16, f"dataset={dataset}", f"out_dir={tmp_path / 'nan'}"], cwd=tmp_path,
                  script="tests/faults.py", env=faults.nan_at(3), check=False)
    assert p.returncode != 0 and "iter 3: non-finite loss nan" in p.stdout, p.stdout[-2000:]
    assert p.stderr.strip().splitlines()[-1].startswith(
        "error: 1 iterations in a row (up to 3) had a non-finite")
    out = str(tmp_path / "rollback")
    p = run_train([*FP16, f"dataset={dataset}", f"out_dir={out}",
                   "nan_max_consecutive=2", "nan_action=rollback", "ckpt_interval=4"],
                  cwd=tmp_path, script="tests/faults.py", env=faults.nan_at(5, 2))
    assert "rolled back to" in p.stdout, p.stdout[-2000:]
    rows, scales, _ = fp16_rows(out)
    # 7: one clean step on
    assert scales == {i: SCALES[i] for i in (0, 1, 2, 3, 4)} | {7: 2.0 ** 19}, scales
    assert [r["iter"] for r in rows if r.get("skipped") == "known bad batch"] == [5, 6]
