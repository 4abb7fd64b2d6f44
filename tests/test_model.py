import math

import pytest
import torch
import torch.nn.functional as F
from conftest import tiny_model

from model import (
    KVCache,
    ModelConfig,
    apply_rope,
    grow_vocab,
    cross_entropy_losses,
    masked_mean,
    rope_tables,
)
from optim import MuonWithAdamW, get_lr, newton_schulz, newton_schulz_each
from techniques import activations
from techniques.pipeline import make_stage

tiny = tiny_model


def test_causal_future_tokens_do_not_change_the_past():
    model = tiny()
    idx = torch.randint(0, 97, (2, 16), generator=torch.Generator().manual_seed(1))
    changed = idx.clone()
    changed[:, 9] = (changed[:, 9] + 1) % 97
    a, _ = model(idx)
    b, _ = model(changed)
    torch.testing.assert_close(a[:, :9], b[:, :9], rtol=0, atol=0)
    # and the token does matter from its position on
    assert (a[:, 9:] - b[:, 9:]).abs().max() > 1e-4


def test_loss_is_cross_entropy_and_mask_selects_targets():
    model = tiny()
    g = torch.Generator().manual_seed(2)
    idx, tgt = (torch.randint(0, 97, (2, 16), generator=g),
                torch.randint(0, 97, (2, 16), generator=g))
    logits, _ = model(idx)
    losses, loss = model(idx, tgt)
    torch.testing.assert_close(
        losses, F.cross_entropy(logits.view(-1, 97), tgt.view(-1), reduction="none").view(2, 16))
    torch.testing.assert_close(loss, F.cross_entropy(logits.view(-1, 97), tgt.view(-1)))
    mask = torch.zeros(2, 16, dtype=torch.long)
    mask[0, 3:7] = 1
    mask[1, 10:] = 1
    _, masked = model(idx, tgt, mask)
    expected = F.cross_entropy(logits[mask.bool()], tgt[mask.bool()])
    torch.testing.assert_close(masked, expected)
    # targets under a 0 in the mask do not matter at all
    other = torch.where(mask.bool(), tgt, (tgt + 5) % 97)
    _, masked2 = model(idx, other, mask)
    torch.testing.assert_close(masked2, masked, rtol=0, atol=0)
    _, ones = model(idx, tgt, torch.ones(2, 16))
    torch.testing.assert_close(ones, loss)
    assert masked_mean(losses, torch.zeros(2, 16)).item() == 0.0  # no targets: 0, not NaN


