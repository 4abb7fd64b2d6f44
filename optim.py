"""
The optimizer side of training: Muon (Newton-Schulz orthogonalized momentum) for the
layers' weight matrices together with AdamW for embeddings, head and gains in one
optimizer, and how Muon meets layouts: each matrix is orthogonalized whole, once, by one of
the ranks that hold it (its FSDP shards, ZeRO pieces or tensor-parallel slices gathered
first), and the results are shared (orthogonalize_shared), so each rank does 1/(dp x tp) of
the work; the LR schedule.
"""

import math

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, distribute_tensor

from parallel import tp_gather, tp_slice

# ---- the optimizer: Muon for the hidden matrices, AdamW for the rest -----------------------


def newton_schulz(g, steps=5, coefficients=(3.4445, -4.7750, 2.0315), eps=1e-7,
                  dtype=torch.bfloat16):
    """An approximately orthogonal matrix with the row and column spaces of g (2-D, or a stack
    (k, m, n) of matrices of one shape, each on its own): U V^T of its SVD g = U S V^T, by a
    quintic Newton-Schulz iteration on X = g / |g| (every singular value in (0, 1]) that pushes
    each singular value towards 1 (to about 0.7-1.2: the coefficients trade precision for
    speed, which does not hurt training). Works on the short side (X X^T is the smaller Gram
    matrix). In bfloat16 by default, as Keller Jordan's reference and torch.optim.Muon do (on a
    CPU float32: on most CPUs bf16 matmuls are emulated and slow; see docs/model.md)."""
    a, b, c = coefficients
    tall = g.size(-2) > g.size(-1)
    x = g.to(dtype).reshape(-1, *g.shape[-2:])  # (k, m, n)
    if tall:
        x = x.mT
    x = x / x.norm(dim=(1, 2), keepdim=True).clamp(min=eps)
    for _ in range(steps):
        gram = x @ x.mT
        poly = torch.baddbmm(gram, gram, gram, beta=b, alpha=c)  # b G + c G^2
        x = torch.baddbmm(x, poly, x, beta=a)                     # a X + (b G + c G^2) X
    return (x.mT if tall else x).reshape(g.shape)


def newton_schulz_each(gs, dtype):
    """newton_schulz of each matrix of the list gs, those of one shape as one stack: a few
    batched matmuls instead of many small ones (at width 128 on 2 CPU threads ~17 instead of
    ~21 ms a step, the stacks keeping both threads busier; the same on one thread; bench.py
    profile measures both ways)."""
    out, by_shape = [None] * len(gs), {}
    for i, g in enumerate(gs):
        by_shape.setdefault(tuple(g.shape), []).append(i)
    for idx in by_shape.values():
        for i, update in zip(idx,
                             newton_schulz(torch.stack([gs[i].to(dtype) for i in idx]),
                                           dtype=dtype)):
            out[i] = update
    return out


class NamedState:
    """What checkpoint.py asks of an optimizer, as torchtitan's checkpointer asks its stateful
    objects: the whole state keyed by global parameter names, {"layers.0.attention.wq.weight.
    exp_avg": tensor, ...} (positions in the optimizer, which state_dict() uses, would differ
    between pipeline stages; names do not), and such a state taken back. Mixed into the
    optimizers here; ZeRO's (zero.py) answers the same two calls with its slices gathered, so
    checkpoint.py knows neither."""

    def full_state(self, names):
        """{"name.key": tensor} of every parameter that trains (names: parameter -> its global
        name): the optimizer's own state tensors, which a checkpoint load reads into in place.
        A parameter no step has reached yet first gets the zero state its first step would
        create (AdamW's moments; Muon's momentum), so it steps the same with it: a checkpoint
        written before any step succeeded must still hold what a load asks for."""
        for group in self.param_groups:  # only what trains (LoRA's frozen base is in no group)
            for p in group["params"]:
                if not self.state.get(p):
                    self.state[p] = self._first_state(group, p)
        return {f"{names[p]}.{k}": v for p, st in self.state.items() for k, v in st.items()}

    def _first_state(self, group, p):
        if group.get("muon"):
            return {"momentum_buffer": torch.zeros_like(p)}
        step_device = p.device if self.defaults.get("fused") else "cpu"
        return {"step": torch.zeros((), dtype=torch.float32, device=step_device),
                "exp_avg": torch.zeros_like(p), "exp_avg_sq": torch.zeros_like(p)}

    def load_full_state(self, state, names):
        """Takes a whole state of full_state's keys, as a checkpoint load left it (a
        tensor-parallel slice already cut to this rank's): copied wherever it is not the state's
        own tensor."""
        for p, st in self.state.items():
            for k, v in st.items():
                if state[f"{names[p]}.{k}"] is not v:
                    v.copy_(state[f"{names[p]}.{k}"])


