"""
Mixtures of datasets (datasets=stdlib:0.7,notes:0.3): MixtureLoader draws each sequence of a
global batch from one of several prepared datasets, by weights tempered with
mix_temperature, with curriculum phases that change the weights (and scale the learning
rate) from a given iteration on; and the per-source losses that train.py logs. A run with
one dataset never enters this file.
"""

import numpy as np
import torch

from configurator import parse_phases, source_name
from guards import guard_data
from guards.guard_errors import UserError


def temper(weights, temperature):
    """weights ** (1 / temperature), normalized: T > 1 flattens the mixture toward uniform,
    T < 1 sharpens it, T = 1 only normalizes."""
    if not temperature > 0:
        raise UserError(f"mix_temperature={temperature} must be positive (1.0: the weights as "
                        f"given)")
    # in logs: 0.1 ** (1 / 0.001) underflows to 0, and 0 / 0 would be NaN weights
    logw = np.log(np.asarray(weights, dtype=np.float64)) / temperature
    w = np.exp(logw - logw.max())
    return w / w.sum()


def check_tokenizers(metas):
    """The meta of the vocabulary that covers every source, or a UserError when two sources
    were encoded with different tokenizers. Sources may differ only in extra tokens where one
    list extends the other (a text dataset and a chat dataset of the same base: the chat
    tokens come after every base id, so a text token means the same in both), and in the id
    that ends their documents (a base's chat template may end conversations with another one:
    each row's documents are cut at its own source's, MixtureLoader.eot_of)."""
    widest_name, widest = next(iter(metas.items()))
    for name, meta in metas.items():
        ours = (meta["tokenizer"], meta.get("base_vocab_size", meta["vocab_size"]))
        theirs = (widest["tokenizer"], widest.get("base_vocab_size", widest["vocab_size"]))
        a, b = list(meta.get("extra_tokens", [])), list(widest.get("extra_tokens", []))
        if ours != theirs or (a[:len(b)] != b and b[:len(a)] != a):
            raise UserError(f"sources '{widest_name}' and '{name}' were prepared with different "
                            f"tokenizers ({theirs[0]}/{theirs[1]} + {len(b)} extra tokens "
                            f"vs {ours[0]}/{ours[1]} + {len(a)}): "
                            f"prepare them with the same tokenizer, vocab_size and extra tokens")
        if len(a) > len(b):
            widest_name, widest = name, meta
    return widest


def _mix64(x):
    """splitmix64's finalizer on uint64 arrays (wrapping arithmetic): a counter-based hash."""
    x = x + np.uint64(0x9E3779B97F4A7C15)
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def slot_uniforms(seed, iters, n_slots):
    """Uniform [0, 1) floats of shape (len(iters), n_slots), one per (seed, it, slot): a hash
    of the three, so any iteration's draws come without the ones before it, and a block of
    iterations in one vectorised call."""
    it = np.asarray(iters, dtype=np.uint64)[:, None]
    slot = np.arange(n_slots, dtype=np.uint64)[None, :]
    h = _mix64(_mix64(_mix64(np.full(1, seed, dtype=np.uint64) ^ np.uint64(0x6D6978)) + it) + slot)
    return (h >> np.uint64(11)).astype(np.float64) * 2.0 ** -53


