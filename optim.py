"""
The optimizer side of training: Muon (Newton-Schulz orthogonalized momentum) for the
layers' weight matrices together with AdamW for embeddings, head and gains in one
optimizer, and how Muon meets layouts: under FSDP each sharded matrix is gathered for its
orthogonalization; under plain data parallel the dp ranks split the orthogonalizing
(shared_orthogonalize) instead of all repeating it.
"""

import math

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, distribute_tensor

# ---- the optimizer: Muon for the hidden matrices, AdamW for the rest -----------------------


def newton_schulz(g, steps=5, coefficients=(3.4445, -4.7750, 2.0315), eps=1e-7, dtype=torch.bfloat16):
    """An approximately orthogonal matrix with the row and column spaces of g (2-D): U V^T of
    its SVD g = U S V^T, by a quintic Newton-Schulz iteration on X = g / |g| (every singular
    value in (0, 1]) that pushes each singular value towards 1 (to about 0.7-1.2: the
    coefficients trade precision for speed, which does not hurt training). Works on the short
    side (X X^T is the smaller Gram matrix). In bfloat16 by default, as Keller Jordan's
    reference and torch.optim.Muon do (on a CPU, whose bf16 matmuls are slow, float32)."""
    a, b, c = coefficients
    x = g.to(dtype)
    if g.size(0) > g.size(1):
        x = x.T
    x = x / x.norm().clamp(min=eps)
    for _ in range(steps):
        gram = x @ x.T
        poly = torch.addmm(gram, gram, gram, beta=b, alpha=c)  # b G + c G^2
        x = torch.addmm(x, poly, x, beta=a)                     # a X + (b G + c G^2) X
    return x.T if g.size(0) > g.size(1) else x


