"""
Mixture of experts, the layer: a router picks top_k of n_experts SwiGLU experts for each
token, their outputs are summed with the router's weights (and a shared expert's, gated, as
Qwen2-MoE has it). The balancing losses (Switch/GShard's, the router z-loss), DeepSeek-V3's
aux-loss-free bias, and what a run logs of them. model.py builds MoE in place of the
feed-forward of the layers ModelConfig names (n_experts, moe_every); the losses reach the
training loss through one hook on the model (attach), and the bias moves once per optimizer
step (after_step). Expert parallelism (expert_parallel.py) swaps how the experts run.
"""

import torch
import torch.nn as nn
import torch.nn.functional as F

# ---------------------------------------------------------------------------------------
# The layer (Shazeer et al. 2017; Switch, Fedus et al. 2021; Mixtral, Jiang et al. 2024).
# For the N tokens x (N, D) of a micro-batch:
#   logits = x W_r^T (N, E) in float32; scores = softmax(logits) (or sigmoid, DeepSeek-V3)
#   chosen = top_k(scores + bias)          the bias only chooses (aux-loss-free balancing)
#   w      = scores[chosen] (renormalised to sum 1 with norm_topk)
#   y_t    = sum_j w_tj * expert_{chosen_tj}(x_t)   (+ sigmoid(g . x_t) * shared(x_t))
# Dropless: every expert takes all the tokens that chose it, so a token's output is a pure
# function of the token and the weights whatever else is in the batch or on which rank the
# expert lives. The experts' weights are three 3-D parameters (E, out, in), torchtitan's
# GroupedExperts; each expert runs its tokens as one matmul, in expert order, and the k
# outputs of a token are summed in a fixed (token, k) order.
#
# Balancing. Left alone a router collapses onto a few experts. Three remedies:
#   aux  (Switch/GShard): E * sum_i f_i P_i, f_i the share of the token slots expert i got,
#        P_i its mean score; 1 when balanced. Its unit is one micro-batch (the tokens of one
#        forward), which every layout shares: never a dp rank's batch or the global batch.
#   z    (ST-MoE, Zoph et al. 2022): mean of logsumexp(logits)^2, keeps the logits small.
#   bias (DeepSeek-V3, Wang et al. 2024 "auxiliary-loss-free"): a buffer b added to the
#        scores to choose, never to weigh; after each optimizer step b_i += rate * sign(mean
#        load - load_i) (centred), from the step's counts summed over every rank that saw
#        distinct tokens, so every layout moves it alike. It is saved with the weights.


def score_fn(logits, kind):
    return logits.softmax(-1) if kind == "softmax" else logits.sigmoid()


class GroupedExperts(nn.Module):
    """n SwiGLU experts as three 3-D weights: w1, w3 (n, ffn, dim), w2 (n, dim, ffn). Under expert
    parallelism a rank holds a slice of the experts (expert_parallel.py), n of the E."""

    def __init__(self, n, dim, ffn):
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(n, ffn, dim))  # gate
        self.w3 = nn.Parameter(torch.empty(n, ffn, dim))  # up
        self.w2 = nn.Parameter(torch.empty(n, dim, ffn))  # down

    def forward(self, x, counts):
        """x (sum(counts), dim): the rows of each expert in turn, counts[e] of expert e."""
        out, start = [], 0
        for e, n in enumerate(counts.tolist()):
            h = x[start:start + n]
            out.append((F.silu(h @ self.w1[e].T) * (h @ self.w3[e].T)) @ self.w2[e].T)
            start += n
        return torch.cat(out) if out else x[:0]


def run_local(experts, x, counts):
    """All the experts are here: run them (expert_parallel.py swaps in the exchange)."""
    return experts(x, counts)


