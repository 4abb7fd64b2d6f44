"""
A LLaMA-style decoder: token embedding -> n_layer x [RMSNorm -> grouped-query attention
with rotary positions -> residual, RMSNorm -> SwiGLU MLP -> residual] -> RMSNorm -> head.

Parameter names follow Meta's LLaMA / torchtitan (tok_embeddings, layers.{i}.attention.wq,
..., norm, output), and the layers live in a ModuleDict keyed by their global index, so a
pipeline stage that owns layers 4..7 still calls them layers.4 ... layers.7 and every
checkpoint uses the same names whatever the layout. This file knows nothing of ranks and
reads no files (checkpoint.py does: our checkpoints, safetensors, Hugging Face LLaMA, PEFT).
"""

import math
import time
import zlib
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.utils.checkpoint import checkpoint


@dataclass
class ModelConfig:
    vocab_size: int = 8192
    block_size: int = 256      # the longest sequence (rotary tables are built for it)
    n_layer: int = 4
    n_head: int = 4
    n_kv_head: int = 4         # < n_head: grouped-query attention, each kv head serves n_head // n_kv_head query heads
    n_embd: int = 128
    ffn_dim: int = 0           # SwiGLU hidden width; 0: 8/3 * n_embd rounded up to a multiple of 32
    dropout: float = 0.0
    tie_embeddings: bool = False
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    grad_ckpt: bool = False    # recompute each block in backward instead of keeping its activations
    neftune_alpha: float = 0.0  # > 0: NEFTune noise on the token embeddings while training (see forward)

    def __post_init__(self):
        if self.n_embd % self.n_head:
            raise ValueError(f"n_embd={self.n_embd} must be divisible by n_head={self.n_head}")
        if self.n_head % self.n_kv_head:
            raise ValueError(f"n_head={self.n_head} must be divisible by n_kv_head={self.n_kv_head}")
        if (self.n_embd // self.n_head) % 2:
            raise ValueError(f"head_dim={self.n_embd // self.n_head} must be even for rotary embeddings")
        if self.ffn_dim == 0:
            self.ffn_dim = 32 * math.ceil(8 * self.n_embd / 3 / 32)


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


def rope_tables(head_dim, block_size, theta):
    """cos/sin of shape (block_size, head_dim) in the "rotate half" layout that Hugging Face's
    LlamaForCausalLM uses: frequency j drives dims j and j + head_dim/2 (not interleaved pairs).
    Using HF's layout means HF q/k weights load without a permutation."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    angles = torch.outer(torch.arange(block_size, dtype=torch.float32), inv_freq)  # (T, head_dim/2)
    angles = torch.cat([angles, angles], dim=-1)                                  # (T, head_dim)
    return angles.cos(), angles.sin()


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


class Attention(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.head_dim = cfg.n_embd // cfg.n_head
        self.wq = nn.Linear(cfg.n_embd, cfg.n_head * self.head_dim, bias=False)
        self.wk = nn.Linear(cfg.n_embd, cfg.n_kv_head * self.head_dim, bias=False)
        self.wv = nn.Linear(cfg.n_embd, cfg.n_kv_head * self.head_dim, bias=False)
        self.wo = nn.Linear(cfg.n_head * self.head_dim, cfg.n_embd, bias=False)
        self.dropout = cfg.dropout

    def forward(self, x, cos, sin, mask=None, cache=None):
        # mask: None (plain causal) or a boolean (B, 1, T, T), True where attending is allowed.
        # cache: a KVCache holding the keys/values of the tokens before x (whose positions
        # cos/sin continue), to which x's are appended; x's queries attend to all of them.
        B, T, C = x.shape
        q, k, v = self.wq(x), self.wk(x), self.wv(x)
        # the head counts come from the shapes: under tensor parallelism (parallel.py) wq, wk,
        # wv produce only some whole heads, n_head / tp and n_kv_head / tp of them
        n_head, n_kv_head = q.shape[-1] // self.head_dim, k.shape[-1] // self.head_dim
        q = q.view(B, T, n_head, self.head_dim).transpose(1, 2)     # (B, n_head, T, head_dim)
        k = k.view(B, T, n_kv_head, self.head_dim).transpose(1, 2)  # (B, n_kv_head, T, head_dim)
        v = v.view(B, T, n_kv_head, self.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        is_causal = mask is None
        if cache is not None:
            assert mask is None, "a KV cache is for generation, which has no document mask"
            past = len(cache)
            k, v = cache.append(k, v)  # (B, n_kv_head, past + T, head_dim)
            if past:
                # SDPA's is_causal aligns the mask top-left, i.e. as if x started at position 0;
                # the new queries sit at past..past+T-1 and see every key up to their own
                # position. One new token, the usual case, sees them all: no mask at all.
                is_causal = False
                if T > 1:
                    mask = torch.ones(T, past + T, dtype=torch.bool, device=x.device).tril(diagonal=past)
        if n_kv_head != n_head:
            # GQA: each kv head is shared by a group of n_head // n_kv_head query heads
            k = k.repeat_interleave(n_head // n_kv_head, dim=1)
            v = v.repeat_interleave(n_head // n_kv_head, dim=1)
        # on CUDA with bf16 this dispatches to flash attention (without a mask); on CPU to the
        # math/flash-cpu kernel
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal,
                                           dropout_p=self.dropout if self.training else 0.0)
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
    def __init__(self, cfg):
        super().__init__()
        self.attention_norm = RMSNorm(cfg.n_embd, cfg.norm_eps)
        self.attention = Attention(cfg)
        self.ffn_norm = RMSNorm(cfg.n_embd, cfg.norm_eps)
        self.feed_forward = FeedForward(cfg)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x, cos, sin, mask=None, cache=None):
        x = x + self.drop(self.attention(self.attention_norm(x), cos, sin, mask, cache))
        return x + self.drop(self.feed_forward(self.ffn_norm(x)))


def param_seed(seed, name):
    """The seed of parameter `name`'s own generator: a weight's initial value depends on the
    run's seed and its name only, not on which other weights this process builds (a pipeline
    stage, a shard) or in what order. 32 bits: torch's CPU generator (mt19937) keeps only the
    low 32 bits of a seed, so (seed << 32) ^ crc32(name), LoRA's first recipe, ignored the seed."""
    return zlib.crc32(f"{seed}/{name}".encode())


