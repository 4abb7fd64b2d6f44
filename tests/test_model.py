import math

import pytest
import torch
import torch.nn.functional as F

from model import ModelConfig, Transformer, apply_rope, masked_cross_entropy, rope_tables


def tiny(**kw):
    torch.manual_seed(0)
    cfg = dict(vocab_size=97, block_size=16, n_layer=2, n_head=4, n_kv_head=2, n_embd=32)
    return Transformer(ModelConfig(**{**cfg, **kw})).eval()


def test_causal_future_tokens_do_not_change_the_past():
    model = tiny()
    idx = torch.randint(0, 97, (2, 16), generator=torch.Generator().manual_seed(1))
    changed = idx.clone()
    changed[:, 9] = (changed[:, 9] + 1) % 97
    a, _ = model(idx)
    b, _ = model(changed)
    torch.testing.assert_close(a[:, :9], b[:, :9], rtol=0, atol=0)
    assert (a[:, 9:] - b[:, 9:]).abs().max() > 1e-4  # and the token does matter from its position on


def test_loss_is_cross_entropy_and_mask_selects_targets():
    model = tiny()
    g = torch.Generator().manual_seed(2)
    idx, tgt = torch.randint(0, 97, (2, 16), generator=g), torch.randint(0, 97, (2, 16), generator=g)
    logits, loss = model(idx, tgt)
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
    assert masked_cross_entropy(logits, tgt, torch.zeros(2, 16)).item() == 0.0  # no targets: 0, not NaN


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
    torch.testing.assert_close(greedy, model.generate(torch.zeros(1, 3, dtype=torch.long), 5, temperature=0))


def test_grad_ckpt_gives_the_same_gradients():
    idx = torch.randint(0, 97, (2, 16), generator=torch.Generator().manual_seed(5))
    grads = []
    for ckpt in (False, True):
        model = tiny(grad_ckpt=ckpt).train()
        _, loss = model(idx, idx)
        loss.backward()
        grads.append({n: p.grad for n, p in model.named_parameters()})
    for name in grads[0]:
        torch.testing.assert_close(grads[1][name], grads[0][name], msg=name)


def test_names_init_and_tying():
    model = tiny(n_layer=3)
    names = set(model.state_dict())
    assert {"tok_embeddings.weight", "layers.2.attention.wq.weight", "layers.2.feed_forward.w2.weight",
            "norm.weight", "output.weight"} <= names
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
    expected = 6 * (2 * per_layer + 32 * 97) + 12 * 2 * 32 * 16  # + head; norm gains are tiny extras
    assert abs(model.flops_per_token() - expected) / expected < 0.01
