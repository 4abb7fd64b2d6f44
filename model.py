"""
A LLaMA-style decoder: token embedding -> n_layer x [RMSNorm -> grouped-query attention
with rotary positions -> residual, RMSNorm -> SwiGLU MLP -> residual] -> RMSNorm -> head.

Parameter names follow Meta's LLaMA / torchtitan (tok_embeddings, layers.{i}.attention.wq,
..., norm, output), and the layers live in a ModuleDict keyed by their global index, so a
pipeline stage that owns layers 4..7 still calls them layers.4 ... layers.7 and every
checkpoint uses the same names whatever the layout. This file knows nothing of ranks and
reads no files (checkpoint.py, hf.py and lora.py do), holds no optimizer (optim.py).
"""

import math
import zlib
from contextlib import nullcontext
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from guards.guard_errors import check
from techniques.doc_attention import Documents, document_mask
from techniques.moe import MoE

# ModelConfig.rope_type: none, or Hugging Face's (scaled_frequencies)
ROPE_TYPES = ("default", "linear", "llama3", "yarn")
# ModelConfig.hf_model_type (hf.py, hf_moe.py)
MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "mixtral", "qwen2_moe", "qwen3_moe")


@dataclass
class ModelConfig:
    vocab_size: int = 8192
    block_size: int = 256      # the longest sequence (rotary tables are built for it)
    n_layer: int = 4
    n_head: int = 4
    # < n_head: grouped-query attention, each kv head serves n_head // n_kv_head query heads
    n_kv_head: int = 4
    n_embd: int = 128
    head_dim: int = 0          # each head's width (0: n_embd // n_head; Qwen3's may differ)
    qk_norm: bool = False      # RMSNorms over each head's q and k before RoPE (Qwen3)
    # SwiGLU hidden width; 0: 8/3 * n_embd rounded up to a multiple of 32
    ffn_dim: int = 0
    dropout: float = 0.0
    tie_embeddings: bool = False
    rope_theta: float = 10000.0
    rope_type: str = "default"  # Hugging Face's rotary scaling (ROPE_TYPES)
    rope_factor: float = 1.0
    rope_low_freq: float = 1.0  # llama3: low_freq_factor
    rope_high_freq: float = 4.0  # llama3: high_freq_factor
    rope_original_len: int = 8192  # llama3, yarn: original_max_position_embeddings
    rope_beta_fast: float = 32.0  # yarn: beta_fast, beta_slow, truncate (where its ramp lies)
    rope_beta_slow: float = 1.0
    rope_truncate: bool = True
    rope_attn_factor: float = 1.0  # yarn: attention_factor, cos and sin multiplied by it
    # > 0: a token attends to itself and the sliding_window - 1 before it (Mistral)
    sliding_window: int = 0
    qkv_bias: bool = False     # biases on wq, wk, wv (Qwen2)
    # the context the model is made for (a base's max_position_embeddings; 0: block_size)
    max_position: int = 0
    hf_model_type: str = "llama"  # what an export declares: one of MODEL_TYPES (hf.py)
    norm_eps: float = 1e-5
    # > 0: NEFTune noise on the token embeddings while training (see neftune)
    neftune_alpha: float = 0.0
    # > 0: the head and the loss in chunks of this many rows (ChunkedCrossEntropy), whose
    # backward recomputes each chunk's logits, or (loss_recompute=False) keeps their softmax
    loss_chunk: int = 0
    loss_recompute: bool = True
    # attention inside each document (doc_ids): 'varlen' (each document's own) or 'dense' (a
    # (B, 1, T, T) mask, the reference): doc_attention.py
    doc_attention: str = "varlen"
    # mixture of experts (moe.py): n_experts > 0 makes every moe_every-th layer's feed-forward a
    # MoE
    n_experts: int = 0
    moe_top_k: int = 2         # experts per token
    # every moe_every-th layer is MoE (is_moe_layer; Qwen2-MoE's decoder_sparse_step)
    moe_every: int = 1
    moe_dense_layers: str = ""  # and not listed here, e.g. '0,3' (Qwen-MoE's mlp_only_layers)
    moe_ffn_dim: int = 0       # each expert's SwiGLU width (0: ffn_dim)
    # router scores: softmax (Mixtral, Qwen2-MoE) or sigmoid (DeepSeek-V3)
    moe_score: str = "softmax"
    # the top_k weights renormalised to sum 1 (Mixtral yes, Qwen2-MoE's default no)
    moe_norm_topk: bool = True
    moe_shared_ffn_dim: int = 0  # > 0: a shared expert of this width, sigmoid-gated (Qwen2-MoE)
    moe_aux_weight: float = 0.01  # Switch/GShard load-balancing loss weight
    moe_z_weight: float = 0.0  # router z-loss weight
    moe_bias_rate: float = 0.0  # DeepSeek-V3's aux-loss-free bias: its step per optimizer step

    def __post_init__(self):  # the shape's rules, said once: the config's check builds one too
        check(self.head_dim or self.n_embd % self.n_head == 0,
              f"n_embd={self.n_embd} is not divisible by n_head={self.n_head}: make n_embd a "
              f"multiple of n_head")
        check(self.n_head % self.n_kv_head == 0,
              f"n_head={self.n_head} is not divisible by n_kv_head={self.n_kv_head}: each "
              "key/value head serves a whole group of query heads; use a divisor of n_head")
        self.head_dim = self.head_dim or self.n_embd // self.n_head
        check(self.head_dim % 2 == 0,
              f"head_dim={self.head_dim} (n_embd / n_head = {self.n_embd} / {self.n_head} unless "
              f"given) is odd: rotary positions rotate pairs of features; change n_embd, n_head "
              f"or head_dim")
        check(0 < self.head_dim <= 2 ** 16, f"head_dim={self.head_dim} is not in [1, 65536]")
        check(self.rope_type != "yarn" or self.rope_beta_fast > 0 and self.rope_beta_slow > 0,
              f"rope_beta_fast={self.rope_beta_fast}, rope_beta_slow={self.rope_beta_slow}: "
              f"YaRN's betas are positive")
        self.ffn_dim = self.ffn_dim or 32 * math.ceil(8 * self.n_embd / 3 / 32)

    def is_moe_layer(self, i):
        """Layer i's feed-forward is a mixture of experts (moe.py): every moe_every-th, the last of
        each group, as Qwen2-MoE's decoder_sparse_step counts, unless moe_dense_layers lists it."""
        dense = self.moe_dense_layers.split(",")
        return self.n_experts > 0 and (i + 1) % self.moe_every == 0 and str(i) not in dense