def init_tensor(name, shape, n_layer, seed):
    """The initial value of parameter `name` (a float32 CPU tensor of the full `shape`), drawn
    on the CPU so every device and layout gets the same bits. GPT-2 style: N(0, 0.02)
    everywhere, norms 1, and the two projections that write into the residual stream (wo,
    w2) scaled by 1/sqrt(2 * n_layer) so that the residual's variance does not grow with depth.
    A rank that holds a slice of the parameter draws it whole and keeps its slice (train.py)."""
    if name.endswith("norm.weight"):
        return torch.ones(shape, device="cpu")
    std = 0.02 / math.sqrt(2 * n_layer) if name.endswith(("wo.weight", "w2.weight")) else 0.02
    return torch.empty(shape, device="cpu").normal_(0.0, std, generator=torch.Generator().manual_seed(param_seed(seed, name)))


class Transformer(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.drop = nn.Dropout(cfg.dropout)
        self.layers = nn.ModuleDict({str(i): Block(cfg) for i in range(cfg.n_layer)})
        self.norm = RMSNorm(cfg.n_embd, cfg.norm_eps)
        self.output = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        # the loss from (logits, targets, mask); tensor parallelism swaps in one that works on
        # vocabulary slices of the logits (parallel.vocab_parallel_cross_entropy)
        self.loss_fn = masked_cross_entropy
        self.init_rope()
        if not self.norm.weight.is_meta:  # on the meta device there is nothing to fill (train.py fills the shards)
            self.init_weights()

    def init_rope(self, device=None):
        """(Re)computes the rotary tables: after a build on the meta device they are empty."""
        cos, sin = rope_tables(self.cfg.n_embd // self.cfg.n_head, self.cfg.block_size, self.cfg.rope_theta)
        # not persistent: derived from the config, so checkpoints hold only learned weights
        self.register_buffer("rope_cos", cos.to(device), persistent=False)
        self.register_buffer("rope_sin", sin.to(device), persistent=False)

    @torch.no_grad()
    def init_weights(self, seed=None):
        """Every parameter from init_tensor: its own generator, seeded by (seed, its name).
        seed None: torch.initial_seed(), so `torch.manual_seed(s); Transformer(cfg)` is the model
        that train.py starts with seed=s, whatever the layout."""
        seed = torch.initial_seed() if seed is None else seed
        for name, p in self.named_parameters():
            p.copy_(init_tensor(name, p.shape, self.cfg.n_layer, seed))

    def forward(self, idx, targets=None, loss_mask=None, doc_ids=None, cache=None, chunk=None):
        """idx, targets, loss_mask, doc_ids: (B, T). Returns (logits (B, T, vocab) (under tensor
        parallelism this rank's vocabulary slice), loss or None):
        the loss is the mean cross-entropy over the target positions where loss_mask is 1 (all
        of them without a mask).

        doc_ids: which document of a packed row each position belongs to. With it, attention
        is block-diagonal causal: position i sees j iff j <= i and both are in the same
        document, so a document never attends across the boundary into the one before it.
        Rotary positions stay the absolute positions in the packed row; relative positions
        within a document, all that RoPE scores see, are the same either way.

        A pipeline stage (see make_stage) without the embedding takes the hidden states
        (B, T, n_embd) of the previous stage as `idx` (and the same doc_ids), and one without
        the head returns its hidden states in place of the logits. chunk=c (interleaved
        pipeline stages, see make_stage): run only this stage's c-th chunk of layers, with
        the embedding only in chunk 0 and the head only in the last chunk.

        cache: {layer name: KVCache} (generate's): idx continues the tokens the caches hold,
        at positions len(cache) onwards, and their keys and values are appended."""
        T = idx.shape[1]
        start = len(next(iter(cache.values()))) if cache else 0  # the position of idx[:, 0]
        if start + T > self.cfg.block_size:
            raise ValueError(f"sequence of length {start + T} is longer than block_size={self.cfg.block_size}")
        cos, sin = self.rope_cos[start:start + T], self.rope_sin[start:start + T]
        mask = None  # None: SDPA's own causal mask (is_causal=True)
        if doc_ids is not None:
            # A dense (B, 1, T, T) boolean mask, built once and shared by every block. On GPU
            # this takes SDPA off its flash kernel (to the memory-efficient one, which still
            # computes the masked blocks); the fast way there is a varlen kernel that
            # skips the masked blocks entirely (flash_attn_varlen_func with cu_seqlens, the
            # documents' start offsets, or FlexAttention with a document mask). At our
            # sequence lengths T x T booleans per row are small and the math is the same.
            same_doc = doc_ids[:, :, None] == doc_ids[:, None, :]                      # (B, T, T)
            causal = torch.ones(T, T, dtype=torch.bool, device=doc_ids.device).tril()  # (T, T)
            mask = (same_doc & causal)[:, None]                                        # (B, 1, T, T)
        names = list(self.layers) if chunk is None else [str(i) for i in self.chunks[chunk]]
        if self.tok_embeddings is not None and not chunk:  # chunk None or 0
            x = self.tok_embeddings(idx)  # (B, T, n_embd)
            if self.training and self.cfg.neftune_alpha > 0:
                # NEFTune (Jain et al. 2023, arXiv:2310.05914): uniform noise on the embeddings,
                # scaled by alpha / sqrt(T * n_embd) so its norm does not grow with T or width;
                # it regularises fine-tuning. Training only: eval and generation are untouched.
                scale = self.cfg.neftune_alpha / math.sqrt(T * self.cfg.n_embd)
                x = x + torch.empty_like(x).uniform_(-1, 1) * scale
            x = self.drop(x)
        else:
            x = idx  # (B, T, n_embd): the previous stage's hidden states
        for name in names:
            block = self.layers[name]
            if self.cfg.grad_ckpt and self.training:
                x = checkpoint(block, x, cos, sin, mask, use_reentrant=False)
            else:
                x = block(x, cos, sin, mask, cache[name] if cache else None)
        if self.output is None or (chunk is not None and chunk < len(self.chunks) - 1):
            return x, None
        logits = self.output(self.norm(x)).float()  # (B, T, vocab)
        loss = None if targets is None else self.loss_fn(logits, targets, loss_mask)
        return logits, loss

    def num_params(self):
        return sum(p.numel() for p in self.parameters())

    def flops_per_token(self):
        """Training FLOPs per token (forward + backward = 3x forward), PaLM appendix B: 6 per
        weight that takes part in a matmul (the embedding lookup is not a matmul; a tied
        table is counted once, as the head), plus the attention scores and values
        12 * n_layer * n_embd * T at full length T = block_size. A frozen weight (LoRA's
        base) costs 4, not 6: backward still takes its input's gradient (2) but not its own."""
        emb = self.tok_embeddings.weight
        matmul = [p for p in self.parameters() if p is not emb or self.cfg.tie_embeddings]
        n = sum((6 if p.requires_grad else 4) * p.numel() for p in matmul)
        return n + 12 * self.cfg.n_layer * self.cfg.n_embd * self.cfg.block_size

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
            elif cache is None or len(cache[next(iter(cache))]) == block_size:  # the first step, or a full window
                cache = {name: KVCache() for name in self.layers}
                logits, _ = self(idx[:, -block_size:], cache=cache)
            else:
                logits, _ = self(idx[:, -1:], cache=cache)
            logits = logits[:, -1, :]
            if temperature == 0:
                nxt = logits.argmax(-1, keepdim=True)
            else:
                logits = logits / temperature
                if top_k:
                    kth = torch.topk(logits, min(top_k, logits.size(-1))).values[:, [-1]]
                    logits = logits.masked_fill(logits < kth, float("-inf"))
                nxt = torch.multinomial(F.softmax(logits, dim=-1), num_samples=1)
            idx = torch.cat([idx, nxt], dim=1)
        return idx


# What the softmax and cross-entropy over the vocabulary cost per logit, in matmul FLOPs. They do
# ~5 FLOPs per logit but are memory-bound: each logit (fp32) is written, read and rewritten
# several times in forward and backward. Measured on the 2-core CPU (one block and the head with
# its loss, forward and backward, 8 x 128 tokens, the default model): the head and loss take
# 7.9x a block's time where the matmul FLOPs alone say 4.9x; this constant closes that gap.
LOSS_FLOPS_PER_LOGIT = 160


def stage_costs(cfg):
    """Forward cost per token of the pieces a pipeline stage can hold, in matmul FLOPs: (one
    block, the head with its loss, the embedding lookup). A block: 2 per weight of its matmuls
    plus the attention scores and values at full length (as flops_per_token counts them); the
    head: its vocab x n_embd matmul plus LOSS_FLOPS_PER_LOGIT per logit for the softmax and
    cross-entropy; the embedding: a row copy. Backward costs about twice the forward of each,
    so the proportions, all that the split uses, are the same for training."""
    head_dim = cfg.n_embd // cfg.n_head
    attn = cfg.n_embd * head_dim * (2 * cfg.n_head + 2 * cfg.n_kv_head)  # wq, wo; wk, wv
    block = 2 * (attn + 3 * cfg.n_embd * cfg.ffn_dim) + 4 * cfg.n_embd * cfg.block_size
    return block, (2 * cfg.n_embd + LOSS_FLOPS_PER_LOGIT) * cfg.vocab_size, cfg.n_embd


def pipeline_split(cfg, stages):
    """Layers per pipeline stage (a list of `stages` counts, each >= 1, summing to n_layer)
    that balances the estimated cost: the first stage also pays for the embedding, the last
    for the head and the loss (Megatron's "account for embedding and loss in the pipeline
    split"). Greedy water-filling: every stage starts with one layer and each further layer
    goes to the stage that would be cheapest with it (the earliest on a tie); for layers
    of equal cost this minimises the most expensive stage. With a tiny head it is nearly the
    even split (10 layers on 4 stages: 2, 3, 3, 2); the default model (4 layers, and its
    8192 x 128 head with the loss costs ~8 layers) on 2 stages: 3, 1; 16 such layers: 12, 4."""
    assert 1 <= stages <= cfg.n_layer, f"{stages} pipeline stages for {cfg.n_layer} layers"
    block, head, emb = stage_costs(cfg)
    extra = [0] * stages
    extra[0] += emb
    extra[-1] += head
    counts = [1] * stages
    for _ in range(cfg.n_layer - stages):
        s = min(range(stages), key=lambda s: (counts[s] + 1) * block + extra[s])
        counts[s] += 1
    return counts


def stage_layers(counts, stage):
    """The contiguous range of global layer indices of (virtual) pipeline stage `stage`, for
    the layer counts per stage `counts` (pipeline_split's, or the user's pp_layers)."""
    start = sum(counts[:stage])
    return range(start, start + counts[stage])


def make_stage(model, stage, pp, counts=None, virtual=1):
    """Cuts a full model down to what pipeline rank `stage` of `pp` holds, in place. With
    virtual=1 that is one stage: its layer range, plus the embedding on stage 0 and the final
    norm and head on the last. With virtual=V (interleaved 1F1B) there are V * pp virtual
    stages and this rank holds V of them, v * pp + stage for v = 0 .. V-1: its chunks, kept
    in one module (one ModuleDict of global layer names, so checkpoints, clipping and data
    parallel see one model) and listed in model.chunks, which forward(chunk=c) runs. The
    embedding belongs to virtual stage 0 (chunk 0 of stage 0), the head to the last (chunk
    V-1 of stage pp-1). counts: layers per virtual stage (default: pipeline_split).
    Building the whole model first and dropping the rest gives every stage exactly the
    weights the single-process model starts with (same seed, same names)."""
    if pp == 1:
        return model
    counts = counts or pipeline_split(model.cfg, pp * virtual)
    assert len(counts) == pp * virtual and sum(counts) == model.cfg.n_layer and min(counts) >= 1, \
        f"layer counts {counts} do not split {model.cfg.n_layer} layers into {pp} x {virtual} stages"
    model.chunks = [stage_layers(counts, v * pp + stage) for v in range(virtual)]
    model.layers = nn.ModuleDict({str(i): model.layers[str(i)] for chunk in model.chunks for i in chunk})
    if stage > 0:
        model.tok_embeddings = None
    if stage < pp - 1:
        model.norm = model.output = None
    return model


@torch.no_grad()
def grow_vocab(model, new_vocab_size):
    """Grows the embedding and the head of `model` (a whole model or a pipeline stage, which
    grows what it has) to new_vocab_size rows, in place: e.g. for a tokenizer with added
    tokens. The old rows are kept as they are; each new row starts as the mean of the old rows
    of its matrix, so a new token starts as an "average" token instead of a random one with a
    large logit. Tied embeddings stay one table. Build the optimizer after this: the grown
    weights are new Parameters."""
    old = model.cfg.vocab_size
    if new_vocab_size < old:
        raise ValueError(f"grow_vocab: new_vocab_size={new_vocab_size} is smaller than vocab_size={old}")
    if new_vocab_size == old:
        return model

    def grown(w):  # (old, n_embd) -> (new_vocab_size, n_embd)
        mean = w.float().mean(0, keepdim=True).to(w.dtype)
        return nn.Parameter(torch.cat([w, mean.expand(new_vocab_size - old, -1)]), requires_grad=w.requires_grad)

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


# ---------------------------------------------------------------------------------------
# LoRA (Hu et al. 2021, arXiv:2106.09685): a frozen weight W plus a trainable low-rank update,
#   y = x W^T + (alpha / r) * dropout(x) A^T B^T,   A: (r, in), B: (out, r)
# B starts at zero, so at step 0 the model is exactly the base model; only A and B train.
# The names follow PEFT's LoraLayer (lora_A.weight, lora_B.weight, scaling = lora_alpha / r,
# dropout on the adapter's input only, A Kaiming-uniform), so that an adapter maps one to
# one onto PEFT's files (checkpoint.py writes and reads them).

LORA_TARGETS = ("wq", "wk", "wv", "wo", "w1", "w2", "w3", "output")  # the linears an adapter may wrap


class LoRALinear(nn.Module):
    """An nn.Linear (no bias) with a LoRA adapter. The base weight stays `.weight`, so the
    base's names in checkpoints and Hugging Face files do not change."""

    def __init__(self, base, rank, alpha, dropout=0.0):
        super().__init__()
        assert base.bias is None, "LoRALinear wraps bias-free linears (all of this model's)"
        self.in_features, self.out_features = base.in_features, base.out_features
        self.weight = base.weight  # the same Parameter: frozen by apply_lora, not copied
        # skip_init: no draw from the global RNG here (reset_adapter has its own generator)
        dev = base.weight.device
        self.lora_A = nn.utils.skip_init(nn.Linear, self.in_features, rank, bias=False, device=dev)   # weight (r, in)
        self.lora_B = nn.utils.skip_init(nn.Linear, rank, self.out_features, bias=False, device=dev)  # weight (out, r)
        self.scaling = alpha / rank
        self.lora_dropout = nn.Dropout(dropout)
        self.merged = False

    @torch.no_grad()
    def reset_adapter(self, generator):
        # PEFT's (and nn.Linear's) init for A: Kaiming-uniform with a = sqrt(5), i.e.
        # U(-1/sqrt(in), 1/sqrt(in)); B zero: the update B A is zero until B has learned.
        # Drawn on the CPU (a CPU generator), then copied: the same values on every device.
        a = torch.empty(self.lora_A.weight.shape)
        nn.init.kaiming_uniform_(a, a=math.sqrt(5), generator=generator)
        self.lora_A.weight.copy_(a)
        nn.init.zeros_(self.lora_B.weight)

    def delta(self):
        """The update the adapter adds to the weight: (alpha / r) B A, shape (out, in)."""
        return self.scaling * (self.lora_B.weight @ self.lora_A.weight)

    def forward(self, x):
        y = F.linear(x, self.weight)
        if self.merged:  # W already holds W + (alpha / r) B A
            return y
        return y + self.lora_B(self.lora_A(self.lora_dropout(x))) * self.scaling

    @torch.no_grad()
    def merge(self):
        """W <- W + (alpha / r) B A: one matmul per call again, for inference or export."""
        if not self.merged:
            self.weight += self.delta().to(self.weight.dtype)
            self.merged = True

    @torch.no_grad()
    def unmerge(self):
        """W <- W - (alpha / r) B A: back to the base weight (up to float rounding)."""
        if self.merged:
            self.weight -= self.delta().to(self.weight.dtype)
            self.merged = False


def apply_lora(model, rank, alpha, dropout, targets, seed):
    """Puts a LoRA adapter on every linear of `model` whose name ends in one of `targets`
    (of LORA_TARGETS), in place, and freezes every other parameter. Returns the names of the
    wrapped linears. Works on a whole model or a pipeline stage (which wraps what it has).
    Each A is drawn from its own generator, seeded by (seed, its module's name): the same
    adapter whatever the layout, though a pipeline stage builds only some of them."""
    unknown = set(targets) - set(LORA_TARGETS)
    assert not unknown, f"unknown LoRA targets {sorted(unknown)}; choose from {LORA_TARGETS}"
    for p in model.parameters():
        p.requires_grad_(False)
    wrapped = []
    for name, module in list(model.named_modules()):
        if isinstance(module, nn.Linear) and name.split(".")[-1] in targets:
            lora = LoRALinear(module, rank, alpha, dropout)
            lora.reset_adapter(torch.Generator().manual_seed(param_seed(seed, name)))
            parent, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent) if parent else model, child, lora)
            wrapped.append(name)
    return wrapped