@pytest.mark.parametrize("head", ["plain", "tied", "lora"])
def test_the_chunked_head_and_loss_equal_the_whole_logits(head):
    """ChunkedCrossEntropy (loss_chunk=5: chunks of 5 rows, the last one short) gives each
    target's loss and every gradient of the whole-logits path: with a loss mask (SFT), token
    weights (a weighted sum of two micro-batches), per-row losses (the mixture's per-source
    sums), tied embeddings, and a LoRA head (its adapter path is a second (input, weight) pair).
    With the softmax kept for backward (loss_recompute=False): the same losses bit for bit (the
    same forward), and the gradients of one backward over all rows to float rounding."""
    from techniques import lora
    g = torch.Generator().manual_seed(3)
    idx, tgt = (torch.randint(0, 97, (2, 2, 16), generator=g),
                torch.randint(0, 97, (2, 2, 16), generator=g))
    mask = (torch.rand(2, 2, 16, generator=g) < 0.5).float()
    runs = {}
    for chunk in (0, 5, "keep"):
        torch.manual_seed(0)
        model = tiny(tie_embeddings=head == "tied", loss_chunk=5 if chunk == "keep" else chunk,
                     loss_recompute=chunk != "keep")
        if head == "lora":
            lora.apply_lora(model, 4, 8.0, 0.0, ["wq", "output"], seed=1)
            with torch.no_grad():  # B starts at zero: give the adapters a path that matters
                for p in model.parameters():
                    if p.requires_grad:
                        p.add_(0.1 * torch.randn(
                            p.shape, generator=torch.Generator().manual_seed(p.numel())))
        per_row, total = [], 0
        for k, w in enumerate((0.7, 0.3)):  # token weights of two micro-batches
            losses, loss = model(idx[k], tgt[k], mask[k])
            (loss * w).backward()
            per_row.append(losses.detach())
        runs[chunk] = (per_row,
                       {n: p.grad for n, p in model.named_parameters() if p.grad is not None})
    (rows0, grads0), (rows5, grads5) = runs[0], runs[5]
    assert all(torch.equal(a, b) for a, b in zip(rows5, runs["keep"][0]))
    for n in grads5:
        torch.testing.assert_close(runs["keep"][1][n], grads5[n], rtol=1e-5, atol=1e-6, msg=n)
    for a, b in zip(rows0, rows5):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)
    assert (grads0.keys() == grads5.keys()
            and ("output.lora_B.weight" in grads0) == (head == "lora"))
    for n in grads0:
        torch.testing.assert_close(grads5[n], grads0[n], rtol=1e-5, atol=1e-6, msg=n)
    # and the function on its own: a head that is a bare Linear
    h = torch.randn(2, 16, 8, generator=g)
    lin = torch.nn.Linear(8, 97, bias=False)
    torch.testing.assert_close(cross_entropy_losses(h, lin, tgt[0], 7),
                               cross_entropy_losses(h, lin, tgt[0]), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("head", ["plain", "lora"])
def test_the_chunked_loss_under_bf16_autocast(head):
    """Under autocast (dtype=bfloat16; here on the CPU) the chunked backward recomputes the
    logits in autocast's dtype as the forward did, so its gradients are the whole path's up to
    bf16 rounding (measured 3.2e-3 of each gradient's largest entry, 6.0e-3 with a LoRA head,
    attention in float32 on a CPU; recomputed in float32 instead: 1.2e-2, and a LoRA head's bf16
    adapter input meets a float32 weight: an error). The softmax kept instead
    (loss_recompute=False): the recomputing one's gradients up to the rounding of one bf16 backward
    over all rows, not chunks."""
    from techniques import lora
    g = torch.Generator().manual_seed(3)
    idx, tgt = (torch.randint(0, 97, (2, 16), generator=g),
                torch.randint(0, 97, (2, 16), generator=g))
    grads = {}
    for chunk in (0, 5, "keep"):
        torch.manual_seed(0)
        model = tiny(loss_chunk=5 if chunk == "keep" else chunk, loss_recompute=chunk != "keep")
        if head == "lora":
            lora.apply_lora(model, 4, 8.0, 0.0, ["wq", "output"], seed=1)
            with torch.no_grad():
                for p in model.parameters():
                    if p.requires_grad:
                        p.add_(0.1 * torch.randn(
                            p.shape, generator=torch.Generator().manual_seed(p.numel())))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            _, loss = model(idx, tgt)
        loss.backward()
        grads[chunk] = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    for n, want in grads[0].items():
        assert (grads[5][n] - want).abs().max() <= 8e-3 * want.abs().max(), n
        assert (grads["keep"][n] - grads[5][n]).abs().max() <= 8e-3 * want.abs().max(), n


def test_the_kept_softmax_serves_one_backward():
    """loss_recompute=False turns the kept softmax into the gradient in place: a second backward
    through the same graph (retain_graph) is refused by autograd's check of saved tensors, where it
    would give a wrong gradient. Without grad (evaluation) nothing is kept."""
    model = tiny(loss_chunk=5, loss_recompute=False)
    idx = torch.randint(0, 97, (2, 16), generator=torch.Generator().manual_seed(0))
    keeps, inner = [], model.loss_fn
    model.loss_fn = lambda h, head, targets, chunk, keep: keeps.append(keep) or inner(
        h, head, targets, chunk, keep)
    with torch.no_grad():
        model(idx, idx)
    _, loss = model(idx, idx)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()
    assert keeps == [False, True]


def test_gqa_shapes_and_equivalence_with_repeated_heads():
    gqa = tiny(n_head=4, n_kv_head=2)
    hd = 32 // 4
    att = gqa.layers["0"].attention
    assert att.wq.weight.shape == (4 * hd, 32)
    assert att.wk.weight.shape == (2 * hd, 32) and att.wv.weight.shape == (2 * hd, 32)
    # GQA is multi-head attention whose k/v heads come in identical groups: build that MHA
    mha = tiny(n_head=4, n_kv_head=4)
    sd = gqa.state_dict()
    for i in range(2):
        for w in ("wk", "wv"):
            key = f"layers.{i}.attention.{w}.weight"
            sd[key] = sd[key].view(2, hd, 32).repeat_interleave(2, dim=0).reshape(4 * hd, 32)
    mha.load_state_dict(sd)
    idx = torch.randint(0, 97, (3, 16), generator=torch.Generator().manual_seed(3))
    logits, _ = gqa(idx)
    assert logits.shape == (3, 16, 97)
    torch.testing.assert_close(mha(idx)[0], logits)
    with pytest.raises(ValueError, match="divisible by n_kv_head"):
        ModelConfig(n_head=4, n_kv_head=3, n_embd=32)


def test_rope_scores_depend_only_on_relative_position():
    cos, sin = rope_tables(8, 32, 10000.0)
    g = torch.Generator().manual_seed(4)
    q, k = torch.randn(1, 1, 1, 8, generator=g), torch.randn(1, 1, 1, 8, generator=g)

    def score(m, n):
        qm = apply_rope(q, cos[m:m + 1], sin[m:m + 1])
        kn = apply_rope(k, cos[n:n + 1], sin[n:n + 1])
        return (qm * kn).sum()

    torch.testing.assert_close(score(5, 2), score(20, 17))
    assert not torch.allclose(score(5, 2), score(5, 4))


def test_generate_length_and_cropping():
    model = tiny()
    out = model.generate(torch.zeros(2, 3, dtype=torch.long), 20, temperature=0.8, top_k=5)
    assert out.shape == (2, 23)  # longer than block_size=16: the context is cropped
    assert out.max() < 97
    greedy = model.generate(torch.zeros(1, 3, dtype=torch.long), 5, temperature=0)
    torch.testing.assert_close(
        greedy, model.generate(torch.zeros(1, 3, dtype=torch.long), 5, temperature=0))


def test_kv_cache_gives_the_uncached_logits_and_samples():
    """GQA (2 kv heads for 4 query heads): the cache's logits (a prompt, then one token, then a
    chunk of several) are the full forward's, and generate with and without the cache samples
    the same tokens for one seed, past block_size (where the cached path re-runs the window)."""
    model = tiny()
    # larger weights than the init: peaked logits, so sampling depends on them
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.3)
    x = torch.randint(0, 97, (2, 16), generator=torch.Generator().manual_seed(1))
    cache = {name: KVCache() for name in model.layers}
    pieces = [model(x[:, :5], cache=cache)[0],
              *(model(x[:, i:i + 1], cache=cache)[0] for i in range(5, 12)),
              model(x[:, 12:], cache=cache)[0]]
    assert len(cache["0"]) == 16 and cache["0"].k.shape == (2, 2, 16, 8)
    torch.testing.assert_close(torch.cat(pieces, dim=1), model(x)[0])
    for prompt in (x[:, :3], x):  # shorter than block_size=16; as long
        for temperature, top_k in ((0, None), (0.8, 5), (1.0, None)):
            outs = []
            for kv_cache in (True, False):
                torch.manual_seed(3)
                outs.append(model.generate(prompt, 24, temperature, top_k, kv_cache=kv_cache))
            assert outs[0].shape == (2, prompt.shape[1] + 24)
            assert torch.equal(outs[0], outs[1]), (prompt.shape, temperature, top_k)


