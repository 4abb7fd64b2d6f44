"""
fp16 mixed precision's dynamic loss scaler, written out: torch.amp.GradScaler's semantics step
by step (tests/test_fp16.py runs the two side by side), for gradients spread over any layout.

Why fp16 needs it and bf16 does not. Under autocast the matmuls' outputs, and in backward the
gradients of those activations, are 16-bit floats. bfloat16 keeps float32's 8 exponent bits:
the same range, less precision. float16 has 5: above 65504 a value overflows to inf, below
2**-24 (~6e-8) it flushes to zero, and a language model's activation gradients are mostly
small (a mean over many tokens). So the backward starts from loss x scale (2**16 at first):
every gradient is scale times larger, the small ones stay representable, and dividing the
parameters' float32 gradients by scale afterwards gives the true gradient back. A scale that is
too large overflows somewhere; then the step is skipped and the scale made smaller. A scale that
has not overflowed for growth_interval steps is tried larger, so it follows the gradients down
as training goes on.

One iteration (train.py's TRAINING SECTION; the weights and the optimizer state stay float32):

  1. backward from loss x scale (train.py multiplies the micro-batches' loss weights by it)
  2. unscale_: every gradient this rank holds (whole, a stage's, a shard, a slice) times
     1/scale, and the loss too: the clip, the step and the log see the true values
  3. the verdict: did ANY rank's gradients hold an inf or NaN? GradScaler looks at each
     gradient (found_inf); train.py asks one number instead, the global gradient norm the clip
     computes anyway. Every layout already sums its squares over the ranks that hold different
     parts (pipeline stages, FSDP shards, ZeRO slices, tp slices; replicas hold the same
     all-reduced bits), and one inf or NaN anywhere makes that sum inf or NaN on every rank:
     the same verdict everywhere, no extra collective. A step on some ranks only would leave
     the stages, shards and replicas of one model out of step with each other.
  4. the clip by that norm (the logged grad_norm is the true one)
  5. optimizer.step(), unless the norm is inf/NaN: then every rank skips it
  6. update(overflow): after an overflow scale x backoff_factor and the count of clean steps
     starts again; after growth_interval clean steps in a row scale x growth_factor.

Two choices beyond GradScaler: the scale never backs off below min_scale (1.0 in train.py, as
Megatron-LM's and DeepSpeed's min_loss_scale: at scale 1 the gradients are unscaled, and an
overflow there is no longer the scale's fault; torch's has no floor), and update() says
whether the scale took the blame: train.py's NaN guard counts the overflows that did not.
The scale is a power of two with the defaults, so multiplying by it and dividing again is exact.
"""

import torch
from torch.distributed.tensor import DTensor

# GradScaler keeps its scale in a float32: it grows no further
FLOAT32_MAX = torch.finfo(torch.float32).max


class LossScaler:
    def __init__(self, init_scale=2.0 ** 16, growth_factor=2.0, backoff_factor=0.5,
                 growth_interval=2000,
                 min_scale=1.0):
        self.scale = float(init_scale)
        # clean steps in a row since the scale last changed (GradScaler's name)
        self.growth_tracker = 0
        self.growth_factor, self.backoff_factor = growth_factor, backoff_factor
        self.growth_interval, self.min_scale = growth_interval, min_scale

    @classmethod
    def from_config(cls, c):
        """From train.py's keys (min_scale is no key: 1.0, see above)."""
        return cls(c["loss_scale_init"], c["loss_scale_growth"], c["loss_scale_backoff"],
                   c["loss_scale_interval"])

    @torch.no_grad()
    def unscale_(self, params, loss):
        """Divides the gradients of `params` (this rank's: whole, a stage's, shards or slices) by
        the scale, in place, before anything reads them; returns loss / scale, the true loss."""
        grads = [g.to_local() if isinstance(g, DTensor) else g for g in (p.grad for p in params)
                 if g is not None]
        if grads:  # one kernel for all of them, as GradScaler's (a power-of-two scale: exact)
            torch._foreach_mul_(grads, 1.0 / self.scale)
        return loss / self.scale

    def update(self, found_inf):
        """After the step (or the skip): found_inf, whether ANY rank's gradients held an inf or
        NaN. Returns whether that was an overflow the scale answers for (found_inf, and the
        scale could still back off); False for a clean step, and for an overflow at min_scale."""
        if found_inf:
            blamed = self.scale > self.min_scale
            self.scale = max(self.scale * self.backoff_factor, self.min_scale)
            self.growth_tracker = 0
            return blamed
        self.growth_tracker += 1
        if self.growth_tracker == self.growth_interval:
            grown = self.scale * self.growth_factor
            self.scale = grown if grown <= FLOAT32_MAX else self.scale
            self.growth_tracker = 0
        return False

    def state_dict(self):
        """What resume needs (the factors and the interval are config keys): plain numbers for
        the checkpoint's meta.json."""
        return {"scale": self.scale, "growth_tracker": self.growth_tracker}

    def load_state_dict(self, state):
        """From a checkpoint's meta.json (its types and ranges checked by
        guard_ckpt.check_meta)."""
        self.scale, self.growth_tracker = float(state["scale"]), int(state["growth_tracker"])
