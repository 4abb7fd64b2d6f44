"""dtype=float16: the hand-written loss scaler (loss_scale.py) step by step against torch's
GradScaler, then train.py's fp16 step on every layout against the single process, with an
overflow on one rank only, and resume (scale included) into the same and another layout."""

import math

import pytest
import torch
from conftest import REFERENCE, assert_same_curve, read_metrics, run_train, tiny_model, torchrun

from loss_scale import LossScaler

# ---- the scaler against torch.amp.GradScaler, in one process ---------------------------


def poison(model, step, kind):
    """The forced overflows: an inf in one gradient (as fp16 gives when a value passes 65504),
    or a NaN."""
    p = next(model.parameters())
    p.grad.view(-1)[step % p.numel()] = math.inf if kind == "inf" else math.nan


def test_scaler_equals_torch_grad_scaler_step_by_step():
    """The same model, data and AdamW under CPU fp16 autocast, one copy stepped through torch's
    GradScaler (scale, unscale_, clip, step, update), one through ours (the loss times the
    scale, unscale_, clip, step unless found_inf, update): at every step the same scale, the
    same growth tracker, the same skips and bit-identical weights. The run has injected infs
    and a NaN, a loss so large that its gradient overflows fp16 inside backward, two overflows
    in a row and growths (growth_interval 3)."""
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
            losses.append(loss * 2.0 ** 40 if forced.get(step) == "huge" else loss)  # backward overflows fp16
        (losses[0] * ours.scale).backward()
        ref.scale(losses[1]).backward()
        for model in (ours_model, torch_model):
            if forced.get(step) in ("inf", "nan"):
                poison(model, step, forced[step])
        found_inf = ours.unscale_(ours_model.parameters()).item() > 0
        ref.unscale_(opts[1])
        norms = [torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0) for m in (ours_model, torch_model)]
        if not found_inf:
            opts[0].step()
        ref.step(opts[1])
        ours.update(found_inf)
        ref.update()
        assert ours.scale == ref.get_scale() and ours.growth_tracker == ref._get_growth_tracker(), step
        assert found_inf == (not math.isfinite(norms[1])), step
        for a, b in zip(ours_model.parameters(), torch_model.parameters()):
            assert torch.equal(a, b), step
        for opt in opts:
            opt.zero_grad(set_to_none=True)
        skips.append(found_inf)
        scales.append(ours.scale)
    # the run did what it is for: every forced step overflowed and nothing else did, and the scale both
    # backed off and grew
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