class MixtureLoader:
    """Batches from a mixture of prepared datasets ("sources"), a pure function of
    (seed, iteration, phases) like Loader's.

    Slot j of iteration it's global batch (G = batch_size * grad_accum_steps slots) takes its
    source from the uniform u(seed, it, j) (slot_uniforms: a counter-based hash) against the
    cumulative weights of the phase in force at it (weights ** (1 / mix_temperature),
    normalized). Each source keeps Loader's endless order of its own chunks (epochs
    shuffled from (seed, epoch)); a slot of source s takes the next sample of s's stream:
    position = draws of s in all slots of iterations [0, it) + its rank among the slots of s
    in it. That count is derived, not saved: the draws of iterations [0, it) are recomputed
    in vectorised blocks (one hash per slot: about a second for 100k iterations x 64 slots)
    and their cumulative per-source counts cached, so resume needs only `it`, on any layout. Change
    the phases and the past is recomputed as if the new ones had always been in force.

    Rank r takes its fixed slice of the global batch (micro-batches [r * k, (r + 1) * k)) as
    Loader does. batch() also returns each sequence's source index; a text source in a
    mixture with a chat one gets a loss mask of ones. One source and no phases: exactly
    Loader's batches."""

    BLOCK = 4096  # iterations whose draws are computed in one vectorised call

    def __init__(self, loaders, names, base_weights, phases=(), temperature=1.0):
        self.loaders, self.names = loaders, list(names)
        first = loaders[0]
        self.seed, self.batch_size, self.global_batch = (first.seed, first.batch_size,
                                                         first.global_batch)
        self.micro_steps, self.first_micro = first.micro_steps, first.first_micro
        self.chat = any(loader.masked for loader in loaders)  # (chat data, or padded rows)
        self.eot_tokens = torch.tensor([loader.eot_token for loader in loaders])  # each source's
        # phase table: starts, and per phase the cumulative tempered weights (over self.names) and
        # LR scale
        table = [(0, dict(zip(names, base_weights)), 1.0)] + [p for p in phases if p[0] > 0]
        if phases and phases[0][0] == 0:
            table[0] = phases[0]
        self.starts = np.array([p[0] for p in table], dtype=np.int64)
        self.weights = np.stack([self._tempered(p[1], temperature) for p in table])
        self.cdf = np.cumsum(self.weights, axis=1)
        self.cdf[:, -1] = 1.0  # a uniform < 1 always lands on some source
        self.scales = [p[2] for p in table]
        # row i: draws per source before iteration i
        self._counts = np.zeros((1, len(names)), dtype=np.int64)

    @property
    def n_chunks(self):
        return sum(loader.n_chunks for loader in self.loaders)

    def passes(self, it):
        """How many times `it` iterations pass over the most repeated source."""
        return max(n / loader.n_chunks for n, loader in zip(self.counts_before(it), self.loaders))

    def _tempered(self, weights, temperature):
        w = np.array([weights.get(n, 0.0) for n in self.names])
        out = np.zeros_like(w)
        out[w > 0] = temper(w[w > 0], temperature)
        return out

    def phase(self, it):
        return int(np.searchsorted(self.starts, it, side="right")) - 1

    def lr_scale(self, it):
        """The learning-rate factor of the phase in force at iteration it."""
        return self.scales[self.phase(it)]

    def sources(self, iters):
        """Source index of every slot of the given iterations: (len(iters), G) int64."""
        iters = np.asarray(iters, dtype=np.int64)
        if len(self.names) == 1:
            return np.zeros((len(iters), self.global_batch), dtype=np.int64)
        u = slot_uniforms(self.seed, iters, self.global_batch)
        cdf = self.cdf[np.searchsorted(self.starts, iters, side="right") - 1]  # (n, S)
        return (u[:, :, None] >= cdf[:, None, :-1]).sum(-1)

    def counts_before(self, it):
        """Draws of each source in all slots of iterations [0, it): cached, extended in blocks."""
        while len(self._counts) <= it:
            lo = len(self._counts) - 1
            src = self.sources(np.arange(lo, lo + self.BLOCK))
            per_iter = np.stack([(src == s).sum(1) for s in range(len(self.names))], axis=1)
            self._counts = np.concatenate([self._counts,
                                           self._counts[-1] + np.cumsum(per_iter, axis=0)])
        return self._counts[it]

    def global_samples(self, it):
        """(source, sample) of every slot of iteration it: two (G,) arrays; `sample` is the
        position in the source's endless stream."""
        src = self.sources([it])[0]
        sample = np.empty_like(src)
        before = self.counts_before(it)
        for s in range(len(self.names)):
            sel = src == s
            sample[sel] = before[s] + np.arange(sel.sum())
        return src, sample

    def eot_of(self, source):
        """The id that ends a document in each row, by its source (batch's last element): the
        shape (micro_steps, batch_size, 1), as doc_ids compares it with the rows' tokens."""
        return self.eot_tokens[source].unsqueeze(-1)

    def batch(self, it):
        """This rank's (x, y, loss_mask, source) for iteration it: as Loader.batch, plus the
        source index of each sequence, shape (micro_steps, batch_size)."""
        src, sample = self.global_samples(it)
        lo, n = self.first_micro * self.batch_size, self.micro_steps * self.batch_size
        src, sample = src[lo:lo + n], sample[lo:lo + n]
        x = y = mask = None
        for s, loader in enumerate(self.loaders):
            sel = np.nonzero(src == s)[0]
            if not len(sel):
                continue
            xs, ys, ms = loader.rows(sample[sel])
            if x is None:
                x, y = xs.new_empty((n, *xs.shape[1:])), ys.new_empty((n, *ys.shape[1:]))
                mask = torch.ones(y.shape, dtype=torch.float32) if self.chat else None
            x[sel], y[sel] = xs, ys
            if ms is not None:
                mask[sel] = ms
        shape = (self.micro_steps, self.batch_size, -1)
        return (x.view(shape), y.view(shape), None if mask is None else mask.view(shape),
                torch.from_numpy(src).view(self.micro_steps, self.batch_size))


