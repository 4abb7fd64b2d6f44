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
  2. unscale_: every gradient this rank holds times 1/scale; found_inf: any inf/NaN among them
  3. the verdict is global: found_inf is summed over all ranks (in the one all-reduce train.py
     does for the loss anyway). An inf on one pipeline stage, one dp rank, one tp slice, one
     FSDP shard or ZeRO slice skips the step on every rank: a step on some ranks only would
     leave the replicas, stages and shards of one model out of step with each other.
  4. the global-norm clip sees the unscaled gradients; the logged grad_norm is the true one
  5. optimizer.step(), unless found_inf anywhere
  6. update(found_inf): after an overflow scale x backoff_factor and the count of clean steps
     starts again; after growth_interval clean steps in a row scale x growth_factor.

Two choices beyond GradScaler: the scale never backs off below min_scale (1.0 in train.py, as
Megatron-LM's and DeepSpeed's min_loss_scale: at scale 1 the gradients are unscaled, and an
overflow there is no longer the scale's fault; torch's has no floor), and update() says
whether the scale took the blame: train.py's NaN guard counts the overflows that did not.
The scale is a power of two with the defaults, so multiplying by it and dividing again is exact.
"""

import torch
from torch.distributed.tensor import DTensor

FLOAT32_MAX = torch.finfo(torch.float32).max  # GradScaler keeps its scale in a float32: it grows no further


class LossScaler:
    def __init__(self, init_scale=2.0 ** 16, growth_factor=2.0, backoff_factor=0.5, growth_interval=2000,
                 min_scale=1.0):
        self.scale = float(init_scale)
        self.growth_tracker = 0  # clean steps in a row since the scale last changed (GradScaler's name)
        self.growth_factor, self.backoff_factor = growth_factor, backoff_factor
        self.growth_interval, self.min_scale = growth_interval, min_scale

    @torch.no_grad()
    def unscale_(self, params):
        """Divides the gradients of `params` (this rank's: whole, a stage's, shards or slices) by
        the scale, in place. Returns a 0-dim float tensor: 1.0 if any of them held an inf or NaN
        (checked before the division, as torch does), else 0.0. No host sync: the caller sums it
        over the ranks."""
        grads = [g.to_local() if isinstance(g, DTensor) else g for g in (p.grad for p in params) if g is not None]
        found_inf = torch.zeros(())
        if grads:
            found_inf = torch.stack([~torch.isfinite(g).all() for g in grads]).any().float()
            torch._foreach_mul_(grads, 1.0 / self.scale)  # the reciprocal in float64, as GradScaler's
        return found_inf

    def update(self, found_inf):
        """After the step (or the skip): found_inf, whether ANY rank found an inf or NaN. Returns
        whether this was an overflow the scale answers for (found_inf, and the scale could still
        back off); False for a clean step, and for an overflow at min_scale."""
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
        """From a checkpoint's meta.json (its types and ranges checked by ckpt_files.check_meta)."""
        self.scale, self.growth_tracker = float(state["scale"]), int(state["growth_tracker"])
