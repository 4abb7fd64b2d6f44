"""
A LLaMA-style decoder: token embedding -> n_layer x [RMSNorm -> grouped-query attention
with rotary positions -> residual, RMSNorm -> SwiGLU MLP -> residual] -> RMSNorm -> head.

Parameter names follow Meta's LLaMA / torchtitan (tok_embeddings, layers.{i}.attention.wq,
..., norm, output), and the layers live in a ModuleDict keyed by their global index, so a
pipeline stage that owns layers 4..7 still calls them layers.4 ... layers.7 and every
checkpoint uses the same names whatever the layout. This file knows nothing of ranks.

It also reads and writes safetensors files by hand and maps Hugging Face LlamaForCausalLM
checkpoints to these names and back (load_hf_llama, save_hf_llama), for continual pretraining.
"""

import json
import math
import os
import re
import shutil
import time
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from configurator import UserError


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


class Attention(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.n_head, self.n_kv_head = cfg.n_head, cfg.n_kv_head
        self.head_dim = cfg.n_embd // cfg.n_head
        self.wq = nn.Linear(cfg.n_embd, cfg.n_head * self.head_dim, bias=False)
        self.wk = nn.Linear(cfg.n_embd, cfg.n_kv_head * self.head_dim, bias=False)
        self.wv = nn.Linear(cfg.n_embd, cfg.n_kv_head * self.head_dim, bias=False)
        self.wo = nn.Linear(cfg.n_head * self.head_dim, cfg.n_embd, bias=False)
        self.dropout = cfg.dropout

    def forward(self, x, cos, sin, mask=None):
        # mask: None (plain causal) or a boolean (B, 1, T, T), True where attending is allowed
        B, T, C = x.shape
        q = self.wq(x).view(B, T, self.n_head, self.head_dim).transpose(1, 2)     # (B, n_head, T, head_dim)
        k = self.wk(x).view(B, T, self.n_kv_head, self.head_dim).transpose(1, 2)  # (B, n_kv_head, T, head_dim)
        v = self.wv(x).view(B, T, self.n_kv_head, self.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if self.n_kv_head != self.n_head:
            # GQA: each kv head is shared by a group of n_head // n_kv_head query heads
            k = k.repeat_interleave(self.n_head // self.n_kv_head, dim=1)
            v = v.repeat_interleave(self.n_head // self.n_kv_head, dim=1)
        # on CUDA with bf16 this dispatches to flash attention (without a mask); on CPU to the
        # math/flash-cpu kernel
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None,
                                           dropout_p=self.dropout if self.training else 0.0)
        return self.wo(y.transpose(1, 2).reshape(B, T, C))


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

    def forward(self, x, cos, sin, mask=None):
        x = x + self.drop(self.attention(self.attention_norm(x), cos, sin, mask))
        return x + self.drop(self.feed_forward(self.ffn_norm(x)))


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
        cos, sin = rope_tables(cfg.n_embd // cfg.n_head, cfg.block_size, cfg.rope_theta)
        # not persistent: derived from the config, so checkpoints hold only learned weights
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.init_weights()

    @torch.no_grad()
    def init_weights(self):
        # GPT-2 style: N(0, 0.02) everywhere, and the two projections that write into the
        # residual stream (wo, w2) scaled by 1/sqrt(2 * n_layer) so that the residual's
        # variance does not grow with depth.
        for name, p in self.named_parameters():
            if name.endswith("norm.weight"):
                nn.init.ones_(p)
            elif name.endswith(("wo.weight", "w2.weight")):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * self.cfg.n_layer))
            else:
                nn.init.normal_(p, mean=0.0, std=0.02)

    def forward(self, idx, targets=None, loss_mask=None, doc_ids=None):
        """idx, targets, loss_mask, doc_ids: (B, T). Returns (logits (B, T, vocab), loss or None):
        the loss is the mean cross-entropy over the target positions where loss_mask is 1 (all
        of them without a mask).

        doc_ids: which document of a packed row each position belongs to. With it, attention
        is block-diagonal causal: position i sees j iff j <= i and both are in the same
        document, so a document never attends across the boundary into the one before it.
        Rotary positions stay the absolute positions in the packed row; relative positions
        within a document, all that RoPE scores see, are the same either way.

        A pipeline stage (see make_stage) without the embedding takes the hidden states
        (B, T, n_embd) of the previous stage as `idx` (and the same doc_ids), and one without
        the head returns its hidden states in place of the logits."""
        T = idx.shape[1]
        if T > self.cfg.block_size:
            raise ValueError(f"sequence of length {T} is longer than block_size={self.cfg.block_size}")
        cos, sin = self.rope_cos[:T], self.rope_sin[:T]
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
        if self.tok_embeddings is not None:
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
        for block in self.layers.values():
            if self.cfg.grad_ckpt and self.training:
                x = checkpoint(block, x, cos, sin, mask, use_reentrant=False)
            else:
                x = block(x, cos, sin, mask)
        if self.output is None:
            return x, None
        logits = self.output(self.norm(x)).float()  # (B, T, vocab)
        loss = None if targets is None else masked_cross_entropy(logits, targets, loss_mask)
        return logits, loss

    def num_params(self):
        return sum(p.numel() for p in self.parameters())

    def flops_per_token(self):
        """Training FLOPs per token (forward + backward = 3x forward), PaLM appendix B: 6 per
        weight that takes part in a matmul (the embedding lookup is not a matmul; a tied
        table is counted once, as the head), plus the attention scores and values
        12 * n_layer * n_embd * T at full length T = block_size."""
        n = self.num_params() - (0 if self.cfg.tie_embeddings else self.tok_embeddings.weight.numel())
        return 6 * n + 12 * self.cfg.n_layer * self.cfg.n_embd * self.cfg.block_size

    @torch.no_grad()
    def generate(self, idx, max_new_tokens, temperature=1.0, top_k=None):
        """Appends max_new_tokens sampled tokens to idx (B, T). No KV cache: each step re-runs
        the (cropped) context, which is plenty for samples from small models."""
        for _ in range(max_new_tokens):
            logits, _ = self(idx[:, -self.cfg.block_size:])
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


def stage_layers(n_layer, pp, stage):
    """The contiguous range of layer indices that pipeline stage `stage` of `pp` owns. Layers
    are split as evenly as possible and the stages that get one more are the first ones:
    the last stage also carries the head (a vocab x n_embd matmul), the first only the
    embedding lookup. E.g. 10 layers on 4 stages: 3, 3, 2, 2."""
    per, extra = divmod(n_layer, pp)
    start = stage * per + min(stage, extra)
    return range(start, start + per + (stage < extra))


def make_stage(model, stage, pp):
    """Cuts a full model down to pipeline stage `stage` of `pp`, in place: stage 0 keeps the
    embedding, the last stage the final norm and the head, every stage its layer range.
    Building the whole model first and dropping the rest gives every stage exactly the
    weights the single-process model starts with (same seed, same names)."""
    if pp == 1:
        return model
    keep = stage_layers(model.cfg.n_layer, pp, stage)
    model.layers = nn.ModuleDict({str(i): model.layers[str(i)] for i in keep})
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


# ---------------------------------------------------------------------------------------------
# safetensors, by hand: 8 bytes little-endian header length N, N bytes of JSON
# {name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {str: str}}, then the
# raw little-endian bytes, offsets relative to the start of that data. No pickle: loading a
# file cannot run code.

SAFETENSORS_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
                      "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
                      "U8": torch.uint8, "BOOL": torch.bool}
MAX_HEADER_BYTES = 100 * 1024 * 1024  # a header is kilobytes; more is a corrupt length, not a file to parse


def read_safetensors(path):
    """{name: tensor} of a .safetensors file, on CPU. A malformed file is a UserError naming
    the file and the problem; nothing is read beyond what the header describes. Assumes a
    little-endian machine, like every GPU host."""
    def corrupt(problem):
        return UserError(f"{path}: {problem}; the file is truncated, damaged or not safetensors: "
                         f"copy or download it again")

    size = os.path.getsize(path)
    with open(path, "rb") as f:
        if size < 8:
            raise corrupt(f"only {size} bytes, too short for the 8-byte header length")
        n = int.from_bytes(f.read(8), "little")
        if n > size - 8:
            raise corrupt(f"header length {n} is larger than the file ({size} bytes)")
        if n > MAX_HEADER_BYTES:
            raise corrupt(f"header length {n} is above the 100 MB limit")
        try:
            header = json.loads(f.read(n).decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise corrupt(f"header is not valid UTF-8 JSON ({e})") from None
        if not isinstance(header, dict):
            raise corrupt(f"header is a JSON {type(header).__name__}, not an object")
        header.pop("__metadata__", None)
        start, data_size = 8 + n, size - 8 - n
        tensors = {}
        for name, info in header.items():
            if not isinstance(info, dict):
                raise corrupt(f"tensor '{name}' has no dtype/shape/data_offsets entry")
            dtype = SAFETENSORS_DTYPES.get(str(info.get("dtype")))
            if dtype is None:
                raise UserError(f"{path}: tensor '{name}' has dtype {info.get('dtype')!r}, which this reader "
                                f"does not support ({', '.join(SAFETENSORS_DTYPES)}): convert it to one of those")
            shape, offsets = info.get("shape"), info.get("data_offsets")
            if not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape):
                raise corrupt(f"tensor '{name}' has shape {shape!r}, not a list of non-negative ints")
            if (not isinstance(offsets, list) or len(offsets) != 2 or not all(type(o) is int for o in offsets)
                    or not 0 <= offsets[0] <= offsets[1] <= data_size):
                raise corrupt(f"tensor '{name}' has data_offsets {offsets!r}, not [begin, end] within the "
                              f"{data_size} data bytes")
            nbytes = math.prod(shape) * dtype.itemsize
            if offsets[1] - offsets[0] != nbytes:
                raise corrupt(f"tensor '{name}' spans {offsets[1] - offsets[0]} bytes, but {info['dtype']} "
                              f"{shape} needs {nbytes}")
            buf = torch.empty(nbytes, dtype=torch.uint8)
            f.seek(start + offsets[0])
            if f.readinto(buf.numpy()) != nbytes:  # the file shrank while we read it
                raise corrupt(f"tensor '{name}' ends early")
            tensors[name] = buf.view(dtype).reshape(shape)
    return tensors


def write_safetensors(path, tensors, metadata=None):
    """Writes {name: tensor} as a .safetensors file that the reference implementation (and
    read_safetensors) loads: names sorted, data contiguous, the header padded with spaces to a
    multiple of 8 so the data starts aligned. Atomic: a temp file renamed into place, so a
    crash never leaves half a file under `path`."""
    names = {dtype: name for name, dtype in SAFETENSORS_DTYPES.items()}
    header = {"__metadata__": {str(k): str(v) for k, v in metadata.items()}} if metadata else {}
    data, offset = [], 0
    for name in sorted(tensors):
        t = tensors[name].detach().to("cpu").contiguous()
        if t.dtype not in names:
            raise ValueError(f"write_safetensors: tensor '{name}' has dtype {t.dtype}, which safetensors "
                             f"here does not support")
        nbytes = t.numel() * t.element_size()
        header[name] = {"dtype": names[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + nbytes]}
        data.append(t.reshape(-1).view(torch.uint8))  # its raw bytes, no copy
        offset += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode("utf-8")
    raw += b" " * (-len(raw) % 8)
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            f.write(len(raw).to_bytes(8, "little"))
            f.write(raw)
            for b in data:
                f.write(b.numpy())
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


# ---------------------------------------------------------------------------------------------
# Hugging Face LLaMA checkpoints (LlamaForCausalLM, save_pretrained's directory layout).
# Hugging Face name -> ours; {i} is the layer index. Our RoPE uses HF's rotate-half layout
# (see rope_tables), so q_proj/k_proj load as they are: no permutation of their rows (that
# permutation is what converting Meta's original interleaved checkpoints to HF needs).
HF_LLAMA_NAMES = {
    "model.embed_tokens.weight": "tok_embeddings.weight",
    "model.layers.{i}.input_layernorm.weight": "layers.{i}.attention_norm.weight",
    "model.layers.{i}.self_attn.q_proj.weight": "layers.{i}.attention.wq.weight",
    "model.layers.{i}.self_attn.k_proj.weight": "layers.{i}.attention.wk.weight",
    "model.layers.{i}.self_attn.v_proj.weight": "layers.{i}.attention.wv.weight",
    "model.layers.{i}.self_attn.o_proj.weight": "layers.{i}.attention.wo.weight",
    "model.layers.{i}.post_attention_layernorm.weight": "layers.{i}.ffn_norm.weight",
    "model.layers.{i}.mlp.gate_proj.weight": "layers.{i}.feed_forward.w1.weight",
    "model.layers.{i}.mlp.up_proj.weight": "layers.{i}.feed_forward.w3.weight",
    "model.layers.{i}.mlp.down_proj.weight": "layers.{i}.feed_forward.w2.weight",
    "model.norm.weight": "norm.weight",
    "lm_head.weight": "output.weight",  # absent from HF files with tie_word_embeddings
}


def rename(name, table):
    """`name` through a table like HF_LLAMA_NAMES (or its inverse); None if it has no entry."""
    m = re.fullmatch(r"(.*layers\.)(\d+)(\..*)", name)
    key = f"{m[1]}{{i}}{m[3]}" if m else name
    return table[key].format(i=m[2] if m else None) if key in table else None


def hf_config_to_ours(hf):
    """ModelConfig kwargs (all but block_size) from a Hugging Face LLaMA config.json dict.
    Refuses what this model does not implement rather than load it and compute something else."""
    def refuse(field, why):
        return UserError(f"config.json: {field}={hf.get(field)!r}: {why}; only plain LLaMA models "
                         f"(LlamaForCausalLM without those variants) can be loaded")

    for field in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads"):
        if type(hf.get(field)) is not int:
            raise refuse(field, "missing or not an int")
    if hf.get("model_type") != "llama":
        raise refuse("model_type", "not a LLaMA model")
    if hf.get("rope_scaling") is not None:
        raise refuse("rope_scaling", "scaled rotary positions are not implemented")
    # transformers >= 5 writes rope_theta (and rope_type, its rope_scaling) under rope_parameters
    rope = hf.get("rope_parameters") or {}
    if rope.get("rope_type", "default") != "default":
        raise refuse("rope_parameters", "scaled rotary positions are not implemented")
    if hf.get("attention_bias") or hf.get("mlp_bias"):
        raise refuse("attention_bias" if hf.get("attention_bias") else "mlp_bias", "biases are not implemented")
    if hf.get("hidden_act", "silu") != "silu":
        raise refuse("hidden_act", "only silu (SwiGLU) is implemented")
    n_embd, n_head = hf["hidden_size"], hf["num_attention_heads"]
    if hf.get("head_dim") is not None and hf["head_dim"] != n_embd // n_head:
        raise refuse("head_dim", f"only head_dim = hidden_size // num_attention_heads = {n_embd // n_head} "
                                 f"is implemented")
    return dict(vocab_size=hf["vocab_size"], n_layer=hf["num_hidden_layers"], n_head=n_head,
                n_kv_head=hf.get("num_key_value_heads") or n_head, n_embd=n_embd,
                ffn_dim=hf["intermediate_size"], norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
                rope_theta=float(rope.get("rope_theta", hf.get("rope_theta", 10000.0))),
                tie_embeddings=bool(hf.get("tie_word_embeddings", False)))


def expected_shapes(cfg):
    """{our name: shape} of every weight a checkpoint of this config holds (a tied head is the
    embedding, not a weight of its own). Built on the meta device: no memory, no init."""
    with torch.device("meta"):
        model = Transformer(cfg)
    shapes = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    if cfg.tie_embeddings:
        del shapes["output.weight"]
    return shapes


def load_hf_llama(path):
    """(ModelConfig kwargs, state dict in our names) of the Hugging Face LLaMA model that
    save_pretrained wrote into directory `path`: config.json and model.safetensors, or
    model.safetensors.index.json and the shards its weight_map names. Tensors keep the dtype
    of the file; load_state_dict converts them to the model's."""
    def read_json(file):
        try:
            with open(os.path.join(path, file)) as f:
                obj = json.load(f)
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise UserError(f"{path}/{file} is not valid JSON ({e}): copy or download it again") from None
        if not isinstance(obj, dict):
            raise UserError(f"{path}/{file} holds a JSON {type(obj).__name__}, not an object: "
                            f"copy or download it again")
        return obj

    if not os.path.isfile(os.path.join(path, "config.json")):
        raise UserError(f"{path}: no config.json; point at a Hugging Face model directory "
                        f"(what save_pretrained writes)")
    kwargs = hf_config_to_ours(read_json("config.json"))
    if os.path.isfile(os.path.join(path, "model.safetensors.index.json")):
        weight_map = read_json("model.safetensors.index.json").get("weight_map")
        if not isinstance(weight_map, dict) or not all(isinstance(f, str) for f in weight_map.values()):
            raise UserError(f"{path}/model.safetensors.index.json has no weight_map of file names: "
                            f"copy or download it again")
        files = sorted(set(weight_map.values()))
    elif os.path.isfile(os.path.join(path, "model.safetensors")):
        files = ["model.safetensors"]
    else:
        raise UserError(f"{path}: no model.safetensors or model.safetensors.index.json; only safetensors weights "
                        f"are read: re-save the model with save_pretrained(..., safe_serialization=True)")
    hf_tensors = {}
    for file in files:
        if not os.path.isfile(os.path.join(path, file)):
            raise UserError(f"{path}: the shard {file} that model.safetensors.index.json names is missing: "
                            f"copy or download it")
        hf_tensors.update(read_safetensors(os.path.join(path, file)))

    try:
        cfg = ModelConfig(**kwargs)
    except ValueError as e:
        raise UserError(f"{path}/config.json: {e}") from None
    expected = expected_shapes(cfg)
    sd = {}
    for name, t in hf_tensors.items():
        ours = rename(name, HF_LLAMA_NAMES)
        if ours == "output.weight" and cfg.tie_embeddings:
            continue  # a tied head that was saved anyway: it is the embedding
        if ours not in expected:
            raise UserError(f"{path}: unknown tensor '{name}' for a {cfg.n_layer}-layer LLaMA; the checkpoint is "
                            f"not a plain LlamaForCausalLM, or config.json does not match its weights")
        if tuple(t.shape) != expected[ours]:
            raise UserError(f"{path}: tensor '{name}' has shape {tuple(t.shape)}, but config.json implies "
                            f"{expected[ours]}; config.json does not match the weights")
        sd[ours] = t
    missing = [rename(n, {v: k for k, v in HF_LLAMA_NAMES.items()}) for n in expected if n not in sd]
    if missing:
        raise UserError(f"{path}: missing tensors {', '.join(missing[:5])}{' ...' if len(missing) > 5 else ''}; "
                        f"the checkpoint is incomplete (a shard missing from weight_map?): copy or download it again")
    return kwargs, sd


def save_hf_llama(path, state_dict, cfg):
    """Writes our state dict (plain tensors, our names, a whole model) as a Hugging Face
    LLaMA directory that LlamaForCausalLM.from_pretrained loads: config.json and
    model.safetensors (float32; no lm_head when the embeddings are tied). Written into a temp
    directory renamed into place at the end; `path` must not exist or be empty, so nothing
    of the user's is ever overwritten."""
    if os.path.exists(path) and (not os.path.isdir(path) or os.listdir(path)):
        raise UserError(f"{path} already exists and is not an empty directory: remove it or export elsewhere")
    expected, to_hf = expected_shapes(cfg), {v: k for k, v in HF_LLAMA_NAMES.items()}
    missing = sorted(set(expected) - set(state_dict))
    if missing:
        raise ValueError(f"save_hf_llama: state dict lacks {', '.join(missing[:5])}: it must hold a whole model")
    tensors = {rename(name, to_hf): state_dict[name].detach().to("cpu", torch.float32) for name in expected}
    hf_config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.n_embd, "intermediate_size": cfg.ffn_dim,
        "num_hidden_layers": cfg.n_layer, "num_attention_heads": cfg.n_head,
        "num_key_value_heads": cfg.n_kv_head, "head_dim": cfg.n_embd // cfg.n_head,
        "rms_norm_eps": cfg.norm_eps, "rope_theta": cfg.rope_theta, "rope_scaling": None,
        "max_position_embeddings": cfg.block_size, "tie_word_embeddings": cfg.tie_embeddings,
        "hidden_act": "silu", "torch_dtype": "float32", "attention_bias": False, "mlp_bias": False,
    }
    tmp = f"{os.path.normpath(path)}.tmp{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    try:
        with open(os.path.join(tmp, "config.json"), "w") as f:
            json.dump(hf_config, f, indent=2)
        write_safetensors(os.path.join(tmp, "model.safetensors"), tensors, {"format": "pt"})
        os.replace(tmp, path)  # replaces an empty directory too
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