def test_sliding_window_sees_the_last_window_tokens_of_its_document():
    """One layer (its receptive field is the window itself), window 4, q/k/v biases, two
    documents: each position's logits are those of a forward over only what it may see, the
    last <= 4 tokens of its document (RoPE is relative). With two layers the KV cache's
    pieces (a prompt, one token, a chunk) equal the whole forward; the window does mask."""
    for n_layer in (1, 2):
        model = tiny(n_layer=n_layer, sliding_window=4, qkv_bias=True)
        with torch.no_grad():
            for p in model.parameters():
                p.normal_(0.0, 0.3)
        x = torch.randint(0, 97, (2, 16), generator=torch.Generator().manual_seed(1))
        if n_layer == 1:
            doc = torch.tensor([[0] * 6 + [1] * 10] * 2)
            full = model(x, doc_ids=doc)[0]
            for i in range(16):
                start = max(i - 3, 0 if i < 6 else 6)
                torch.testing.assert_close(full[:, i], model(x[:, start:i + 1])[0][:, -1],
                                           msg=str(i))
            continue
        cache = {name: KVCache() for name in model.layers}
        pieces = [model(x[:, :5], cache=cache)[0], model(x[:, 5:6], cache=cache)[0],
                  model(x[:, 6:], cache=cache)[0]]
        torch.testing.assert_close(torch.cat(pieces, dim=1), model(x)[0])
        model.cfg.sliding_window = 0
        assert (model(x)[0] - torch.cat(pieces, dim=1)).abs().max() > 1e-3


