"""
Pipeline parallel, by hand: the stage split (layers per stage balanced by estimated cost,
make_stage cuts a built model to one stage), point-to-point helpers shared by training and
evaluation, and the schedules: GPipe (the reference), 1F1B in three named phases, and
interleaved 1F1B over virtual stages; plus an ASCII timeline of a measured schedule.
"""

import time
from contextlib import nullcontext
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn as nn

from parallel import Mesh, all_gather_object, set_grad_sync

# ---------------------------------------------------------------------------------------
# the stage split


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
    attn = cfg.n_embd * cfg.head_dim * (2 * cfg.n_head + 2 * cfg.n_kv_head)  # wq, wo; wk, wv
    scores = 4 * cfg.n_head * cfg.head_dim * cfg.block_size  # q k^T and the values' sum
    block = 2 * (attn + 3 * cfg.n_embd * cfg.ffn_dim) + scores
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
        (f"layer counts {counts} do not split {model.cfg.n_layer} layers into {pp} x {virtual} "
         f"stages")
    model.chunks = [stage_layers(counts, v * pp + stage) for v in range(virtual)]
    model.layers = nn.ModuleDict({str(i): model.layers[str(i)] for chunk in model.chunks
                                  for i in chunk})
    if stage > 0:
        model.tok_embeddings = None
    if stage < pp - 1:
        model.norm = model.output = None
    return model


# ---------------------------------------------------------------------------------------
# pipeline parallel, by hand
#
# Stage s owns a contiguous range of layers (make_stage, above): stage 0 also the embedding,
# the last stage the final norm, the head and the loss. A micro-batch's forward flows
# stage 0 -> 1 -> ... -> pp-1 (activations sent forward); its backward flows back (the
# gradients of those activations sent backward). A micro-batch is one tuple
# (x, y, loss_mask, doc_ids) of (B, T) tensors or None. Two schedules, each a short function
# over the micro-batches of one iteration, built from the same forward_step / backward_step
# and the same point-to-point steps:
#   gpipe (all forwards, then all backwards): the reference. Every micro-batch's activations
#         stay alive until the backwards start: m per stage.
#   one_f_one_b: a warmup of min(pp - stage - 1, m) forwards, a steady state of one forward /
#         one backward, a cooldown of the backwards left over. At most pp - stage micro-batches
#         are alive at once, with the same bubble as GPipe: (pp - 1) / (m + pp - 1) idle.
#   interleaved (Narayanan et al. 2021, Megatron's interleaved 1F1B): each rank holds V chunks
#         of layers, virtual stages v * pp + rank (make_stage(virtual=V)); a micro-batch goes
#         through the ranks V times, rank pp-1 handing chunk v's output to rank 0's chunk v+1.
#         The bubble shrinks V-fold, to (pp - 1) / (V * m + pp - 1) idle, for V times the
#         point-to-point traffic.
# Micro-batch k's backward starts from weights[k] * loss_k: the gradients of the micro-batches
# add up, so weights 1/m give the gradient of the mean loss (as the plain loop's loss / m).


@torch.no_grad()
def p2p(mesh, send_next=None, send_prev=None, recv_prev=None, recv_next=None, ring=False):
    """One round of point-to-point traffic with the neighbouring stages of this pipeline.
    send_*: a tensor to send; recv_*: a buffer to fill (shapes are known up front, so none
    are exchanged). Everything is posted at once and then waited for (batch_isend_irecv), so
    two neighbours sending to each other at the same moment cannot deadlock. On a first or
    last stage the missing neighbour's half is a no-op: nothing comes before stage 0, nothing
    after the last; ring=True (interleaved chunks) wraps around instead: rank pp-1's next is
    rank 0. Sends go in the order (next, prev) and receives (prev, next): at pp=2 both
    neighbours are one rank, and the two messages between them pair up in that order."""
    prv = None if mesh.first_stage and not ring else mesh.stage_rank((mesh.pp_rank - 1) % mesh.pp)
    nxt = None if mesh.last_stage and not ring else mesh.stage_rank((mesh.pp_rank + 1) % mesh.pp)
    ops = [dist.P2POp(op, t, peer)
           for op, t, peer in ((dist.isend, send_next, nxt), (dist.isend, send_prev, prv),
                               (dist.irecv, recv_prev, prv), (dist.irecv, recv_next, nxt))
           if t is not None and peer is not None]
    if ops:
        for work in dist.batch_isend_irecv(ops):
            work.wait()