class MuonWithAdamW(torch.optim.Optimizer):
    """Muon (Jordan et al. 2024, "Muon: an optimizer for hidden layers") for the param groups
    marked muon=True, AdamW for the others, in one optimizer so that the loop, clipping and
    checkpoints see one `param_groups` and one `state` (keyed by parameter).

    Muon, per matrix W (m x n) with gradient G: a momentum buffer B = mu B + (1 - mu) G, the
    update O = newton_schulz((1 - mu) G + mu B) (Nesterov), i.e. that direction with every
    singular value ~1 (a step as large along rare directions as along common ones), and
    W -= lr * 0.2 * sqrt(max(m, n)) * O after decoupled weight decay. The 0.2 sqrt(max(m, n))
    gives O the RMS of a typical AdamW update (Liu et al. 2025, "Muon is scalable for LLM
    training"), so one learning rate and one schedule serve both kinds of group. It needs
    each matrix whole: an FSDP shard (a DTensor) is gathered for it, one matrix at a time;
    ZeRO's flat slices and tensor-parallel slices are not, and train.py refuses those. The AdamW groups follow torch.optim.AdamW (single-tensor) step by
    step; tests check both halves against torch's own optimizers."""

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0, momentum=0.95,
                 ns_dtype=torch.bfloat16):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, momentum=momentum,
                                      muon=False))
        self.ns_dtype = ns_dtype
        for group in self.param_groups:
            assert not group["muon"] or all(p.dim() == 2 for p in group["params"]), "Muon is for 2-D matrices"

    def orthogonalize(self, gs):
        """Newton-Schulz of each matrix, here. Data parallel swaps in parallel.shared_orthogonalize
        (each rank a share of the matrices, then an all-gather) as tensor parallelism swaps the loss."""
        out = []
        for g in gs:
            if isinstance(g, DTensor):
                # FSDP: this rank holds rows of the matrix; the orthogonalization needs all of
                # them. Gather, orthogonalize (every rank the same), keep this rank's rows.
                full = newton_schulz(g.full_tensor(), dtype=self.ns_dtype)
                out.append(distribute_tensor(full, g.device_mesh, g.placements, src_data_rank=None))
            else:
                out.append(newton_schulz(g, dtype=self.ns_dtype))
        return out

    @torch.no_grad()
    def step(self):
        muon = []  # (matrix, its Nesterov gradient, lr): orthogonalized together after the loop
        for group in self.param_groups:
            lr, wd = group["lr"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                p.mul_(1 - lr * wd)  # decoupled weight decay, as AdamW
                if group["muon"]:
                    if not state:
                        state["momentum_buffer"] = torch.zeros_like(p)
                    buf, mu = state["momentum_buffer"], group["momentum"]
                    buf.lerp_(p.grad, 1 - mu)                           # B = mu B + (1 - mu) G
                    muon.append((p, p.grad.lerp(buf, mu), lr))          # Nesterov: (1 - mu) G + mu B
                else:
                    if not state:
                        state.update(step=torch.zeros((), dtype=torch.float32), exp_avg=torch.zeros_like(p),
                                     exp_avg_sq=torch.zeros_like(p))
                    (beta1, beta2), step = group["betas"], state["step"].add_(1).item()
                    state["exp_avg"].lerp_(p.grad, 1 - beta1)
                    state["exp_avg_sq"].mul_(beta2).addcmul_(p.grad, p.grad, value=1 - beta2)
                    denom = (state["exp_avg_sq"].sqrt() / math.sqrt(1 - beta2 ** step)).add_(group["eps"])
                    p.addcdiv_(state["exp_avg"], denom, value=-lr / (1 - beta1 ** step))
        for (p, _, lr), update in zip(muon, self.orthogonalize([g for _, g, _ in muon])):
            p.add_(update, alpha=-lr * 0.2 * math.sqrt(max(p.shape)))


def shared_orthogonalize(mesh, dtype):
    """Muon's Newton-Schulz under data parallel (not FSDP): after the all-reduce every dp rank
    holds the same mean gradients, so orthogonalizing every matrix on every rank repeats the
    same work dp times. Instead each rank orthogonalizes a share of the matrices (largest
    first, each to the least loaded rank, by the iteration's cost m n min(m, n)) and one
    all-gather hands everyone the results: 1/dp of the work, the same bits on every rank.
    Returns the function that replaces MuonWithAdamW.orthogonalize."""
    def orthogonalize(gs):
        if not gs:
            return []
        load, owner = [0] * mesh.dp, [0] * len(gs)
        for i in sorted(range(len(gs)), key=lambda i: -gs[i].numel() * min(gs[i].shape)):
            owner[i] = min(range(mesh.dp), key=lambda r: load[r])
            load[owner[i]] += gs[i].numel() * min(gs[i].shape)
        owned = [[i for i in range(len(gs)) if owner[i] == r] for r in range(mesh.dp)]
        size = max(sum(gs[i].numel() for i in mine) for mine in owned)
        flat = torch.zeros(size, dtype=gs[0].dtype, device=gs[0].device)  # this rank's results, padded
        offset = 0
        for i in owned[mesh.dp_rank]:
            flat[offset:offset + gs[i].numel()] = newton_schulz(gs[i], dtype=dtype).flatten()
            offset += gs[i].numel()
        every = [torch.empty_like(flat) for _ in range(mesh.dp)]
        dist.all_gather(every, flat, group=mesh.dp_group)
        out = [None] * len(gs)
        for r, mine in enumerate(owned):
            offset = 0
            for i in mine:
                out[i] = every[r][offset:offset + gs[i].numel()].view_as(gs[i])
                offset += gs[i].numel()
        return out
    return orthogonalize


# ---- what train.py calls ----------------------------------------------------------------


def build_optimizer(raw_model, model, mesh, c, zero=False):
    """The optimizer over what trains (all of it, or LoRA's adapters: no state for frozen
    weights), weight decay on 2-D weights only, and the gradients that clipping measures and
    the step uses: the model's, or (ZeRO) this rank's slices of them. optim=muon: Muon for the
    layers' matrices (a stage's, with pp), AdamW for the embedding, head and gains; the token
    embedding's rate is embed_lr_scale times the rest (a row learns only when its token appears)."""
    trains = [(n, p) for n, p in raw_model.named_parameters() if p.requires_grad]
    hidden = [p for n, p in trains if c["optim"] == "muon" and p.dim() == 2 and n.startswith("layers.")]
    embedding = [p for n, p in trains if n == "tok_embeddings.weight"]  # (with tie_embeddings also the head)
    decay = [p for n, p in trains if p.dim() >= 2 and all(p is not q for q in hidden + embedding)]  # head (+ AdamW: matmuls)
    no_decay = [p for n, p in trains if p.dim() < 2]                                                # norm gains
    groups = [{"params": embedding, "weight_decay": c["weight_decay"], "lr_scale": c["embed_lr_scale"]},
              {"params": decay, "weight_decay": c["weight_decay"]}, {"params": no_decay, "weight_decay": 0.0}]
    groups = [g for g in groups if g["params"]]  # a pipeline stage without the embedding, LoRA (frozen embedding)
    betas, fused = (c["beta1"], c["beta2"]), mesh.device.type == "cuda" and not c["offload"]
    if zero:  # ZeRO: zero.py (AdamW on this rank's slices, then an all-gather of the updated weights)
        import zero as zero_py
        optimizer = zero_py.ZeroOptimizer(model, groups, c["offload"], lr=c["learning_rate"], betas=betas, fused=fused)
        return optimizer, optimizer.params
    if c["optim"] == "muon":
        groups.append({"params": hidden, "weight_decay": c["weight_decay"], "muon": True})
        optimizer = MuonWithAdamW(groups, lr=c["learning_rate"], betas=betas, momentum=c["muon_momentum"],
                                  ns_dtype=torch.bfloat16 if mesh.device.type == "cuda" else torch.float32)
        if mesh.dp > 1 and not any(isinstance(p, DTensor) for p in hidden):
            # every dp rank holds the same mean gradients: share the orthogonalizing
            optimizer.orthogonalize = shared_orthogonalize(mesh, optimizer.ns_dtype)
    else:
        optimizer = torch.optim.AdamW(groups, lr=c["learning_rate"], betas=betas, fused=fused)
    return optimizer, list(raw_model.parameters())


def get_lr(it, c):
    """Linear warmup to learning_rate, then down to min_lr at lr_decay_iters (flat after it):
    a cosine from the end of warmup, or (wsd) flat until the last cooldown_frac of the
    iterations and a straight line down in them. WSD's loss stays high while the rate is
    high and falls in the cooldown; it lets a run be extended by moving the cooldown."""
    lr, min_lr, warmup = c["learning_rate"], c["min_lr"], c["warmup_iters"]
    decay = c["lr_decay_iters"] or c["max_iters"]
    if it < warmup:
        return lr * (it + 1) / warmup
    if it >= decay:
        return min_lr
    if c["lr_schedule"] == "wsd":
        cooldown = max(1, round(c["cooldown_frac"] * decay))
        progress = max(0.0, (it - (decay - cooldown)) / cooldown)
        return lr - progress * (lr - min_lr)
    progress = (it - warmup) / max(1, decay - warmup)
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (lr - min_lr)


def schedule_note(c):
    """A line on what the schedule does when max_iters ends inside the warmup (else None)."""
    if c["max_iters"] >= c["warmup_iters"]:
        return None
    top = c["learning_rate"] * c["max_iters"] / c["warmup_iters"]
    return (f"note: max_iters={c['max_iters']} < warmup_iters={c['warmup_iters']}: the learning rate only warms up, "
            f"to {top:.2e} at the last step (learning_rate={c['learning_rate']:.2e} is never reached, and there is "
            f"no decay); lower warmup_iters for a full schedule")
