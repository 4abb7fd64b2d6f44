"""The output head + cross-entropy alone, forward and backward, at vocab 8k, 32k and 128k
(train.py's micro-batch of rows, its width): all logits at once (loss_chunk=0) against
model.ChunkedCrossEntropy (loss_chunk=128), its backward recomputing each chunk's logits or
keeping their softmax (loss_recompute=False), ms and the peak memory above the inputs (CUDA: max
allocated; CPU: max RSS), each row in a fresh process."""

import torch

from model import cross_entropy_losses

from bench.base import ITERS, TRAIN, in_subprocess, peak_and_median


def head_row(vocab, chunk, rows, width, keep=False):
    """Head + loss forward and backward on `rows` rows of `width`: median ms, and the peak memory
    above the inputs' in MB."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    g = torch.Generator().manual_seed(0)
    h = torch.randn(1, rows, width, generator=g).to(device).requires_grad_()
    head = torch.nn.Linear(width, vocab, bias=False).to(device)
    y = torch.randint(0, vocab, (1, rows), generator=g).to(device)
    # the gradients exist in both
    h.grad, head.weight.grad = torch.zeros_like(h), torch.zeros_like(head.weight)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")
    torch.backends.cuda.matmul.allow_tf32 = True  # as train.py on CUDA

    def step():
        # as train.py: bf16 matmuls on CUDA (the backward restores it), float32 on CPU
        with autocast:
            losses = cross_entropy_losses(h, head, y, chunk, keep)
        losses.mean().backward()
    return peak_and_median(step, device)


def table_head(vocabs=(8192, 32768, 131072), chunk=128, rows=None, width=None):
    rows, width = rows or TRAIN["batch_size"] * TRAIN["block_size"], width or TRAIN["n_embd"]
    print(f"\n## head + loss: {rows} rows (batch x block) of width {width}, forward and backward, "
          f"median of {ITERS}; all logits at once vs chunks of {chunk} rows "
          "(model.ChunkedCrossEntropy), recomputed in backward or their softmax kept "
          "(loss_recompute=False)")
    print(f"{'vocab':>7} | {'logits':>9} | {'whole ms':>8} | {'chunked ms':>10} | {'kept ms':>7} "
          f"| {'whole peak':>10} | {'chunked peak':>12} | {'kept peak':>9}")
    print("-" * 99)
    for v in vocabs:
        whole, chunked, kept = (
            in_subprocess("head", vocab=v, chunk=c, rows=rows, width=width, keep=k)
            for c, k in ((0, False), (chunk, False), (chunk, True)))
        print(f"{v:7,} | {rows * v * 4 / 2 ** 20:6.0f} MB | {whole['ms']:8.1f} | "
              f"{chunked['ms']:10.1f} | {kept['ms']:7.1f} | {whole['peak_mb']:7.0f} MB | "
              f"{chunked['peak_mb']:9.0f} MB | {kept['peak_mb']:6.0f} MB", flush=True)