class RMSNorm(nn.Module):
    def __init__(self, dim, eps):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        # normalise in float32 even under bf16 autocast: the mean of squares loses too much in bf16
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return xf.type_as(x) * self.weight


def rope_tables(head_dim, block_size, theta, cfg=None):
    """cos/sin of shape (block_size, head_dim) in the "rotate half" layout that Hugging Face's
    LlamaForCausalLM uses: frequency j drives dims j and j + head_dim/2 (not interleaved pairs).
    Using HF's layout means HF q/k weights load without a permutation. cfg: its rotary scaling
    (YaRN's also scales cos and sin, by rope_attn_factor: 1 elsewhere)."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    inv_freq = (inv_freq if cfg is None or cfg.rope_type == "default"
                else scaled_frequencies(inv_freq, cfg))
    # (T, head_dim/2)
    angles = torch.outer(torch.arange(block_size, dtype=torch.float32), inv_freq)
    angles = torch.cat([angles, angles], dim=-1)                                  # (T, head_dim)
    scale = cfg.rope_attn_factor if cfg is not None and cfg.rope_type == "yarn" else 1.0
    return angles.cos() * scale, angles.sin() * scale


def scaled_frequencies(inv_freq, cfg):
    """The inverse frequencies as transformers' modeling_rope_utils scales them. 'linear': all
    divided by rope_factor (positions interpolated). 'llama3': only the slow ones, whose
    wavelength is longer than rope_original_len / rope_low_freq; those shorter than
    rope_original_len / rope_high_freq are kept; in between a linear blend of the two. 'yarn'
    (arXiv:2309.00071): the same three parts, their bounds the dims that turn rope_beta_fast
    and rope_beta_slow times over rope_original_len positions, the blend linear in the dim."""
    if cfg.rope_type == "linear":
        return inv_freq / cfg.rope_factor
    if cfg.rope_type == "yarn":
        return yarn_frequencies(inv_freq, cfg)
    # (hf.py and guard_ckpt.py check)
    assert cfg.rope_type == "llama3" and cfg.rope_low_freq < cfg.rope_high_freq, cfg
    wavelen = 2 * math.pi / inv_freq
    smooth = ((cfg.rope_original_len / wavelen - cfg.rope_low_freq)
              / (cfg.rope_high_freq - cfg.rope_low_freq))
    blend = (1 - smooth) * inv_freq / cfg.rope_factor + smooth * inv_freq
    slow = wavelen > cfg.rope_original_len / cfg.rope_low_freq
    fast = wavelen < cfg.rope_original_len / cfg.rope_high_freq
    return torch.where(slow, inv_freq / cfg.rope_factor, torch.where(fast, inv_freq, blend))


def yarn_frequencies(inv_freq, cfg):
    """YaRN's inverse frequencies, as transformers' _compute_yarn_parameters computes them."""
    dim, base = 2 * len(inv_freq), cfg.rope_theta

    def turns_dim(turns):  # the dim whose frequency turns `turns` times over the original context
        return dim * math.log(cfg.rope_original_len / (turns * 2 * math.pi)) / (2 * math.log(base))
    low, high = turns_dim(cfg.rope_beta_fast), turns_dim(cfg.rope_beta_slow)
    if cfg.rope_truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    span = high - low if high != low else 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / span).clamp(0, 1)
    return inv_freq / cfg.rope_factor * ramp + inv_freq * (1 - ramp)


def apply_rope(x, cos, sin):
    # x: (B, n_head, T, head_dim); cos/sin: (T, head_dim)
    x1, x2 = x.chunk(2, dim=-1)
    rotated = torch.cat([-x2, x1], dim=-1)
    return (x.float() * cos + rotated.float() * sin).type_as(x)


class KVCache:
    """The keys and values of one attention layer for the tokens generated so far, after RoPE
    and before GQA's repeat: k, v (B, n_kv_head, T, head_dim). Grown by concatenation (one copy
    per token: cheap next to the forward at these lengths, and nothing to size in advance)."""

    def __init__(self):
        self.k = self.v = None

    def __len__(self):
        return 0 if self.k is None else self.k.shape[2]

    def append(self, k, v):
        self.k = k if self.k is None else torch.cat([self.k, k], dim=2)
        self.v = v if self.v is None else torch.cat([self.v, v], dim=2)
        return self.k, self.v

    def extend(self, k, v, mask):
        """Attention.forward's keys and values (after RoPE) for T new tokens: appended, and
        (keys, values, mask, is_causal) for SDPA over all the tokens so far. mask: None, or a
        sliding window's (T, past + T) (Transformer.forward), which covers the earlier keys."""
        past, T = len(self), k.shape[2]
        k, v = self.append(k, v)  # (B, n_kv_head, past + T, head_dim)
        if mask is not None:
            return k, v, mask, False
        if not past:
            return k, v, None, True
        # SDPA's is_causal aligns the mask top-left, i.e. as if x started at position 0; the new
        # queries sit at past..past+T-1 and see every key up to their own position. One new
        # token, the usual case, sees them all: no mask at all.
        mask = (torch.ones(T, past + T, dtype=torch.bool, device=k.device).tril(diagonal=past)
                if T > 1 else None)
        return k, v, mask, False