class SharedExpert(nn.Module):
    def __init__(self, dim, ffn):
        super().__init__()
        self.w1 = nn.Linear(dim, ffn, bias=False)
        self.w3 = nn.Linear(dim, ffn, bias=False)
        self.w2 = nn.Linear(ffn, dim, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class MoE(nn.Module):
    """The mixture-of-experts feed-forward of a block: (B, T, dim) -> (B, T, dim). After a
    forward, `last` holds what the hook (attach) collects: the expert counts, and the
    balancing loss and z-loss of the micro-batch (tensors in the graph)."""

    def __init__(self, cfg):
        super().__init__()
        E, dim, ffn = cfg.n_experts, cfg.n_embd, cfg.moe_ffn_dim or cfg.ffn_dim
        self.n_experts, self.top_k, self.cfg = E, cfg.moe_top_k, cfg
        self.router = nn.Linear(dim, E, bias=False)
        self.experts = GroupedExperts(E, dim, ffn)
        # a token uses top_k of the E experts (model.flops_per_token)
        for p in self.experts.parameters():
            p._active = self.top_k / E
        # Qwen2-MoE's shared expert, every token through it, with a sigmoid gate
        if cfg.moe_shared_ffn_dim:
            self.shared_expert = SharedExpert(dim, cfg.moe_shared_ffn_dim)
            self.shared_gate = nn.Linear(dim, 1, bias=False)
        # aux-loss-free balancing: chooses, never weighs
        self.register_buffer("expert_bias", torch.zeros(E))
        self.run_experts = run_local
        self.last = None

    def route(self, x):
        """x (N, dim) -> chosen experts (N, k), their weights (N, k), logits and scores (N, E),
        float32."""
        with torch.autocast(x.device.type, enabled=False):
            logits = F.linear(x.float(), self.router.weight.float())
        scores = score_fn(logits, self.cfg.moe_score)
        chosen = torch.topk(scores + self.expert_bias, self.top_k, dim=-1).indices
        weights = scores.gather(1, chosen)
        if self.cfg.moe_norm_topk:
            weights = weights / weights.sum(-1, keepdim=True)
        return chosen, weights, logits, scores

    def forward(self, x):
        B, T, D = x.shape
        x = x.reshape(-1, D)  # (N, D)
        chosen, weights, logits, scores = self.route(x)
        flat = chosen.flatten()  # (N k): token t's j-th choice at t * k + j
        counts = torch.bincount(flat, minlength=self.n_experts)
        # the token slots grouped by expert, in token order within one
        order = flat.argsort(stable=True)
        # (N k, D) in that order
        y = self.run_experts(self.experts, x[order // self.top_k], counts)
        # back to (N, k, D)
        y = torch.empty_like(y).index_copy_(0, order, y).view(-1, self.top_k, D)
        # the k outputs of a token, in k order
        out = (y * weights.unsqueeze(-1).to(y.dtype)).sum(1)
        if hasattr(self, "shared_expert"):
            out = out + torch.sigmoid(self.shared_gate(x)) * self.shared_expert(x)
        if self.training:
            self.last = (counts, *balancing_losses(logits, scores, counts, self.cfg.moe_score))
        return out.view(B, T, D)


def balancing_losses(logits, scores, counts, kind):
    """(aux, z) of one micro-batch: Switch/GShard's E * sum_i f_i P_i (f_i: expert i's share of
    the N k token slots, a count: no gradient; P_i: its mean score, normalised to sum 1 for
    sigmoid scores) and the router z-loss, mean logsumexp(logits)^2."""
    probs = scores if kind == "softmax" else scores / scores.sum(-1, keepdim=True)
    f = counts.to(probs.dtype) / counts.sum()
    aux = probs.shape[1] * (f * probs.mean(0)).sum()
    z = torch.logsumexp(logits, dim=-1).pow(2).mean()
    return aux, z


def moe_layers(model):
    """{layer name: MoE} of the layers this model (or pipeline stage) holds."""
    return {name: b.feed_forward for name, b in model.layers.items()
            if isinstance(b.feed_forward, MoE)}


# ---------------------------------------------------------------------------------------
# The run's side: the losses into the training loss, the step's statistics, the bias.


class StepStats:
    """What one optimizer step's forwards saw, per MoE layer of the model: expert counts and
    the sums of the two losses (their values: the metrics), and how many forwards."""

    def __init__(self, names, n_experts):
        self.names = names
        self.counts = torch.zeros(len(names), n_experts, dtype=torch.float64)
        self.aux = torch.zeros(len(names), dtype=torch.float64)
        self.z = torch.zeros(len(names), dtype=torch.float64)
        self.forwards = torch.zeros(len(names), dtype=torch.float64)

    def to(self, device):
        for k in ("counts", "aux", "z", "forwards"):
            setattr(self, k, getattr(self, k).to(device))


def attach(model, cfg):
    """Hooks `model` (whole, or a pipeline stage) so that each training forward adds its MoE
    layers' weighted losses, aux_weight * aux + z_weight * z, to the gradient of the loss it
    returns, and counts what they saw into model.moe_stats. The loss's value stays the plain
    cross-entropy (loss + (a - a.detach()) is loss, and its gradient includes a's), so it
    takes the micro-batch's weight in the loop like the loss. A stage without the loss
    returns its losses beside the activations (pipeline.py starts their backward)."""
    names = sorted((str(i) for i in range(cfg.n_layer) if cfg.is_moe_layer(i)), key=int)
    model.moe_stats = StepStats(names, cfg.n_experts)
    model.register_forward_hook(_after_forward)
    return model


def _after_forward(model, args, out):
    if not model.training:
        return None
    stats, cfg, extra = model.moe_stats, model.cfg, None
    for name, layer in moe_layers(model).items():
        if layer.last is None:  # (an interleaved stage's chunk runs some of its layers)
            continue
        counts, aux, z = layer.last
        layer.last = None
        row = stats.names.index(name)
        # (on the model's device: no sync per micro-batch)
        if stats.counts.device != counts.device:
            stats.to(counts.device)
        stats.counts[row] += counts
        stats.aux[row] += aux.detach()
        stats.z[row] += z.detach()
        stats.forwards[row] += 1
        if cfg.moe_aux_weight or cfg.moe_z_weight:
            term = cfg.moe_aux_weight * aux + cfg.moe_z_weight * z
            extra = term if extra is None else extra + term
    if extra is None or not extra.requires_grad:
        return None
    x, loss = out
    return (x, loss + (extra - extra.detach())) if loss is not None else (x, extra)


@torch.no_grad()
def after_step(model, mesh, stepped, distinct_group=None):
    """Once per iteration, every rank: the step's counts summed over the ranks that saw distinct
    tokens (all of them: a pipeline's stages hold different layers, zeros for the others);
    with a step taken (stepped) and moe_bias_rate, each layer's bias moves. Returns the
    metrics: per layer the max / mean of its expert counts, and the mean aux and z-loss."""
    stats, cfg = model.moe_stats, model.cfg
    local = torch.cat([stats.counts.flatten(), stats.aux, stats.z, stats.forwards])
    if mesh.backend:
        local = local.to(mesh.device)
        torch.distributed.all_reduce(local, group=distinct_group)
    n, E = stats.counts.shape
    counts, aux, z, forwards = local.cpu().split([n * E, n, n, n])
    counts = counts.view(n, E)
    device = stats.counts.device
    stats.__init__(stats.names, E)
    stats.to(device)
    if stepped and cfg.moe_bias_rate:
        for name, layer in moe_layers(model).items():
            c = counts[stats.names.index(name)]
            delta = cfg.moe_bias_rate * torch.sign(c.mean() - c)
            layer.expert_bias += (delta - delta.mean()).to(layer.expert_bias)
    load = (counts.max(1).values / counts.mean(1).clamp(min=1e-12)).tolist()
    f = forwards.clamp(min=1)
    return {"moe_aux": (aux / f).mean().item(), "moe_z": (z / f).mean().item(),
            **{f"moe_load/{name}": v for name, v in zip(stats.names, load)}}


def compact(metrics):
    """The log line's part: the aux and z-losses and the most unbalanced layer's load."""
    load = max(v for k, v in metrics.items() if k.startswith("moe_load/"))
    return f", moe aux {metrics['moe_aux']:.3f} z {metrics['moe_z']:.2f} load {load:.2f}"