def test_names_init_and_tying():
    model = tiny(n_layer=3)
    names = set(model.state_dict())
    assert {"tok_embeddings.weight", "layers.2.attention.wq.weight",
            "layers.2.feed_forward.w2.weight", "norm.weight", "output.weight"} <= names
    assert not any("rope" in n for n in names)  # derived buffers are not checkpointed
    std = lambda n: model.state_dict()[n].std().item()  # noqa: E731
    assert abs(std("layers.0.attention.wq.weight") - 0.02) < 0.003
    assert abs(std("layers.0.attention.wo.weight") - 0.02 / math.sqrt(6)) < 0.002
    tied = tiny(tie_embeddings=True)
    assert tied.output.weight is tied.tok_embeddings.weight
    assert tied.num_params() == tiny().num_params() - 97 * 32  # one table, counted once


def test_flops_per_token_counts_matmul_weights():
    model = tiny()
    cfg = model.cfg
    per_layer = 2 * 32 * 32 + 2 * 32 * 16 + 3 * 32 * cfg.ffn_dim  # wq, wo, wk, wv, w1/w2/w3
    # + head; norm gains are tiny extras
    expected = 6 * (2 * per_layer + 32 * 97) + 12 * 2 * 32 * 16
    assert abs(model.flops_per_token() - expected) / expected < 0.01


# ------------------------------------------------------------------------- packed documents

def test_doc_ids_keep_documents_apart():
    model = tiny()
    idx = torch.randint(0, 97, (2, 16), generator=torch.Generator().manual_seed(3))
    doc_ids = torch.tensor([[0] * 6 + [1] * 10, [4] * 16])  # row 0: two documents; row 1: one
    changed = idx.clone()
    changed[0, 1:6] = (changed[0, 1:6] + 1) % 97  # edit document 0 of row 0
    a, _ = model(idx, doc_ids=doc_ids)
    b, _ = model(changed, doc_ids=doc_ids)
    torch.testing.assert_close(b[0, 6:], a[0, 6:], rtol=0, atol=0)  # document 1 never saw it
    assert (a[0, 1:6] - b[0, 1:6]).abs().max() > 1e-4
    plain_a, plain_b = model(idx)[0], model(changed)[0]
    assert (plain_a[0, 6:] - plain_b[0, 6:]).abs().max() > 1e-4  # without doc_ids it leaks across
    torch.testing.assert_close(a[1], plain_a[1])  # one document: plain causal attention
    # rotary scores see relative positions only: document 1 at offset 6 is document 1 alone
    torch.testing.assert_close(a[0, 6:], model(idx[:1, 6:])[0][0], rtol=1e-4, atol=1e-5)


def test_doc_ids_in_pipeline_stages_and_with_grad_ckpt():
    idx = torch.randint(0, 97, (2, 16), generator=torch.Generator().manual_seed(4))
    doc_ids = torch.tensor([[0] * 5 + [1] * 7 + [2] * 4, [0] * 9 + [1] * 7])
    full, _ = tiny()(idx, doc_ids=doc_ids)
    first, last = make_stage(tiny(), 0, 2), make_stage(tiny(), 1, 2)
    h, _ = first(idx, doc_ids=doc_ids)
    torch.testing.assert_close(last(h, doc_ids=doc_ids)[0], full, rtol=0, atol=0)
    assert (last(h)[0] - full).abs().max() > 1e-4  # the stage without the embedding uses them too
    grads = []
    for ckpt in (False, True):
        model = tiny().train()
        if ckpt:  # (every policy on every layout: test_activations.py)
            activations.apply(model, "full")
        _, loss = model(idx, idx, doc_ids=doc_ids)
        loss.backward()
        grads.append([p.grad for p in model.parameters()])
    for g0, g1 in zip(*grads):
        torch.testing.assert_close(g1, g0)