def attend(q, k, v, mask, is_causal, dropout, gqa, recompute):
    """SDPA. A workaround for one machine, as those of workarounds.py (a fork may drop it): under
    a CPU's bf16 autocast it runs in float32 (flash-cpu's bf16 backward is ~20x slower at small
    heads), and with recompute keeping only the bf16 q, k, v for backward, where it runs again:
    float32 ones are twice what transformers keeps (docs/benchmarks.md, bench real)."""
    f32 = torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == torch.bfloat16
    if f32 and recompute and torch.is_grad_enabled():
        return checkpoint(attend, q, k, v, mask, is_causal, dropout, gqa, False,
                          use_reentrant=False)
    with torch.autocast("cpu", enabled=False) if f32 else nullcontext():
        return F.scaled_dot_product_attention(*(t.float() if f32 else t for t in (q, k, v)),
                                              attn_mask=mask,
                                              is_causal=is_causal, dropout_p=dropout,
                                              enable_gqa=gqa)


class Attention(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.head_dim = cfg.head_dim
        self.wq = nn.Linear(cfg.n_embd, cfg.n_head * self.head_dim, bias=cfg.qkv_bias)
        self.wk = nn.Linear(cfg.n_embd, cfg.n_kv_head * self.head_dim, bias=cfg.qkv_bias)
        self.wv = nn.Linear(cfg.n_embd, cfg.n_kv_head * self.head_dim, bias=cfg.qkv_bias)
        self.wo = nn.Linear(cfg.n_head * self.head_dim, cfg.n_embd, bias=False)
        if cfg.qk_norm:  # Qwen3: each head's q and k normalised over its channels, one gain
            self.q_norm = RMSNorm(self.head_dim, cfg.norm_eps)
            self.k_norm = RMSNorm(self.head_dim, cfg.norm_eps)
        self.dropout = cfg.dropout
        # (off where the whole block is recomputed already: activations.py)
        self.recompute = True

    def heads(self, x):
        """q (B, n_head, T, head_dim), k and v (B, n_kv_head, T, head_dim) of x (B, T, n_embd),
        before RoPE."""
        B, T, C = x.shape
        # the head counts come from the shapes: under tensor parallelism (tensor_parallel.py) wq,
        # wk, wv produce only some whole heads, n_head / tp and n_kv_head / tp of them
        q, k, v = (w(x).view(B, T, -1, self.head_dim) for w in (self.wq, self.wk, self.wv))
        if hasattr(self, "q_norm"):
            q, k = self.q_norm(q), self.k_norm(k)
        return q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)

    def forward(self, x, cos, sin, mask=None, cache=None):
        # mask: None (plain causal), a packed row's Documents, or boolean: a window's (T, past + T)
        # or (B, 1, T, T), True where attending is allowed. cache: generation's KVCache of the
        # tokens before x (KVCache.extend)
        B, T, C = x.shape
        q, k, v = self.heads(x)
        n_head, n_kv_head = q.shape[1], k.shape[1]
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        is_causal = mask is None
        if cache is not None:  # generation (sample.py): the earlier tokens' keys and values too
            k, v, mask, is_causal = cache.extend(k, v, mask)
        dropout = self.dropout if self.training else 0.0
        if isinstance(mask, Documents):  # attention inside each document (doc_attention.py)
            y = mask.attend(q, k, v, lambda q, k, v, m: attend(
                q, k, v, m, m is None, dropout, k.shape[1] != q.shape[1], self.recompute))
        else:
            # GQA: each kv head is shared by a group of n_head // n_kv_head query heads. Without a
            # mask SDPA's flash kernels read the groups in place (enable_gqa); CUDA's kernel for
            # masks needs equal head counts, so with one k and v are repeated (kept for backward)
            gqa = n_kv_head != n_head and mask is None
            if n_kv_head != n_head and not gqa:
                k = k.repeat_interleave(n_head // n_kv_head, dim=1)
                v = v.repeat_interleave(n_head // n_kv_head, dim=1)
            y = attend(q, k, v, mask, is_causal, dropout, gqa, self.recompute)
        return self.wo(y.transpose(1, 2).reshape(B, T, n_head * self.head_dim))


class FeedForward(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.w1 = nn.Linear(cfg.n_embd, cfg.ffn_dim, bias=False)  # gate
        self.w3 = nn.Linear(cfg.n_embd, cfg.ffn_dim, bias=False)  # up
        self.w2 = nn.Linear(cfg.ffn_dim, cfg.n_embd, bias=False)  # down

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, cfg, layer=0):
        super().__init__()
        self.attention_norm = RMSNorm(cfg.n_embd, cfg.norm_eps)
        self.attention = Attention(cfg)
        self.ffn_norm = RMSNorm(cfg.n_embd, cfg.norm_eps)
        self.feed_forward = MoE(cfg) if cfg.is_moe_layer(layer) else FeedForward(cfg)  # (moe.py)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x, cos, sin, mask=None, cache=None):
        x = x + self.drop(self.attention(self.attention_norm(x), cos, sin, mask, cache))
        return x + self.drop(self.feed_forward(self.ffn_norm(x)))


def param_seed(seed, name):
    """The seed of parameter `name`'s own generator: a weight's initial value depends on the
    run's seed and its name only, not on which other weights this process builds (a pipeline
    stage, a shard) or in what order. 32 bits: all torch's CPU generator keeps of a seed."""
    return zlib.crc32(f"{seed}/{name}".encode())


def init_tensor(name, shape, n_layer, seed):
    """The initial value of parameter `name` (a float32 CPU tensor of the full `shape`: a rank
    that holds a slice draws it whole), the same bits on every device and layout. GPT-2 style:
    N(0, 0.02), norms 1, and the projections into the residual stream (wo, w2) scaled by
    1/sqrt(2 * n_layer) so that the residual's variance does not grow with depth; biases 0."""
    if name.endswith(("norm.weight", ".bias")):
        return (torch.zeros if name.endswith(".bias") else torch.ones)(shape, device="cpu")
    std = (0.02 / math.sqrt(2 * n_layer) if name.endswith(("wo.weight", "w2.weight", "experts.w2"))
           else 0.02)
    return torch.empty(shape, device="cpu").normal_(
        0.0, std, generator=torch.Generator().manual_seed(param_seed(seed, name)))


def attention_mask(cfg, start, T, doc_ids, device):
    """The mask a forward needs beyond SDPA's own causal one. A sliding window shorter than the
    keys (Mistral's, as transformers builds it): the query at position start + i sees key j iff
    start + i - window < j <= start + i, boolean (T, start + T), or (B, 1, T, T) with a packed
    row's documents (start 0). Documents alone (doc_attention.py): each document's own attention,
    or the dense mask (the reference; under torch.compile, where the documents' lengths, new in
    every batch, would compile again)."""
    if 0 < cfg.sliding_window < start + T:
        q = torch.arange(start, start + T, device=device)[:, None]
        k = torch.arange(start + T, device=device)[None]
        window = (k <= q) & (k > q - cfg.sliding_window)
        return window if doc_ids is None else document_mask(doc_ids) & window
    return Documents(doc_ids, cfg.doc_attention == "dense" or torch.compiler.is_compiling())


class Transformer(nn.Module):
    def __init__(self, cfg, seed=0):  # seed: the run's (init_weights)
        super().__init__()
        self.cfg = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.drop = nn.Dropout(cfg.dropout)
        self.layers = nn.ModuleDict({str(i): Block(cfg, i) for i in range(cfg.n_layer)})
        self.norm = RMSNorm(cfg.n_embd, cfg.norm_eps)
        self.output = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        # each target's loss from (final hidden states, head, targets, chunk); tensor parallelism
        # swaps in one that works on a vocabulary slice (tensor_parallel.vocab_parallel_losses)
        self.loss_fn = cross_entropy_losses
        self.chunks = None  # an interleaved pipeline stage's layers, chunk by chunk (pipeline.py)
        self.init_rope()
        # on the meta device there is nothing to fill (meta_build.py fills the shards)
        if not self.norm.weight.is_meta:
            self.init_weights(seed)

    def init_rope(self, device=None):
        """(Re)computes the rotary tables: after a build on the meta device they are empty."""
        cfg = self.cfg
        cos, sin = rope_tables(cfg.head_dim, cfg.block_size, cfg.rope_theta, cfg)
        # not persistent: derived from the config, so checkpoints hold only learned weights
        self.register_buffer("rope_cos", cos.to(device), persistent=False)
        self.register_buffer("rope_sin", sin.to(device), persistent=False)

    @torch.no_grad()
    def init_weights(self, seed):
        """Every parameter from init_tensor, seeded by (seed, its name): `Transformer(cfg, s)` is
        train.py's model for seed=s on any layout (meta_build.init_weights gives a shard the
        same bits)."""
        for name, p in self.named_parameters():
            p.copy_(init_tensor(name, p.shape, self.cfg.n_layer, seed))

    def forward(self, idx, targets=None, loss_mask=None, doc_ids=None, cache=None, chunk=None):
        """idx, targets, loss_mask, doc_ids (a packed row's documents): (B, T). Returns (logits
        (B, T, vocab), None) without targets; with them (each target's cross-entropy (B, T),
        their mean where loss_mask is 1). cache: generate's {layer name: KVCache}. A pipeline
        stage may lack the embedding or head; chunk=c runs an interleaved stage's c-th chunk."""
        T = idx.shape[1]
        start = len(next(iter(cache.values()))) if cache else 0  # the position of idx[:, 0]
        if start + T > self.cfg.block_size:
            raise ValueError(f"sequence of length {start + T} is longer than "
                             f"block_size={self.cfg.block_size}")
        cos, sin = self.rope_cos[start:start + T], self.rope_sin[start:start + T]
        # None: SDPA's own causal mask; a window shorter than the keys, or a packed row's documents
        # (doc_attention.py), need their own
        needs = 0 < self.cfg.sliding_window < start + T or doc_ids is not None
        mask = attention_mask(self.cfg, start, T, doc_ids, idx.device) if needs else None
        names = list(self.layers) if chunk is None else [str(i) for i in self.chunks[chunk]]
        if self.tok_embeddings is not None and not chunk:  # chunk None or 0
            x = self.tok_embeddings(idx)  # (B, T, n_embd)
            if self.training and self.cfg.neftune_alpha > 0:  # NEFTune: neftune below
                x = neftune(x, self.cfg.neftune_alpha)
            x = self.drop(x)
        else:
            x = idx  # (B, T, n_embd): the previous stage's hidden states
        for name in names:
            x = self.layers[name](x, cos, sin, mask, cache[name] if cache else None)
        if self.output is None or (chunk is not None and chunk < len(self.chunks) - 1):
            return x, None
        h = self.norm(x)
        if targets is None:  # generation, inference: the logits (B, T, vocab)
            return self.output(h).float(), None
        # (B, T); the softmax kept only for a backward to come (not in evaluation's no_grad)
        keep = not self.cfg.loss_recompute and torch.is_grad_enabled()
        losses = self.loss_fn(h, self.output, targets, self.cfg.loss_chunk, keep)
        return losses, masked_mean(losses, loss_mask)

    def num_params(self):
        return sum(p.numel() for p in self.parameters())

    def flops_per_token(self):
        """Training FLOPs per token, PaLM appendix B: 6 per weight in a matmul (not the embedding
        lookup; a tied table once, as the head; a frozen weight 4: no gradient of its own), plus
        the attention scores and values, 12 * n_layer * n_head * head_dim * block_size."""
        emb = self.tok_embeddings.weight
        matmul = [p for p in self.parameters() if p is not emb or self.cfg.tie_embeddings]
        # (moe.py)
        n = sum((6 if p.requires_grad else 4) * p.numel() * getattr(p, "_active", 1)
                for p in matmul)
        cfg = self.cfg
        return n + 12 * cfg.n_layer * cfg.n_head * cfg.head_dim * cfg.block_size

    @torch.no_grad()
    def generate(self, idx, max_new_tokens, temperature=1.0, top_k=None, kv_cache=True):
        """Appends max_new_tokens sampled tokens to idx (B, T) (temperature 0: greedy).

        The model sees at most the last block_size tokens, at positions 0..block_size-1.
        Without kv_cache every step re-runs that window. With it (the default) the first step
        runs the window and keeps each layer's keys and values, and every later step runs only
        the new token, at the next position, against them. Once the context outgrows
        block_size the window slides, which moves every token's position, so the cached keys
        (rotated for their old positions) no longer fit: from there each step re-runs the
        window, as without the cache. Both ways compute the same logits (up to float rounding),
        so the same seed samples the same tokens."""
        block_size, cache = self.cfg.block_size, None
        for _ in range(max_new_tokens):
            if not kv_cache:
                logits, _ = self(idx[:, -block_size:])
            # the first step, or a full window
            elif cache is None or len(cache[next(iter(cache))]) == block_size:
                cache = {name: KVCache() for name in self.layers}
                logits, _ = self(idx[:, -block_size:], cache=cache)
            else:
                logits, _ = self(idx[:, -1:], cache=cache)
            logits = logits[:, -1, :]
            if temperature == 0:
                nxt = logits.argmax(-1, keepdim=True)
            else:
                # the best logit at 0 first: a tiny temperature then tends to greedy, not to nan
                logits = (logits - logits.amax(-1, keepdim=True)) / temperature
                if top_k:
                    kth = torch.topk(logits, min(top_k, logits.size(-1))).values[:, [-1]]
                    logits = logits.masked_fill(logits < kth, float("-inf"))
                nxt = torch.multinomial(F.softmax(logits, dim=-1), num_samples=1)
            idx = torch.cat([idx, nxt], dim=1)
        return idx


def grow_vocab(model, new_vocab_size):
    """Grows the embedding and the head of `model` (a whole model or a pipeline stage, which
    grows what it has) to new_vocab_size rows, in place: e.g. for a tokenizer with added
    tokens. The old rows are kept as they are; each new row starts as the mean of the old rows
    of its matrix, so a new token starts as an "average" token instead of a random one with a
    large logit. Tied embeddings stay one table. Build the optimizer after this: the grown
    weights are new Parameters."""
    old = model.cfg.vocab_size
    if new_vocab_size < old:
        raise ValueError(f"grow_vocab: new_vocab_size={new_vocab_size} is smaller than "
                         f"vocab_size={old}")
    if new_vocab_size == old:
        return model

    def grown(w):  # (old, n_embd) -> (new_vocab_size, n_embd)
        mean = w.float().mean(0, keepdim=True).to(w.dtype)
        return nn.Parameter(torch.cat([w, mean.expand(new_vocab_size - old, -1)]),
                            requires_grad=w.requires_grad)

    if model.tok_embeddings is not None:
        model.tok_embeddings.weight = grown(model.tok_embeddings.weight)
        model.tok_embeddings.num_embeddings = new_vocab_size
    if model.output is not None:
        if model.cfg.tie_embeddings and model.tok_embeddings is not None:
            model.output.weight = model.tok_embeddings.weight
        else:
            model.output.weight = grown(model.output.weight)
        model.output.out_features = new_vocab_size
    model.cfg.vocab_size = new_vocab_size
    return model


def neftune(x, alpha):
    """NEFTune (arXiv:2310.05914): uniform noise on the embeddings x (B, T, n_embd), its norm
    independent of T and width."""
    return x + torch.empty_like(x).uniform_(-1, 1) * (alpha / math.sqrt(x.shape[1] * x.shape[2]))


def masked_mean(losses, loss_mask=None):
    """The mean of losses (B, T) over the positions whose mask is 1; without a mask, over all."""
    if loss_mask is None:
        return losses.mean()
    mask = loss_mask.to(losses.dtype)
    # clamp: no target tokens give 0, not NaN
    return (losses * mask).sum() / mask.sum().clamp(min=1)


def cross_entropy_losses(h, head, targets, chunk=0, keep=False):
    """Each target's cross-entropy (B, T) under the logits head(h): all logits at once
    (chunk=0: B x T x vocab floats), or ChunkedCrossEntropy's chunks of rows (keep: see there)."""
    if not chunk:
        logits = head(h).float()
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten(),
                               reduction="none").view(targets.shape)
    return chunked_losses(h, head, targets, chunk, keep=keep)


def chunked_losses(h, head, targets, chunk, vocab=None, keep=False):
    """ChunkedCrossEntropy of the head over h (B, T, width): each target's loss (B, T). The head
    gives its (input, weight) pairs: its own weight, and a LoRA head's adapter path too
    (lora.LoRALinear.pairs). vocab, keep: see ChunkedCrossEntropy."""
    x = h.flatten(0, 1)
    pairs = head.pairs(x) if hasattr(head, "pairs") else [(x, head.weight)]
    return ChunkedCrossEntropy.apply(targets.flatten(), chunk, vocab, keep,
                                     *(t for pair in pairs for t in pair)).view(
        targets.shape)


def _matmul_weights(ws, dev):
    """The head's weights as autocast's matmuls take them, cast once for all the chunks: autocast
    would cast a float32 weight again at each chunk's matmul (at SmolLM2's 49k x 576 head, in 4
    chunks, a third of the head's time went to those copies)."""
    if not torch.is_autocast_enabled(dev):
        return ws
    return [w.to(torch.get_autocast_dtype(dev)) for w in ws]


def _logits(xs, ws, a, b, out=None):
    """Rows a:b of the logits sum_i xs[i] @ ws[i].T, in float32 (written into `out` if given)."""
    if out is not None and xs[0].dtype == ws[0].dtype == torch.float32:
        torch.matmul(xs[0][a:b], ws[0].T, out=out)
    elif out is not None:
        out.copy_(xs[0][a:b] @ ws[0].T)
    else:
        out = (xs[0][a:b] @ ws[0].T).float()
    for x, w in zip(xs[1:], ws[1:]):
        out += (x[a:b] @ w.T).float()
    return out


class ChunkedCrossEntropy(torch.autograd.Function):
    """Each row's cross-entropy under logits = sum_i x_i @ w_i.T (the head), computed `chunk`
    rows at a time, so that at most chunk x vocab logits exist at once (not rows x vocab: with
    a 128k vocabulary the largest tensor of a step); backward recomputes each chunk's logits
    (one more head matmul) instead of keeping them, or with `keep` keeps every row's softmax
    (rows x vocab floats, once, where F.cross_entropy keeps logits and log-softmax) and runs its
    backward on all rows at once, in place: no recompute.
    apply(targets (N,), chunk, vocab, keep, x_1, w_1, x_2, w_2, ...) -> (N,).
    vocab: None (all of the vocabulary here), or (start, reduce_max, reduce_sum) for a
    vocabulary slice from row `start` whose row maxima and sums the two callables reduce in
    place over the other slices (tensor_parallel.vocab_parallel_losses)."""

    @staticmethod
    def forward(ctx, targets, chunk, vocab, keep, *xw):
        xs, ws = xw[0::2], xw[1::2]
        dev = xs[0].device.type  # backward recomputes the logits under the same autocast as here
        ctx.autocast = (dev, torch.get_autocast_dtype(dev), torch.is_autocast_enabled(dev))
        local = targets - (vocab[0] if vocab else 0)
        mine = (local >= 0) & (local < ws[0].shape[0])  # is the target's row in this slice?
        local = local.masked_fill(~mine, 0)
        mm = _matmul_weights(ws, dev)
        # log-sum-exp per row
        lse = torch.empty(targets.shape[0], dtype=torch.float32, device=targets.device)
        # the target's logit
        picked = torch.empty_like(lse)
        # keep: each row's softmax, for backward
        kept = lse.new_empty((targets.shape[0], ws[0].shape[0]) if keep else (0,))
        for a in range(0, targets.shape[0], chunk):
            b = min(a + chunk, targets.shape[0])
            logits = _logits(xs, mm, a, b, kept[a:b] if keep else None)  # (chunk, vocab)
            picked[a:b] = logits.gather(1, local[a:b, None])[:, 0].masked_fill(~mine[a:b], 0.0)
            if not vocab:
                lse[a:b] = torch.logsumexp(logits, dim=-1)
                if keep:  # (logits is kept[a:b])
                    logits.sub_(lse[a:b, None]).exp_()
                continue
            top = logits.max(dim=-1).values
            vocab[1](top)
            both = torch.stack([logits.sub_(top[:, None]).exp_().sum(-1), picked[a:b]])
            vocab[2](both)
            lse[a:b], picked[a:b] = top + both[0].log(), both[1]
            if keep:  # (logits is kept[a:b], holding exp(logits - top) now)
                logits.div_(both[0][:, None])
        valid = targets != -100  # F.cross_entropy's ignore_index: no loss, no gradient
        ctx.save_for_backward(local, mine & valid, lse, valid, kept, *xw)
        ctx.chunk, ctx.keep = chunk, keep
        return (lse - picked).masked_fill(~valid, 0.0)

    @staticmethod
    def backward(ctx, grad):
        dev, dtype, enabled = ctx.autocast
        with torch.autocast(dev, dtype=dtype, enabled=enabled):
            return ChunkedCrossEntropy._backward(ctx, grad, enabled)

    @staticmethod
    def _backward(ctx, grad, autocast_on):
        local, mine, lse, valid, kept, *xw = ctx.saved_tensors
        grad = grad * valid.to(grad.dtype)
        xs, ws = xw[0::2], xw[1::2]
        mm = _matmul_weights(ws, ctx.autocast[0])
        need = ctx.needs_input_grad[4:]
        gx = [torch.zeros_like(x) if need[2 * i] else None for i, x in enumerate(xs)]
        gw = [torch.zeros_like(w, dtype=torch.float32) if need[2 * i + 1] else None
              for i, w in enumerate(ws)]
        # the kept softmax: all rows at once, turned into the gradient in place (a second backward
        # is refused by autograd: the saved tensor changed)
        rows = local.shape[0] if ctx.keep else ctx.chunk
        for a in range(0, local.shape[0], rows):
            b = min(a + rows, local.shape[0])
            # softmax, minus 1 at the target, times grad
            g = kept if ctx.keep else _logits(xs, mm, a, b).sub_(lse[a:b, None]).exp_()
            g[torch.arange(b - a, device=g.device), local[a:b]] -= mine[a:b].to(g.dtype)
            g.mul_(grad[a:b, None])
            for i, (x, w) in enumerate(zip(xs, mm)):
                if gx[i] is not None:
                    gx[i][a:b] = (g.to(w.dtype) @ w).to(x.dtype)
                if gw[i] is not None and not autocast_on:
                    gw[i].addmm_(g.T, x[a:b].to(g.dtype))
                elif gw[i] is not None:  # (an in-place addmm_ would leave autocast's dtype)
                    gw[i] += (g.T @ x[a:b]).float()
        return (None, None, None, None,
                *(t for i in range(len(xs))
                  for t in (gx[i], None if gw[i] is None else gw[i].to(ws[i].dtype))))