# The point-to-point steps of the schedules (and of evaluation), one p2p round each. `shape`
# is the shape of the activations between stages, (B, T, n_embd); a receive on a stage
# without that neighbour returns None.

def recv_forward(mesh, shape):
    inp = None if mesh.first_stage else torch.empty(shape, device=mesh.device)
    p2p(mesh, recv_prev=inp)
    return inp


def send_forward(mesh, out):
    p2p(mesh, send_next=out)


def recv_backward(mesh, shape):
    grad = None if mesh.last_stage else torch.empty(shape, device=mesh.device)
    p2p(mesh, recv_next=grad)
    return grad


def send_backward(mesh, grad_in):
    p2p(mesh, send_prev=grad_in)


def send_forward_recv_backward(mesh, shape, out):
    grad = None if mesh.last_stage else torch.empty(shape, device=mesh.device)
    p2p(mesh, send_next=out, recv_next=grad)
    return grad


def send_backward_recv_forward(mesh, shape, grad_in):
    inp = None if mesh.first_stage else torch.empty(shape, device=mesh.device)
    p2p(mesh, send_prev=grad_in, recv_prev=inp)
    return inp


def stage_forward(stage, mesh, micro, inp, autocast, chunk=None, virtual=1):
    """The stage's forward of one micro-batch (x, y, loss_mask, doc_ids) -> (output, loss).
    Stage 0 reads the tokens x, the others their input from the previous stage; the last
    stage the targets and the mask (it computes the loss); every stage the document ids
    (every stage has attention). chunk (interleaved): which of the stage's `virtual` chunks
    runs; the first is the first stage only in chunk 0, the last the last only in chunk V-1."""
    on = lambda t: None if t is None else t.to(mesh.device)  # noqa: E731
    x, y, loss_mask, doc_ids = micro
    first = mesh.first_stage and not chunk
    last = mesh.last_stage and (chunk is None or chunk == virtual - 1)
    inp = on(x) if first else inp
    y, loss_mask = (on(y), on(loss_mask)) if last else (None, None)
    with autocast:
        if chunk is None:
            return stage(inp, y, loss_mask, on(doc_ids))
        return stage(inp, y, loss_mask, on(doc_ids), chunk=chunk)


@dataclass
class PipelineState:
    """What the steps of one stage's schedule share in one iteration: passed to each step,
    no closures."""
    stage: nn.Module       # the stage, or its DataParallel / FSDP form
    mesh: Mesh
    shape: tuple           # activations between stages: (B, T, n_embd)
    autocast: object
    weights: list          # micro-batch k's backward starts from weights[k] * loss_k
    # None, or a list that receives (kind, micro-batch, start, end, chunk) per forward / backward
    trace: list
    loss_sum: torch.Tensor  # sum_k weights[k] * loss_k so far (on the last stage; 0 elsewhere)
    virtual: int = 1       # chunks per rank (interleaved); 1: one stage per rank
    # None, or loss_of(k, each target's loss (B, T), loss_mask): micro-batch k's loss in place of
    # the token mean (a loss that needs its whole rows: preference.py's pairs, formed here)
    loss_of: object = None
    # (chunk, k) -> (input, output) of a forward whose backward is to come
    alive: dict = field(default_factory=dict)
    peak: int = 0          # the most micro-batch chunks alive at once


def _clock(st):
    if st.trace is not None and st.mesh.device.type == "cuda":
        torch.cuda.synchronize()  # when tracing: time the kernels, not their launches
    return time.perf_counter()