def merge_lora(model):
    """Merges every adapter of `model` into its weight (see LoRALinear.merge)."""
    for m in model.modules():
        if isinstance(m, LoRALinear):
            m.merge()
    return model


def masked_cross_entropy(logits, targets, loss_mask=None):
    """Mean cross-entropy over positions whose mask is 1; without a mask, over all of them."""
    loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="none")
    if loss_mask is None:
        return loss.mean()
    mask = loss_mask.flatten().to(loss.dtype)
    # clamp: a micro-batch with no target tokens contributes 0, not NaN
    return (loss * mask).sum() / mask.sum().clamp(min=1)


def measure_matmul_flops(device, dtype=torch.float32, n=1024, seconds=0.5):
    """FLOP/s of a square matmul on this device: the achievable peak that MFU is measured
    against when peak_flops is not given (on CPU, float32; nobody publishes a number for
    your laptop)."""
    g = torch.Generator(device).manual_seed(0)  # its own generator: the run's RNG stream is untouched
    a = torch.rand(n, n, device=device, dtype=dtype, generator=g)
    b = torch.rand(n, n, device=device, dtype=dtype, generator=g)
    sync = torch.cuda.synchronize if torch.device(device).type == "cuda" else (lambda: None)
    a @ b  # warm up
    sync()
    reps, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        a @ b
        reps += 1
        sync()
    return 2 * n ** 3 * reps / (time.perf_counter() - t0)


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