def test_neftune_noise_in_training_only():
    idx = torch.randint(0, 97, (2, 16), generator=torch.Generator().manual_seed(5))
    plain, noisy = tiny(), tiny(neftune_alpha=5.0)
    torch.testing.assert_close(noisy(idx)[0], plain(idx)[0], rtol=0, atol=0)  # eval: untouched
    plain.train(), noisy.train()
    # no dropout: train == eval
    torch.testing.assert_close(plain(idx)[0], plain.eval()(idx)[0], rtol=0, atol=0)
    assert (noisy(idx)[0] - plain.train()(idx)[0]).abs().max() > 1e-3
    # the noise is U(-1, 1) * alpha / sqrt(T * n_embd) on the embeddings: capture them
    seen = []
    noisy.layers["0"].register_forward_pre_hook(lambda m, args: seen.append(args[0]))
    noisy(idx)
    noise = seen[0] - noisy.tok_embeddings(idx)
    bound = 5.0 / (16 * 32) ** 0.5
    assert noise.abs().max() <= bound and noise.abs().max() > 0.9 * bound


def test_grow_vocab():
    model = tiny()
    emb, out = model.tok_embeddings.weight.detach().clone(), model.output.weight.detach().clone()
    grow_vocab(model, 120)
    assert model.cfg.vocab_size == 120 and model.tok_embeddings.weight.shape == (120, 32)
    torch.testing.assert_close(model.tok_embeddings.weight[:97], emb, rtol=0, atol=0)
    torch.testing.assert_close(model.output.weight[:97], out, rtol=0, atol=0)
    torch.testing.assert_close(model.tok_embeddings.weight[97:], emb.mean(0).expand(23, -1))
    torch.testing.assert_close(model.output.weight[97:], out.mean(0).expand(23, -1))
    assert model(torch.tensor([[119, 3]]))[0].shape == (1, 2, 120)
    grow_vocab(model, 120)  # no-op
    assert model.tok_embeddings.weight.shape == (120, 32)
    with pytest.raises(ValueError, match="smaller"):
        grow_vocab(model, 100)
    tied = grow_vocab(tiny(tie_embeddings=True), 100)
    assert (tied.output.weight is tied.tok_embeddings.weight
            and tied.output.weight.shape == (100, 32))
    head = make_stage(tiny(), 1, 2)  # the last pipeline stage: a head, no embedding
    grow_vocab(head, 100)
    torch.testing.assert_close(head.output.weight[97:], out.mean(0).expand(3, -1))


def test_muon_with_adamw_steps_like_torch_muon_and_torch_adamw():
    """One optimizer, two kinds of group: the muon=True group must step exactly as
    torch.optim.Muon (match_rms_adamw: one learning rate for both), the others exactly as
    torch.optim.AdamW, weight decay and all, over several steps (state carried between them)."""
    g = torch.Generator().manual_seed(0)
    shapes = [(48, 32), (32, 80), (100, 32), (32,)]  # 2 hidden matrices, an embedding, a gain
    ours = [torch.randn(s, generator=g).requires_grad_() for s in shapes]
    peers = [p.detach().clone().requires_grad_() for p in ours]
    opt = MuonWithAdamW([{"params": ours[:2], "muon": True, "weight_decay": 0.1},
                         {"params": ours[2:3], "weight_decay": 0.1},
                         {"params": ours[3:], "weight_decay": 0.0}],
                        lr=0.02, betas=(0.9, 0.95), momentum=0.95, ns_dtype=torch.bfloat16)
    muon = torch.optim.Muon(peers[:2], lr=0.02, weight_decay=0.1, momentum=0.95,
                            adjust_lr_fn="match_rms_adamw")
    adamw = torch.optim.AdamW([{"params": peers[2:3], "weight_decay": 0.1},
                               {"params": peers[3:], "weight_decay": 0.0}],
                              lr=0.02, betas=(0.9, 0.95))
    for step in range(4):
        for a, b in zip(ours, peers):
            a.grad = torch.randn(a.shape, generator=g)
            b.grad = a.grad.clone()
        opt.step(), muon.step(), adamw.step()
        for i, (a, b) in enumerate(zip(ours, peers)):
            assert torch.equal(a, b), (step, i, (a - b).abs().max())
    # the orthogonalization: singular values pushed near 1 (the quintic's band), any aspect ratio
    for shape in [(64, 16), (16, 64)]:
        sv = torch.linalg.svdvals(
            newton_schulz(torch.randn(shape, generator=g), dtype=torch.float32))
        assert 0.6 < sv.min() and sv.max() < 1.25, sv
    # a stack of matrices of one shape (how newton_schulz_each batches them): each as if alone,
    # and a list of mixed shapes comes back in its order
    gs = [torch.randn(s, generator=g) for s in [(48, 32), (32, 80), (48, 32), (80, 32), (48, 32)]]
    torch.testing.assert_close(newton_schulz(torch.stack(gs[::2]), dtype=torch.float32),
                               torch.stack(
                                   [newton_schulz(m, dtype=torch.float32) for m in gs[::2]]))
    for update, m in zip(newton_schulz_each(gs, torch.float32), gs):
        torch.testing.assert_close(update, newton_schulz(m, dtype=torch.float32))