def forward_step(st, k, micro, inp, chunk=0):
    """Micro-batch k's forward on this stage (on its chunk `chunk`, interleaved); keeps
    (input, output) for its backward and returns the output to send to the next stage."""
    t0 = _clock(st)
    if inp is not None:
        inp.requires_grad_()  # we need the gradient of the stage's input, to send it back
    out, loss = stage_forward(st.stage, st.mesh, micro, inp, st.autocast,
                              chunk if st.virtual > 1 else None,
                              st.virtual)
    send = out
    # the last (virtual) stage
    if st.mesh.last_stage and (st.virtual == 1 or chunk == st.virtual - 1):
        if st.loss_of is not None:  # (out: each target's loss)
            loss = st.loss_of(k, out, micro[2].to(out.device))
        out = send = loss * st.weights[k]  # the backward starts here
        st.loss_sum += loss.detach() * st.weights[k]
    # a stage's own loss terms (a mixture of experts' balancing losses: moe.attach)
    elif loss is not None:
        out = (out, loss * st.weights[k])  # their backward starts with the output's
    st.alive[chunk, k] = (inp, out)
    st.peak = max(st.peak, len(st.alive))
    if st.trace is not None:
        st.trace.append(("F", k, t0, _clock(st), chunk))
    return send.detach()


def backward_step(st, k, grad_out, chunk=0):
    """Micro-batch k's backward on this stage (chunk) from the gradient of its output (None
    on the last stage: its output is the weighted loss); returns the gradient of its input,
    to send to the previous stage (None on stage 0)."""
    t0 = _clock(st)
    inp, out = st.alive.pop((chunk, k))
    # data parallel inside the stage: sync on its very last backward only, micro-batch m-1 of
    # chunk 0 (the backwards run the chunks from the last to the first); the buckets that
    # backward does not complete (other chunks' layers) go in wait()
    set_grad_sync(st.stage, k == len(st.weights) - 1 and chunk == 0)
    torch.autograd.backward(out, (grad_out, None) if isinstance(out, tuple) else grad_out)
    if st.trace is not None:
        st.trace.append(("B", k, t0, _clock(st), chunk))
    return None if inp is None else inp.grad


def gpipe(st, micro_batches):
    """GPipe: all forwards, then all backwards (in the same order)."""
    mesh, shape = st.mesh, st.shape
    for k, micro in enumerate(micro_batches):
        send_forward(mesh, forward_step(st, k, micro, recv_forward(mesh, shape)))
    for k in range(len(micro_batches)):
        send_backward(mesh, backward_step(st, k, recv_backward(mesh, shape)))


def one_f_one_b(st, micro_batches):
    """1F1B: warmup, steady state, cooldown. The steady state pairs forward k with backward
    k - warmup and sends one's output while receiving the other's gradient, in one round."""
    mesh, shape, m = st.mesh, st.shape, len(micro_batches)
    warmup = min(mesh.pp - mesh.pp_rank - 1, m)  # forwards in flight before the first backward
    steady = m - warmup
    for k in range(warmup):  # warmup: forwards only
        send_forward(mesh, forward_step(st, k, micro_batches[k], recv_forward(mesh, shape)))
    inp = recv_forward(mesh, shape) if steady else None
    for i in range(steady):  # steady state: one forward, one backward
        k = warmup + i
        grad = send_forward_recv_backward(mesh, shape, forward_step(st, k, micro_batches[k], inp))
        grad_in = backward_step(st, i, grad)
        if i < steady - 1:
            inp = send_backward_recv_forward(mesh, shape, grad_in)
        else:
            send_backward(mesh, grad_in)
    for k in range(steady, m):  # cooldown: the backwards of the warmup's forwards
        send_backward(mesh, backward_step(st, k, recv_backward(mesh, shape)))


def interleaved_order(pp, rank, virtual, m):
    """The (kind, chunk, micro-batch) ops of `rank` under interleaved 1F1B, in Megatron's
    order: forwards go through the chunks in groups of pp micro-batches (chunk 0 for
    micro-batches 0..pp-1, chunk 1 for the same, ..., then chunk 0 for pp..2pp-1, ...);
    backwards the same way from the last chunk down. Warmup, steady state, cooldown as in
    1F1B, with a longer warmup: the other chunks' forwards must be in flight too."""
    total = virtual * m  # ops of each kind on this rank

    def fwd(i):  # the i-th forward: (chunk, micro-batch)
        group, j = divmod(i, pp * virtual)
        return j // pp, group * pp + j % pp

    def bwd(i):
        chunk, k = fwd(i)
        return virtual - 1 - chunk, k
    warmup = min((pp - rank - 1) * 2 + (virtual - 1) * pp, total)
    ops = [("F", *fwd(i)) for i in range(warmup)]
    for i in range(total - warmup):  # steady state: one forward, one backward
        ops += [("F", *fwd(warmup + i)), ("B", *bwd(i))]
    ops += [("B", *bwd(i)) for i in range(total - warmup, total)]  # cooldown
    return ops