class AdamW(NamedState, torch.optim.AdamW):
    """torch's AdamW, handing checkpoints its state by parameter names (NamedState)."""


class MuonWithAdamW(NamedState, torch.optim.Optimizer):
    """Muon (Jordan et al. 2024, "Muon: an optimizer for hidden layers") for the param groups
    marked muon=True, AdamW for the others, in one optimizer so that the loop, clipping and
    checkpoints see one `param_groups` and one `state` (keyed by parameter).

    Muon, per matrix W (m x n) with gradient G: a momentum buffer B = mu B + (1 - mu) G, the
    update O = newton_schulz((1 - mu) G + mu B) (Nesterov), i.e. that direction with every
    singular value ~1 (a step as large along rare directions as along common ones), and
    W -= lr * 0.2 * sqrt(max(m, n)) * O after decoupled weight decay. The 0.2 sqrt(max(m, n))
    gives O the RMS of a typical AdamW update (Liu et al. 2025, "Muon is scalable for LLM
    training"), so one learning rate and one schedule serve both kinds of group. It needs
    each matrix whole: with several ranks, orthogonalize is swapped for sharded_orthogonalize
    (ZeRO: zero.ZeroOptimizer's), which gathers the parts and shares the work; momentum and
    weight decay are elementwise and run on whatever part a rank holds. The AdamW groups
    follow torch.optim.AdamW (single-tensor) step by step; tests check both halves against
    torch's own optimizers."""

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0,
                 momentum=0.95,
                 ns_dtype=torch.bfloat16):
        super().__init__(params,
                         dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                              momentum=momentum, muon=False))
        self.ns_dtype = ns_dtype
        for group in self.param_groups:
            assert not group["muon"] or all(len(whole_shape(p)) in (2, 3)
                                            for p in group["params"]), \
                "Muon is for 2-D matrices (or a stack of them: a MoE layer's experts)"

    def orthogonalize(self, params, gs):
        """Newton-Schulz of each whole matrix, here. With more than one rank build_optimizer
        swaps in sharded_orthogonalize (parts gathered whole, the work shared), as tensor
        parallelism swaps the loss."""
        return newton_schulz_each(gs, self.ns_dtype)

    @torch.no_grad()
    def step(self):
        muon = []  # (matrix, its Nesterov gradient, lr): orthogonalized together after the loop
        for group in self.param_groups:
            lr, wd = group["lr"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:  # a first step starts from the zero state (full_state's, too)
                    state.update(self._first_state(group, p))
                p.mul_(1 - lr * wd)  # decoupled weight decay, as AdamW
                if group["muon"]:
                    buf, mu = state["momentum_buffer"], group["momentum"]
                    buf.lerp_(p.grad, 1 - mu)                           # B = mu B + (1 - mu) G
                    # Nesterov: (1 - mu) G + mu B
                    muon.append((p, p.grad.lerp(buf, mu), lr))
                else:
                    (beta1, beta2), step = group["betas"], state["step"].add_(1).item()
                    state["exp_avg"].lerp_(p.grad, 1 - beta1)
                    state["exp_avg_sq"].mul_(beta2).addcmul_(p.grad, p.grad, value=1 - beta2)
                    denom = (state["exp_avg_sq"].sqrt()
                             / math.sqrt(1 - beta2 ** step)).add_(group["eps"])
                    p.addcdiv_(state["exp_avg"], denom, value=-lr / (1 - beta1 ** step))
        updates = self.orthogonalize([p for p, _, _ in muon], [g for _, g, _ in muon])
        for (p, _, lr), update in zip(muon, updates):
            p.add_(update, alpha=-lr * 0.2 * math.sqrt(max(whole_shape(p)[-2:])))


def whole_shape(p):
    """The shape of the whole matrix of which p is this rank's part: a ZeRO piece names its
    parameter (_whole), a tensor-parallel slice is cut along _split_dim (an FSDP DTensor's shape
    is already its global one: the whole matrix, or the tp slice under fsdp x tp)."""
    p = getattr(p, "_whole", p)
    shape = list(p.shape)
    if hasattr(p, "_split_dim"):
        shape[p._split_dim] *= dist.get_world_size(p._split_group)
    return shape


def orthogonalize_shared(shapes, whole, part, ranks, dtype, device):
    """Muon's Newton-Schulz when matrices are spread over ranks, the way nanochat's and
    modded-nanogpt's distributed Muon do it: every rank of `ranks` holds parts of the same
    matrices (or, under plain data parallel, the same whole ones), so each whole matrix is
    orthogonalized by one of them and the results are shared. Matrix i, of shape shapes[i],
    is assembled by whole(i) (a collective every rank calls for every i, in the same order:
    FSDP's full_tensor, ZeRO's pieces summed, tp slices gathered) and this rank keeps
    part(i, update) of the result. In rounds of n (the ranks), largest matrices first, so
    each round's matrices cost about the same: rank r orthogonalizes the round's r-th, then one
    all-gather (over each group of `ranks`, innermost first) gives everyone the round's
    results. Each rank does 1/n of the work; at most a round's matrices are whole at once.
    ranks: [(process group, its size, this rank's index in it)], innermost first."""
    n, me, stride = 1, 0, 1
    for _, size, rank in ranks:
        me, stride, n = me + rank * stride, stride * size, n * size
    order = sorted(range(len(shapes)), key=lambda i: -math.prod(shapes[i]) * min(shapes[i]))
    out = [None] * len(shapes)
    for at in range(0, len(order), n):
        round_ = order[at:at + n]
        mine = None
        for r, i in enumerate(round_):
            full = whole(i)
            if r == me:
                mine = newton_schulz(full, dtype=dtype).to(full.dtype)
        # padded to the largest
        flat = torch.zeros(max(math.prod(shapes[i]) for i in round_), device=device)
        if mine is not None:
            flat[:mine.numel()] = mine.flatten()
        # every rank's result: [rank 0's, rank 1's, ...] in that order
        for group, size, _ in ranks:
            if size > 1:
                every = [torch.empty_like(flat) for _ in range(size)]
                dist.all_gather(every, flat, group=group)
                flat = torch.cat(every)
        every = flat.view(n, -1)
        for r, i in enumerate(round_):
            out[i] = part(i, every[r][:math.prod(shapes[i])].view(shapes[i]))
    return out


def sharing_ranks(mesh):
    """The ranks that hold parts of the same matrices, for orthogonalize_shared: a stage's
    tp group inside its dp group."""
    return [(mesh.tp_group, mesh.tp, mesh.tp_rank), (mesh.dp_group, mesh.dp, mesh.dp_rank)]


def sharded_orthogonalize(mesh, dtype):
    """MuonWithAdamW.orthogonalize for more than one rank: the gradient of a plain parameter is
    the same whole matrix on every dp rank (after the all-reduce); an FSDP shard (a DTensor)
    is gathered over the dp ranks, a tensor-parallel slice over the tp ranks (both, under
    fsdp x tp), and this rank keeps its part of the result. Returns the function."""
    def orthogonalize(params, gs):
        def whole(i):
            g = gs[i].full_tensor() if isinstance(gs[i], DTensor) else gs[i]
            return tp_gather(g, params[i]) if hasattr(params[i], "_split_dim") else g

        def part(i, update):
            p = params[i]
            update = tp_slice(update, p) if hasattr(p, "_split_dim") else update
            return distribute_tensor(update, p.device_mesh, p.placements, src_data_rank=None) \
                if isinstance(p, DTensor) else update
        return orthogonalize_shared([whole_shape(p) for p in params], whole, part,
                                    sharing_ranks(mesh), dtype,
                                    mesh.device)
    return orthogonalize


# ---- what train.py calls ----------------------------------------------------------------


def build_optimizer(raw_model, model, mesh, c, sharded=None):
    """(The optimizer over what trains, the parameters whose gradients clipping measures: the
    model's, or with ZeRO (`sharded`: zero.py's class, picked by train.py) this rank's slices).
    Weight decay on matrices only (2-D, and a MoE layer's 3-D stack of experts); optim=muon:
    Muon for the layers' matrices, AdamW for the embedding (at embed_lr_scale x the rate: a row
    learns only when its token appears), head and gains, and for LoRA's adapters (a rank-r
    factor is no weight matrix Muon's scaling is for)."""
    trains = [(n, p) for n, p in raw_model.named_parameters() if p.requires_grad]
    lora = len(trains) < len(list(raw_model.parameters()))  # a frozen base: LoRA
    if c["optim"] == "muon" and lora:
        mesh.print0("optim=muon with LoRA: the adapters train with AdamW (Muon is for whole "
                    "weight matrices)")
    muon = c["optim"] == "muon" and not lora
    # (3-D: a MoE layer's stacked experts)
    hidden = [p for n, p in trains if muon and p.dim() in (2, 3) and n.startswith("layers.")]
    # the head is the embedding (on the last pipeline stage: its copy)
    tied = raw_model.cfg.tie_embeddings
    embedding = [p for n, p in trains
                 if n == "tok_embeddings.weight" or (tied and n == "output.weight")]
    # the head; with optim=adamw also every layer's matrices
    decay = [p for n, p in trains if p.dim() >= 2 and all(p is not q for q in hidden + embedding)]
    # norm gains
    no_decay = [p for n, p in trains if p.dim() < 2]
    groups = [{"params": embedding, "weight_decay": c["weight_decay"],
               "lr_scale": c["embed_lr_scale"]},
              {"params": decay, "weight_decay": c["weight_decay"]},
              {"params": no_decay, "weight_decay": 0.0},
              {"params": hidden, "weight_decay": c["weight_decay"], "muon": True}]
    # a pipeline stage without the embedding, LoRA (frozen embedding)
    groups = [g for g in groups if g["params"]]
    # fused AdamW (optim=adamw, and ZeRO's): one pass over each tensor. On a CPU the default loop
    # over tensors reads and writes each weight-sized tensor ~10 times: 6x slower, at 135M
    # parameters a third of a step. (MuonWithAdamW's AdamW groups are the embedding, head and
    # gains, stepped by its own loop)
    betas, fused = ((c["beta1"], c["beta2"]),
                    mesh.device.type in ("cuda", "cpu") and not c["offload"])
    muon_kw = dict(lr=c["learning_rate"], betas=betas, momentum=c["muon_momentum"],
                   ns_dtype=torch.bfloat16 if mesh.device.type == "cuda" else torch.float32)
    # ZeRO: zero.py (AdamW / Muon on this rank's slices, then an all-gather of the updated weights)
    if sharded:
        optimizer = sharded(model, groups, c["offload"], muon_kw if muon else None,
                            lr=c["learning_rate"],
                            betas=betas, fused=fused)
        return optimizer, optimizer.params
    if muon:
        optimizer = MuonWithAdamW(groups, **muon_kw)
        if mesh.dp > 1 or mesh.tp > 1:  # parts of the matrices, or the same ones, on several ranks
            optimizer.orthogonalize = sharded_orthogonalize(mesh, optimizer.ns_dtype)
    else:
        optimizer = AdamW(groups, lr=c["learning_rate"], betas=betas, fused=fused)
    return optimizer, list(raw_model.parameters())


def get_lr(it, c):
    """The rate of iteration `it`, as train.py's lr_schedule comment says (min_lr after
    lr_decay_iters; wsd: a run can be extended by moving the cooldown)."""
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
    """A line on what the schedule does when max_iters ends inside the warmup (train.py asks only
    then)."""
    top = c["learning_rate"] * c["max_iters"] / c["warmup_iters"]
    return (f"note: max_iters={c['max_iters']} < warmup_iters={c['warmup_iters']}: the learning "
            f"rate only warms up, "
            f"to {top:.2e} at the last step (learning_rate={c['learning_rate']:.2e} is never "
            f"reached, and there is no decay); lower warmup_iters for a full schedule")


def pretrained_rate_note(c):
    """A line for a run that starts from a trained model (init_from=) at a from-scratch rate."""
    return (f"warning: learning_rate={c['learning_rate']:.0e} is a from-scratch rate and "
            f"{c['init_from']} is a trained model: it would overwrite what the model knows; start "
            f"from a continuation recipe: python train.py config/cpt.py (continued pretraining) "
            f"or config/sft.py (fine-tuning) init_from=...")