def group_of_each_name(model, optim):
    """{parameter name: (weight decay, lr scale, Muon?)} of the optimizer build_optimizer makes
    for `model` (one process), each trainable parameter in exactly one group."""
    from types import SimpleNamespace

    from optim import build_optimizer
    mesh = SimpleNamespace(device=torch.device("cpu"), dp=1, tp=1, print0=lambda *a: None)
    c = dict(optim=optim, weight_decay=0.1, embed_lr_scale=10.0, beta1=0.9, beta2=0.95,
             offload=False, learning_rate=1e-3, muon_momentum=0.95)
    optimizer, _ = build_optimizer(model, model, mesh, c)
    where = [(id(p), (g["weight_decay"], g.get("lr_scale", 1.0), g.get("muon", False)))
             for g in optimizer.param_groups for p in g["params"]]
    assert len(where) == len({i for i, _ in where}), "a parameter in two groups"
    where = dict(where)
    return {n: where.get(id(p)) for n, p in model.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("optim", ["adamw", "muon"])
def test_the_optimizer_groups_by_name(optim):
    """Weight decay on matrices, none on norm gains; the embedding at embed_lr_scale x the
    rate; under Muon the layers' matrices in its group and the embedding, head and gains with
    AdamW (tied: the one embedding-head tensor in the embedding's group, also as a pipeline's
    last stage's copy); LoRA: the adapters
    alone, with AdamW and decay (Muon is for whole weight matrices)."""
    muon = optim == "muon"
    for tied in (False, True):
        groups = group_of_each_name(tiny_model(n_layer=2, tie_embeddings=tied), optim)
        want = {"tok_embeddings.weight": (0.1, 10.0, False), "norm.weight": (0.0, 1.0, False),
                **({} if tied else {"output.weight": (0.1, 1.0, False)})}
        for i in range(2):
            want.update({f"layers.{i}.{n}.weight": (0.0, 1.0, False)
                         for n in ("attention_norm", "ffn_norm")})
            want.update({f"layers.{i}.{n}.weight": (0.1, 1.0, muon) for n in (
                "attention.wq", "attention.wk", "attention.wv", "attention.wo",
                "feed_forward.w1", "feed_forward.w2", "feed_forward.w3")})
        assert groups == want, (
            tied, {n: (g, want.get(n)) for n, g in groups.items() if g != want.get(n)})
    # Qwen2's q/k/v biases: vectors, with AdamW and without decay, as the norm gains
    biases = group_of_each_name(tiny_model(n_layer=1, qkv_bias=True), optim)
    assert {n: g for n, g in biases.items() if n.endswith(".bias")} == {
        f"layers.0.attention.{m}.bias": (0.0, 1.0, False) for m in ("wq", "wk", "wv")}, biases
    # a pipeline's last stage of a tied model: its head is the embedding's copy,
    # in the embedding's group
    last = group_of_each_name(make_stage(tiny_model(n_layer=2, tie_embeddings=True), 1, 2), optim)
    assert (last["output.weight"] == (0.1, 10.0, False)
            and last["norm.weight"] == (0.0, 1.0, False)), last
    from techniques import lora
    model = tiny_model(n_layer=1)
    lora.apply_lora(model, 2, 4.0, 0.0, ["wq", "output"], seed=0)
    assert group_of_each_name(model, optim) == {f"{m}.lora_{ab}.weight": (0.1, 1.0, False)
                                                for m in ("layers.0.attention.wq", "output")
                                                for ab in "AB"}


@pytest.mark.parametrize("schedule", ["cosine", "wsd"])
def test_lr_schedule_equals_torch_schedulers(schedule):
    """get_lr against the same schedule chained from torch's schedulers: linear warmup, then a
    cosine (or flat, then a linear cooldown over the last quarter) to min_lr at lr_decay_iters,
    and min_lr after it."""
    from torch.optim.lr_scheduler import ConstantLR, CosineAnnealingLR, LinearLR, SequentialLR
    c = dict(learning_rate=1e-2, min_lr=1e-3, warmup_iters=5, lr_decay_iters=40, max_iters=50,
             lr_schedule=schedule, cooldown_frac=0.25)
    lr, lo, warmup, decay = 1e-2, 1e-3, 5, 40
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=lr)
    after = ConstantLR(opt, factor=lo / lr, total_iters=10 ** 9)
    warm = LinearLR(opt, start_factor=1 / warmup, end_factor=1.0, total_iters=warmup - 1)
    if schedule == "cosine":
        parts, milestones = ([warm,
                              CosineAnnealingLR(opt, T_max=decay - warmup, eta_min=lo), after],
                             [warmup, decay])
    else:
        cool = 10  # a quarter of 40
        parts = [warm, ConstantLR(opt, factor=1.0, total_iters=0),
                 LinearLR(opt, 1.0, lo / lr, total_iters=cool), after]
        milestones = [warmup, decay - cool, decay]
    sched = SequentialLR(opt, parts, milestones)
    for it in range(50):
        assert math.isclose(get_lr(it, c), opt.param_groups[0]["lr"], rel_tol=1e-9), it
        opt.step()
        sched.step()