def interleaved_rounds(pp, virtual, m):
    """rounds[rank][t]: the op (kind, chunk, micro-batch) rank runs in round t, or None. Each
    rank runs its ops in interleaved_order, each as early as its input allows (an op per
    round); after every round each rank exchanges with its ring neighbours exactly what they
    produced in it. Every rank computes the same table, so each knows what to receive and
    when, and every send meets its receive in the same round: no deadlock, no mismatched
    pair, on gloo and nccl alike."""
    orders = [interleaved_order(pp, r, virtual, m) for r in range(pp)]
    pos = [0] * pp  # each rank's next op in its order
    # done: (kind, virtual stage, k) -> the round it ran in
    done, rounds = {}, [[] for _ in range(pp)]
    last = pp * virtual - 1
    while any(pos[r] < len(orders[r]) for r in range(pp)):
        t = len(rounds[0])
        assert t < 4 * (pp + 1) * virtual * m, "interleaved schedule made no progress"
        for r in range(pp):
            op = orders[r][pos[r]] if pos[r] < len(orders[r]) else None
            if op is not None:
                kind, chunk, k = op
                s = chunk * pp + r  # its virtual stage
                # (its own forward ran earlier on this rank)
                need = (("F", s - 1, k) if s > 0 else None) if kind == "F" else \
                       (("B", s + 1, k) if s < last else None)
                # its input is not here yet: idle this round
                if need is not None and done.get(need, t) >= t:
                    op = None
            rounds[r].append(op)
        for r in range(pp):
            if rounds[r][t] is not None:
                kind, chunk, k = rounds[r][t]
                done[kind, chunk * pp + r, k] = t
                pos[r] += 1
    return rounds