# ---- what train.py calls ----------------------------------------------------------------


def setup(sources, phases, temperature, prepared, loader):
    """A mixture run's data: each source's directory from `prepared(source)`, its loaders from
    `loader(directory, split)`. Returns (the directories comma-joined, which checkpoints
    record; the meta of the vocabulary that covers every source; the train MixtureLoader; the
    val loaders by source name; the weights that average the sources' val losses)."""
    dirs = [prepared(s) for s in sources]
    meta = check_tokenizers({s: guard_data.read_meta(d) for s, d in zip(sources, dirs)})
    names = [source_name(s) for s in sources]
    train = MixtureLoader([loader(d, "train") for d in dirs], names, list(sources.values()),
                          parse_phases(phases, names), temperature)
    weights = dict(zip(names, temper(list(sources.values()), temperature)))
    return ",".join(dirs), meta, train, {n: loader(d, "val") for n, d in zip(names, dirs)}, weights


def val_losses(val, weights):
    """(the val loss: the sources' weighted by the mixture, {"val_loss/<source>": each one's})."""
    by_source = {f"val_loss/{n}": v for n, v in val.items()} if len(val) > 1 else {}
    return sum(weights[n] * v for n, v in val.items()), by_source


def train_losses(sums, sources):
    """{"loss/<source>": mean over its target tokens in the global batch} from SourceLosses'
    all-reduced sums."""
    return {f"loss/{source_name(s)}": total / n for s, (total, n) in zip(sources, sums.tolist())
            if n > 0}


def compact(by_source):
    """' [a 3.210, b 4.021]' of {'loss/a': 3.21, ...} for stdout."""
    return (" ["
            + ", ".join(f"{key.split('/', 1)[1]} {value:.3f}" for key, value in by_source.items())
            + "]")


class SourceLosses:
    """Each source's (token-loss sum, target tokens) in a training step. The model returns each
    target's loss beside a micro-batch's mean; the loss per source needs each sequence's token
    sum. A forward hook on the model (on the last pipeline stage: the one with the head) sums
    them in every training forward, so the plain loop and the pipeline schedules run
    unchanged; they run the forwards in micro-batch order, so the k-th row block is
    micro-batch k's. sums() hands this step's rows over, summed per source. Under tensor
    parallel the per-token losses come from the vocabulary-parallel cross-entropy (its row
    max and sums all-reduced over the tp group): every tp rank holds the same sums, so the
    all-reduced totals count each tp times, and their ratio, the per-source loss, is unchanged."""

    def __init__(self, model, n_sources, mesh):
        self.rows, self.n, self.device = [], n_sources, mesh.device
        model.register_forward_hook(self.record)

    def record(self, module, args, output):
        losses, loss = output  # with targets: each target's loss (B, T), and their mean
        if not module.training or loss is None:
            return
        loss_mask = args[2] if len(args) > 2 else None
        with torch.no_grad():
            ce = losses.detach().double()
            m = torch.ones_like(ce) if loss_mask is None else loss_mask.double()
            self.rows.append(torch.stack([(ce * m).sum(1), m.sum(1)], dim=1))

    def sums(self, src):
        """(sources, 2) sums of this rank's sequences (zeros on a stage without the head); src:
        each sequence's source, (micro_steps, batch_size)."""
        out = torch.zeros(self.n, 2, dtype=torch.float64, device=self.device)
        if self.rows:
            out.index_add_(0, src.flatten().to(self.device), torch.cat(self.rows))
        self.rows = []
        return out
