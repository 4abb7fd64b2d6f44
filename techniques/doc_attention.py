"""
Attention that stays inside each document of a packed row (doc_mask=True), two ways:

- document_mask: the dense (B, 1, T, T) boolean mask, one SDPA over the whole row. The
  reference, and simple, but its memory grows with T^2 and every masked-out score is still
  computed: at T = 8,192 with documents of ~500 tokens, 94% of the causal work is thrown away.
- Documents.attend: each document's own causal attention (doc_attention='varlen', the
  default). What flash_attn_varlen_func and torch's varlen_attn do with cu_seqlens (the
  documents' start offsets), written with SDPA: the documents of every row are cut out, those
  of equal length stacked into one batch, and each batch runs SDPA's plain causal kernel.
  Nothing between documents is computed or stored. Equal to the dense mask to float rounding
  (tests/test_doc_attention.py); `python bench.py docmask` measures both against plain causal.

FlexAttention's document block mask is the other fast way, but this torch's FlexAttention has
no backward on the CPU, and SDPA's per-document calls need no compiler. Context parallelism
(context_parallel.py) builds its blocks' masks from Documents.ids, never the T x T one.
"""

import torch


def document_mask(doc_ids):
    """(B, 1, T, T) boolean attention mask from doc_ids (B, T): position i sees j iff j <= i
    and both are in the same document."""
    T = doc_ids.shape[1]
    same_doc = doc_ids[:, :, None] == doc_ids[:, None, :]                      # (B, T, T)
    causal = torch.ones(T, T, dtype=torch.bool, device=doc_ids.device).tril()  # (T, T)
    return (same_doc & causal)[:, None]                                        # (B, 1, T, T)


class Documents:
    """The documents of a batch of packed rows, doc_ids (B, T) (data.doc_ids): what model.py
    passes its attention layers instead of a mask. Built once per forward and shared by every
    layer: the documents' positions, grouped by length, are found once."""

    def __init__(self, doc_ids, dense=False):
        self.ids = doc_ids
        # dense: attend through the document mask instead, built once for every layer
        self.mask = document_mask(doc_ids) if dense else None
        if dense:
            return
        B, T = doc_ids.shape
        # a document starts where its row starts or its id changes; positions in the flattened
        # (B * T) batch, so that the documents of every row are cut out alike
        new = torch.ones(B, T, dtype=torch.bool, device=doc_ids.device)
        new[:, 1:] = doc_ids[:, 1:] != doc_ids[:, :-1]
        starts = new.reshape(-1).nonzero()[:, 0]
        lengths = torch.diff(starts, append=starts.new_tensor([B * T]))
        # one (n, L) tensor per length L, the flattened positions of the n documents that long:
        # padding's one-token documents all share one call
        self.groups = [starts[lengths == n][:, None] + torch.arange(n, device=starts.device)
                       for n in torch.unique(lengths).tolist()]
        # where each position's output lies in the groups' outputs laid end to end
        self.back = torch.argsort(torch.cat([g.reshape(-1) for g in self.groups]))

    def attend(self, q, k, v, sdpa):
        """Each document's own causal attention of q (B, H, T, hd) over k, v (B, H_kv, T, hd):
        sdpa(q, k, v, None) runs plain causal attention on (n, H, L, hd) batches of documents of
        length L. Returns (B, H, T, hd). dense: sdpa(q, k, v, mask) once, with the document mask
        (k and v repeated to H heads: CUDA's kernel for masks needs equal head counts)."""
        B, H, T, hd = q.shape
        if self.mask is not None:
            k, v = (t.repeat_interleave(H // t.shape[1], dim=1) for t in (k, v))
            return sdpa(q, k, v, self.mask)

        def tokens(t):  # (B, heads, T, hd) -> (B * T, heads, hd)
            return t.transpose(1, 2).reshape(B * T, t.shape[1], hd)

        q, k, v = tokens(q), tokens(k), tokens(v)
        outs = []
        for g in self.groups:
            n, L = g.shape
            qs, ks, vs = (t.index_select(0, g.reshape(-1)).view(n, L, -1, hd).transpose(1, 2)
                          for t in (q, k, v))
            outs.append(sdpa(qs, ks, vs, None).transpose(1, 2).reshape(n * L, H, hd))
        y = torch.cat(outs).index_select(0, self.back)  # back in the batch's order
        return y.view(B, T, H, hd).transpose(1, 2)