def interleaved(st, micro_batches):
    """Interleaved 1F1B, played round by round from interleaved_rounds: run this rank's op of
    the round (if any), then one p2p round with the ring neighbours: send what the op
    produced, receive what theirs produced for one of our chunks. Received activations and
    gradients wait in dicts keyed by (chunk, micro-batch) until their op comes."""
    mesh, shape, m, V = st.mesh, st.shape, len(micro_batches), st.virtual
    pp, rank, last = mesh.pp, mesh.pp_rank, mesh.pp * V - 1
    rounds = interleaved_rounds(pp, V, m)
    inputs, grads = {}, {}  # (chunk, k) -> received activation / gradient of the output
    for t in range(len(rounds[0])):
        out = grad_in = None
        op = rounds[rank][t]
        if op is not None and op[0] == "F":
            _, chunk, k = op
            out = forward_step(st, k, micro_batches[k], inputs.pop((chunk, k), None), chunk)
            out = None if chunk * pp + rank == last else out  # the loss: nothing to send
        elif op is not None:
            _, chunk, k = op
            grad_in = backward_step(st, k, grads.pop((chunk, k), None), chunk)
        # what the neighbours ran this round: the previous rank's forward output is our input
        # (virtual stage + 1), the next rank's input gradient our output's (virtual stage - 1)
        prv, nxt = rounds[(rank - 1) % pp][t], rounds[(rank + 1) % pp][t]
        recv_prev = recv_next = None
        if prv is not None and prv[0] == "F" and prv[1] * pp + (rank - 1) % pp < last:
            s = prv[1] * pp + (rank - 1) % pp + 1  # our virtual stage that consumes it
            recv_prev = inputs[s // pp, prv[2]] = torch.empty(shape, device=mesh.device)
        if nxt is not None and nxt[0] == "B" and nxt[1] * pp + (rank + 1) % pp > 0:
            s = nxt[1] * pp + (rank + 1) % pp - 1
            recv_next = grads[s // pp, nxt[2]] = torch.empty(shape, device=mesh.device)
        p2p(mesh, send_next=out, send_prev=grad_in, recv_prev=recv_prev, recv_next=recv_next,
            ring=True)
    assert not inputs and not grads, "interleaved: a received tensor was never used"


def pipeline_step(schedule, stage, mesh, micro_batches, act_shape, autocast=nullcontext(),
                  trace=None, weights=None, virtual=1, loss_of=None):
    """This stage's share of one iteration: the forward and backward of every micro-batch
    (a list of (x, y, loss_mask, doc_ids) tuples, tensors or None: x is used by the first
    stage, y and loss_mask by the last, doc_ids by all) in the order of `schedule` ('1f1b' or
    'gpipe'). `stage` is the stage module, or its DataParallel / FSDP form: then only the
    stage's last backward syncs gradients. weights (m floats, default 1/m each): micro-batch
    k's backward starts from weights[k] * loss_k. `trace`, a list, receives
    (kind, micro-batch, start, end, chunk) per forward / backward. 'interleaved' takes
    `virtual` chunks per stage (make_stage(virtual=V)) and m a multiple of pp. loss_of (None:
    the token mean): loss_of(k, each target's loss, loss_mask) is micro-batch k's loss, formed
    on the last stage. Returns (sum_k weights[k] * loss_k on the last stage, 0 elsewhere; the
    most micro-batch chunks alive at once)."""
    m = len(micro_batches)
    weights = [1 / m] * m if weights is None else list(weights)
    assert len(weights) == m, f"{len(weights)} loss weights for {m} micro-batches"
    schedules = {"gpipe": gpipe, "1f1b": one_f_one_b, "interleaved": interleaved}
    if schedule not in schedules:
        raise ValueError(f"unknown pipeline schedule {schedule!r}")
    assert (schedule == "interleaved") == (virtual > 1), (
        f"pp_schedule={schedule} with {virtual} chunks per stage")
    assert schedule != "interleaved" or m % mesh.pp == 0, (
        f"interleaved: m={m} micro-batches, not a multiple of pp")
    st = PipelineState(stage, mesh, act_shape, autocast, weights, trace,
                       torch.zeros((), device=mesh.device), virtual, loss_of)
    schedules[schedule](st, micro_batches)
    assert not st.alive, f"{len(st.alive)} micro-batches were never run backward"
    return st.loss_sum, st.peak


@torch.no_grad()
def pipeline_forward(stage, mesh, micro_batches, act_shape, autocast=nullcontext(), weights=None,
                     virtual=1, loss_of=None):
    """Forward only, for evaluation: sum_k weights[k] * loss_k on the last stage (default
    weights 1: the plain sum of the micro-batch losses), 0 elsewhere. With `virtual` chunks
    per stage each micro-batch goes round the ring V times (all ranks in the same order of
    (micro-batch, chunk), so every send meets its receive). loss_of as pipeline_step's; one
    that gives a tensor of each row's (preference.py's log-probs) sums those."""
    loss_sum = torch.zeros((), device=mesh.device)
    for k, micro in enumerate(micro_batches):
        for c in range(virtual):
            inp = (None if mesh.first_stage and c == 0
                   else torch.empty(act_shape, device=mesh.device))
            p2p(mesh, recv_prev=inp, ring=True)
            out, loss = stage_forward(stage, mesh, micro, inp, autocast,
                                      c if virtual > 1 else None, virtual)
            if loss is None:
                p2p(mesh, send_next=out, ring=True)
                continue
            if loss_of is not None:  # (out: each target's loss)
                loss = loss_of(k, out, micro[2].to(out.device))
            loss_sum = loss_sum + loss * (1.0 if weights is None else weights[k])
    return loss_sum


def pipeline_timeline(traces, m, width=96, virtual=1):
    """An ASCII picture of one pipeline's schedule from each stage's trace (list of
    (kind, micro, start, end, chunk)), and the measured vs the theoretical bubble, both as
    the idle share of the iteration's time: (p-1)/(m+p-1), and (p-1)/(V*m+p-1) with V
    chunks per stage (Narayanan et al.'s (p-1)/(V*m) is the same idle time relative to the
    ideal, bubble-free time instead)."""
    t0 = min(e[2] for tr in traces for e in tr)
    span = max(e[3] for tr in traces for e in tr) - t0
    pp = len(traces)
    lines = [f"pipeline schedule, {pp} stages x {m} micro-batches ({span * 1000:.0f} ms; "
             f"Fk = forward of micro-batch k, Bk = its backward, " +
             ("Fk/c on chunk c (virtual stage c * pp + stage), " if virtual > 1 else "")
             + ". = idle)"]
    idle = []
    for s, tr in enumerate(traces):
        row = ["."] * width
        for kind, k, a, b, c in tr:
            lo = int((a - t0) / span * width)
            hi = max(lo + 1, int((b - t0) / span * width))
            label = (f"{kind}{k}" + (f"/{c}" if virtual > 1 else "")
                     + ("-" if kind == "F" else "=") * width)
            row[lo:hi] = label[:hi - lo]
        busy = sum(e[3] - e[2] for e in tr)
        idle.append(1 - busy / span)
        lines.append(f"stage {s} |{''.join(row)}| idle {idle[-1]:4.0%}")
    measured, theory = sum(idle) / pp, (pp - 1) / (virtual * m + pp - 1)
    formula = "(p-1)/(m+p-1)" if virtual == 1 else f"(p-1)/(V*m+p-1), V={virtual},"
    lines.append(f"bubble: measured {measured:.1%} (mean idle share of the stages), "
                 f"theory {formula} = {theory:.1%}")
    return "\n".join(lines), measured


def print_pipeline_timeline(trace, mesh, m, virtual=1):
    """Gathers every rank's trace (a collective: every rank calls it) and prints pipeline 0's
    timeline on rank 0."""
    # the stages of pipeline 0 (tp rank 0)
    traces = all_gather_object(trace, mesh)[:mesh.pp * mesh.tp:mesh.tp]
    mesh.print0(pipeline_timeline(traces, m, virtual=virtual)[0])


def cut_stage(model, mesh, counts=None, virtual=1):
    """train.py's pipeline line: cuts the built model to this rank's stage (make_stage), with
    the layers per stage from pp_layers (`counts`) or balanced by cost, and says who holds what."""
    counts = counts or pipeline_split(model.cfg, mesh.pp * virtual)
    mesh.print0("pipeline: " + "; ".join(f"stage {s}: layers " + ", ".join(
        f"{r.start}-{r.stop - 1}"
        for r in (stage_layers(counts, v * mesh.pp + s) for v in range(virtual)))
        for s in range(mesh.pp)))
    make_stage(model, mesh.pp_rank, mesh.pp, counts, virtual)
    if model.cfg.tie_embeddings:
        model.tied_group = tied_group(mesh)
    return model


# ---------------------------------------------------------------------------------------
# tied embeddings across stages (Megatron's embedding group)
#
# With tie_embeddings the head is the embedding, but stage 0 holds the embedding and the last
# stage the head. Each holds a copy: they start equal (the same parameter of the built model,
# or drawn under the embedding's name), and after every backward the two gradients, each the
# gradient of one use, are summed between the two stages, so both copies get the gradient of
# the tied weight and take the same step. The global norm counts the copy on the last stage
# out (it is the same gradient again); checkpoints name it tok_embeddings.weight (one entry).


def tied_group(mesh):
    """The process group of this rank's first and last stage (same dp and tp rank). Every rank
    creates every such group (new_group is collective), keeping its own."""
    mine = None
    for d in range(mesh.dp):
        for t in range(mesh.tp):
            ranks = [d * mesh.pp * mesh.tp + t, (d * mesh.pp + mesh.pp - 1) * mesh.tp + t]
            group = dist.new_group(ranks)
            mine = group if mesh.rank in ranks else mine
    return mine


def tied_copy(module):
    """This stage's copy of the tied embeddings (the embedding on the first stage, the head on
    the last), or None (a middle stage, or no tie)."""
    if getattr(module, "tied_group", None) is None:
        return None
    return (module.tok_embeddings.weight if module.tok_embeddings is not None
            else module.output.weight)


def all_reduce_tied(model, params):
    """Sums the tied weight's gradient over the first and the last stage (after the data-parallel
    sync, before clipping): of `params`, what clipping measures, the tied weight, or under ZeRO
    this rank's piece of it (sliced alike on both stages: data_parallel.py gives the weight a
    bucket of its own). Marks the last stage's copy so that the global norm counts it once."""
    p = tied_copy(model)
    if p is None:  # a middle stage
        return
    p._tied_copy = model.tok_embeddings is None
    for t in params:
        # None on both stages when frozen (LoRA)
        if getattr(t, "_whole", t) is p and t.grad is not None:
            # FSDP: both stages shard it alike
            grad = t.grad.to_local() if hasattr(t.grad, "to_local") else t.grad
            dist.all_reduce(grad, group=model.tied_group)