def test_attention_runs_in_float32_under_cpu_bf16_autocast(monkeypatch):
    """dtype=auto picks bf16 on AVX512-BF16 CPUs, where torch's flash-cpu attention backward is
    ~7x slower in bf16 than in float32: model.Attention hands SDPA float32 q, k, v outside
    autocast on a CPU (each of the 2 layers)."""
    import torch.nn.functional as F
    seen, sdpa = [], F.scaled_dot_product_attention

    def spy(q, k, v, **kw):
        seen.append((q.dtype, k.dtype, v.dtype, torch.is_autocast_enabled("cpu")))
        return sdpa(q, k, v, **kw)
    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    model = tiny()
    idx = torch.randint(0, 97, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        model(idx)
    assert len(seen) == 2 and all(s == (torch.float32, torch.float32, torch.float32, False)
                                  for s in seen), seen


@pytest.mark.parametrize("doc_mask, dropout", [(False, 0.0), (True, 0.0), (False, 0.3)])
def test_float32_attention_keeps_only_bf16_for_backward(doc_mask, dropout):
    """The float32 q, k, v and output of that attention are not kept for backward (twice bf16's:
    at SmolLM2's shape more than transformers keeps): backward runs it again from the bf16 q, k, v
    (model.attend), with the gradients of keeping them, bit for bit, under dropout too (the
    recompute draws the forward's mask again). recompute=False keeps them: the check on what is
    kept can fail. It is the default unless the block is recomputed (activations.py)."""
    idx = torch.randint(0, 97, (2, 16), generator=torch.Generator().manual_seed(0))
    docs = torch.tensor([[0] * 6 + [1] * 10, [0] * 16]) if doc_mask else None
    for ac in ("none", "full", "op", "layers:2"):
        model = tiny()
        activations.apply(model, ac)
        assert [b.attention.recompute for b in model.layers.values()] == [
            ac == "none", ac in ("none", "layers:2")]

    def run(recompute):
        model = tiny(dropout=dropout).train()
        for layer in model.layers.values():
            # (True: the default's)
            layer.attention.recompute = layer.attention.recompute and recompute
        kept = []
        torch.manual_seed(1)

        def pack(t):
            kept.append((t.dtype, t.dim(), tuple(t.shape)))
            return t
        with (torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t),
              torch.autocast("cpu", dtype=torch.bfloat16)):
            _, loss = model(idx, idx.roll(-1, 1), doc_ids=docs)
        loss.backward()
        # (B, heads, T, head_dim)
        heads = [k for k in kept if k[0] == torch.float32 and k[1] == 4 and k[2][-1] == 8]
        return heads, [p.grad for p in model.parameters()]
    heads, grads = run(True)
    assert heads == []
    heads_kept, grads_kept = run(False)
    # q, k, v and the output of each of the 2 layers (with dropout SDPA's math kernel keeps others)
    assert len(heads_kept) >= 2 * 4 or dropout, heads_kept
    assert all(torch.equal(a, b) for a, b in zip(grads, grads_kept))
