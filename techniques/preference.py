"""
Preference alignment, the stage after SFT: a dataset of pairs (prepare.py reads TRL's formats:
formats/preference.py) trains on DPO's loss (Rafailov et al., 2023), IPO's, or SimPO's, with
TRL's definitions and names. A run whose dataset holds no pairs never enters this file.

For each pair the policy's log-prob of the completion, summed over its tokens (the loss mask),
against the reference's:

    sigmoid (DPO):  -log sigmoid(beta * d)        d = (pi_c - ref_c) - (pi_r - ref_r)
                    (1 - ls) of that + ls * -log sigmoid(-beta * d): cDPO, label_smoothing=ls
    ipo:            (d' - 1 / (2 beta))^2         d' as d with each log-prob per token (TRL's)
    simpo:          -log sigmoid(beta * (pi_c / n_c - pi_r / n_r) - gamma): no reference
                    (TRL's CPOTrainer, loss_type='simpo', cpo_alpha=0; gamma = simpo_gamma)

A micro-batch holds whole pairs, its chosen rows first and their rejected rows after (TRL's
order); its loss is the mean over its pairs, and every micro-batch holds as many, so train.py's
weights 1/m give the mean over the global batch's pairs on any layout and accumulation.

The reference is never a second model: its log-probs are computed once, before step 1, with the
starting model on the run's own layout (under LoRA with the adapters off: the base, as TRL and
PEFT do), kept in out_dir keyed by the starting model's hash and the data's, and read again on
resume: never recomputed against trained weights.
"""

import hashlib
import json
import math
import os
from contextlib import contextmanager, nullcontext

import numpy as np
import torch
import torch.nn.functional as F

import common
import data
import parallel
from formats import preference as pairs_format
from guards import guard_data
from guards import guard_files
from guards.guard_errors import UserError, check

# TRL's names for what a step logs, in its order
METRICS = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins",
           "logps/chosen", "logps/rejected")


def setup(c, mesh, data_dir, name):
    """(the loss, the train loader, {name: the val loader}) of a run on a dataset of pairs."""
    loss = PairLoss(c, mesh)
    loss.loaders = {split: PairLoader(data_dir, split, c, mesh.dp_rank, mesh.dp)
                    for split in ("train", "val")}
    return loss, loss.loaders["train"], {name: loss.loaders["val"]}


# ---------------------------------------------------------------------------------------
# the loader: whole pairs per micro-batch


class PairLoader(data.Loader):
    """data.Loader's endless stream of samples (a batch a pure function of seed and it), whose
    samples are pairs: a micro-batch of batch_size rows holds batch_size / 2 pairs, chosen rows
    first. A row is one sequence, padded; one longer than block_size + 1 tokens keeps its first
    ones (TRL's keep_start)."""

    def __init__(self, data_dir, split, c, dp_rank=0, dp=1):
        block_size, batch_size, grad_accum_steps = c["block_size"], c["batch_size"], c[
            "grad_accum_steps"]
        check(batch_size % 2 == 0, f"batch_size={batch_size}: a micro-batch of preference data "
                                   f"holds whole pairs (a chosen and a rejected row): make it "
                                   f"even")
        meta = guard_data.read_meta(data_dir)
        path = os.path.join(data_dir, f"{split}.bin")
        self.tokens = guard_data.map_tokens(path, np.dtype(meta["dtype"]), meta["vocab_size"])
        self.mask = guard_data.chat_mask(path, len(self.tokens))
        self.index = pairs_format.pair_rows(os.path.join(data_dir, f"{split}.pairs.npy"),
                                            len(self.tokens), path)
        self.eot_token, self.packed, self.ref = meta["eot_token"], None, None
        self.block_size, self.pairs, self.seed = block_size, batch_size // 2, c["seed"]
        self.batch_size = batch_size
        self.n_chunks = len(self.index)  # pairs
        self.global_batch = self.pairs * grad_accum_steps  # pairs of a global batch
        self.micro_steps = grad_accum_steps // dp
        self.first_micro = dp_rank * self.micro_steps
        self._order = (None, None)

    def pair_rows(self, pairs):
        """(x, y, loss_mask) of these pairs, (2 len(pairs), block_size): chosen rows, then
        rejected rows, padded with the end id (mask 0)."""
        T = self.block_size + 1
        ids = np.full((2, len(pairs), T), self.eot_token, dtype=np.int64)
        mask = np.zeros((2, len(pairs), T), dtype=np.float32)
        for j, p in enumerate(pairs):
            for side in (0, 1):
                start, n = self.index[p, 2 * side], min(self.index[p, 2 * side + 1], T)
                ids[side, j, :n] = self.tokens[start:start + n]
                mask[side, j, :n] = self.mask[start:start + n]
        ids, mask = torch.from_numpy(ids.reshape(-1, T)), torch.from_numpy(mask.reshape(-1, T))
        return ids[:, :-1], ids[:, 1:], mask[:, 1:]

    def rows(self, samples):
        return self.pair_rows(self.chunks_of(np.asarray(samples)))

    def batch(self, it):
        """(x, y, loss_mask, ref): x, y, loss_mask (micro_steps, batch_size, block_size), each
        micro-batch's rows as pair_rows gives them; ref (micro_steps, batch_size) the reference's
        log-prob of each row (zeros before reference() computed it)."""
        first = it * self.global_batch + self.first_micro * self.pairs
        pairs = self.chunks_of(np.arange(first, first + self.micro_steps * self.pairs))
        pairs = pairs.reshape(self.micro_steps, self.pairs)
        x, y, mask = (torch.stack(t) for t in zip(*(self.pair_rows(p) for p in pairs)))
        # (simpo: no reference, zeros it never reads)
        ref = (torch.zeros(x.shape[:2], dtype=torch.float64) if self.ref is None else
               torch.from_numpy(np.stack([self.ref[p].T.reshape(-1) for p in pairs])))
        return x, y, mask, ref


# ---------------------------------------------------------------------------------------
# the loss


class PairLoss:
    """loss(losses, mask, ref) of one micro-batch: the mean of its pairs' losses. It adds up
    the pairs' metrics (TRL's, METRICS) until take() hands them over, once per step."""

    def __init__(self, c, mesh):
        # (loss_type, beta and label_smoothing are checked with every key: guard_config.py)
        check(not (c["datasets"] or c["phases"]), "a preference dataset trains alone: set "
                                                  "dataset=, not datasets= or phases=")
        self.type, self.beta = c["loss_type"], c["beta"]
        self.smoothing, self.gamma = c["label_smoothing"], c["simpo_gamma"]
        self.c, self.mesh, self.sums, self.loaders = c, mesh, None, {}

    def __call__(self, losses, mask, ref):
        """losses, mask: (2P, T) each target's cross-entropy and the completions' mask; ref (2P,)
        the reference's log-probs (unused by simpo)."""
        mask = mask.to(losses.dtype)
        # (2P,): log pi(completion | prompt), and the completion's tokens
        return self.of_logps(-(losses * mask).sum(-1), mask.sum(-1), ref)

    def of_logps(self, logps, n, ref):
        """The mean loss of the pairs whose rows have log-probs `logps` (2P,) over n (2P,) tokens
        (chosen rows first); their metrics added up for take()."""
        n_c, n_r = n.to(logps.dtype).clamp(min=1).chunk(2)
        pi_c, pi_r = logps.chunk(2)
        beta = self.beta
        if self.type == "simpo":  # reference-free, per token, with a target margin gamma / beta
            reward_c, reward_r = beta * pi_c / n_c, beta * pi_r / n_r
            d = pi_c / n_c - pi_r / n_r - self.gamma / beta
        else:
            ref_c, ref_r = ref.to(logps.device, logps.dtype).chunk(2)
            reward_c, reward_r = beta * (pi_c - ref_c), beta * (pi_r - ref_r)
            d = (pi_c - ref_c) - (pi_r - ref_r)
        if self.type == "ipo":  # TRL's: each side's log-ratio per completion token
            per_pair = ((pi_c - ref_c) / n_c - (pi_r - ref_r) / n_r - 1 / (2 * beta)) ** 2
        else:
            per_pair = (-F.logsigmoid(beta * d) * (1 - self.smoothing)
                        - F.logsigmoid(-beta * d) * self.smoothing)
        stats = torch.stack([reward_c.sum(), reward_r.sum(), (reward_c > reward_r).sum(),
                             (reward_c - reward_r).sum(), pi_c.sum(), pi_r.sum()]).detach()
        self.sums = stats.double() if self.sums is None else self.sums + stats.double()
        return per_pair.mean()

    def of_micro(self, ref):
        """The pipeline's loss_of for one step: micro-batch k's loss on the last stage, from its
        rows' losses and mask and ref (micro_steps, 2P), the batch's reference log-probs."""
        return lambda k, losses, mask: self(losses, mask, ref[k])

    def take(self):
        """The metrics' sums since the last take (this rank's micro-batches; zeros on a pipeline
        stage without the head)."""
        sums, self.sums = self.sums, None
        return torch.zeros(len(METRICS), dtype=torch.float64) if sums is None else sums

    def metrics(self, total, n_pairs):
        """{TRL's name: mean over the pairs} from take()'s sums all-reduced over the ranks (a tp
        group's ranks hold the same ones, and a cp group's: each has its rows' whole losses,
        gathered) and the global batch's pairs."""
        same = self.mesh.tp * self.mesh.cp if self.mesh else 1
        return dict(zip(METRICS, (total.double().cpu() / (same * n_pairs)).tolist()))

    def reference(self, model, src, data_dir, out_dir, autocast):
        """The loaders' reference tables (reference below), before step 1."""
        reference(model, self.loaders, src, self.c, data_dir, out_dir, self.mesh, autocast)


def compact(metrics):
    """The log line's part: accuracy and margin, the two a reader watches."""
    return (f", acc {metrics['rewards/accuracies']:.3f}, margin "
            f"{metrics['rewards/margins']:.4f}")


# ---------------------------------------------------------------------------------------
# the reference: log-probs computed once, with the starting model


@contextmanager
def adapters_off(model):
    """The base alone: each LoRA layer (it has lora_A) answers with its base weight, as when
    merged (no adapter file imported here: a LoRA layer's forward skips its path when merged)."""
    layers = [m for m in model.modules() if hasattr(m, "lora_A") and not m.merged]
    for m in layers:
        m.merged = True
    try:
        yield
    finally:
        for m in layers:
            m.merged = False


def row_logps(k, losses, mask):
    """Each row's log-prob of its completion (2P,) from its targets' losses (2P, T), summed as
    the loss sums the policy's (in float32): at step 0 the two are equal."""
    return -(losses * mask.to(losses.dtype)).sum(-1)


@torch.no_grad()
def sequence_logps(model, loader, mesh, autocast, doc_mask, pp_virtual=1):
    """(n_pairs, 2) float64: every pair's (chosen, rejected) log-prob under `model` as it is (LoRA:
    the base), on the run's layout: the dp ranks share the pairs (the same number of forwards
    each, as FSDP needs), then sum their tables; a pipeline's last stage forms the rows' sums
    and the other stages add zeros (cp: every rank holds its rows' whole losses, gathered)."""
    n, P = loader.n_chunks, loader.pairs
    pp = mesh.pp if mesh else 1
    dp, rank, device = (mesh.dp, mesh.dp_rank, mesh.device) if mesh else (
        1, 0, next(model.parameters()).device)  # (mesh None: one process, sample.py)
    table = torch.zeros(n, 2, dtype=torch.float64)
    was_training = model.training
    model.eval()
    with adapters_off(model):
        for step in range(math.ceil(n / (P * dp))):
            first = (step * dp + rank) * P
            pairs = np.arange(first, first + P)
            x, y, mask = loader.pair_rows(np.minimum(pairs, n - 1))
            doc = data.doc_ids(x, loader.eot_token).to(device) if doc_mask else None
            x, y, mask = x.to(device), y.to(device), mask.to(device)
            if pp > 1:  # pipeline: pipeline.py (the rows' sums on the last stage, 0 elsewhere)
                from techniques import pipeline
                shape = (x.shape[0], x.shape[1], model.cfg.n_embd)
                logps = pipeline.pipeline_forward(model, mesh, [(x, y, mask, doc)], shape,
                                                  autocast, None, pp_virtual, row_logps)
                logps = logps.expand(x.shape[0])
            else:
                with autocast:
                    losses, _ = model(x, y, None, doc)
                logps = row_logps(0, losses, mask)
            logps = logps.double().cpu().view(2, P).T
            mine = pairs < n
            table[pairs[mine]] = logps[torch.from_numpy(mine)]
    model.train(was_training)
    if mesh and pp > 1:
        table = parallel.all_reduce_sum(table, mesh, group=mesh.pp_group)
    return parallel.all_reduce_sum(table, mesh, group=mesh.dp_group).cpu() if mesh else table


def model_key(src, config):
    """The starting model's hash: its Hugging Face files, or the checkpoint's manifest (the sha256
    of every file), or for a fresh model its shape and seed; the adapters' it starts from."""
    h = hashlib.sha256(json.dumps([src.kind, config["seed"], config["lora_from"]]).encode())
    if src.kind == "hf":
        files = sorted(f for f in os.listdir(src.path)
                       if f == "config.json" or f.endswith(".safetensors"))
    else:
        files = ["manifest.json"] if src.kind == "run" else []
    for f in files:
        h.update(f"{f}:{guard_files.sha256_file(os.path.join(src.path, f))}\n".encode())
    if src.kind == "fresh":
        h.update(json.dumps({k: config[k] for k in sorted(config) if k.startswith("n_")}).encode())
    return h.hexdigest()


def data_key(data_dir, config):
    """The data's hash: meta.json and the pairs' index of both splits, and how rows are cut."""
    h = hashlib.sha256(json.dumps([config["block_size"], config["doc_mask"],
                                   config["dtype"]]).encode())
    for f in ("meta.json", "train.pairs.npy", "val.pairs.npy"):
        h.update(f"{f}:{guard_files.sha256_file(os.path.join(data_dir, f))}\n".encode())
    return h.hexdigest()


def reference(model, loaders, src, config, data_dir, out_dir, mesh, autocast):
    """Gives each loader (train, val) its `ref` table: read from out_dir when a table of this
    starting model and data is there (always on resume), else computed now and kept."""
    if config["loss_type"] == "simpo":  # reference-free
        return
    path = os.path.join(out_dir, "ref_logps.json")
    keys, saved = None, None
    if mesh.master:  # rank 0 reads and hashes; every rank decides alike
        keys = {"data": data_key(data_dir, config),
                "model": model_key(src, config) if src.kind != "resume" else None}
        if os.path.exists(path):
            saved = guard_files.read_json(path, "delete it and start the run again")
    keys, saved = parallel.broadcast_object((keys, saved), mesh)
    if src.kind == "resume":
        check(saved is not None, f"{path} is missing: the reference log-probs of this run's "
                                 f"starting model are gone (never recomputed from trained "
                                 f"weights); start the run again in a new out_dir")
        check(saved.get("data") == keys["data"],
              f"{path}: the dataset (or block_size, doc_mask, dtype) changed since this run "
              f"started: resume with the same, or start a new out_dir")
        keys = saved
    name = hashlib.sha256(f"{keys['model']}:{keys['data']}".encode()).hexdigest()[:16]
    for split, loader in loaders.items():
        file = os.path.join(out_dir, f"ref_logps-{name}.{split}.npy")
        found = parallel.broadcast_object(os.path.exists(file), mesh) and saved == keys
        if found:
            loader.ref = read_table(file, loader.n_chunks)
            continue
        check(src.kind != "resume", f"{file} is missing: the reference log-probs of this run's "
                                    f"starting model are gone (never recomputed from trained "
                                    f"weights); start the run again in a new out_dir")
        mesh.print0(f"reference: the starting model's log-probs of {loader.n_chunks:,} {split} "
                    f"pairs (once, kept in {file})")
        table = sequence_logps(model, loader, mesh, autocast, config["doc_mask"],
                               config["pp_virtual"]).numpy()
        loader.ref = table
        if mesh.master:
            common.write_atomic(file, lambda f: np.save(f, table))
    if mesh.master:
        common.write_atomic(path, lambda f: f.write(json.dumps(keys).encode()))


def read_table(file, n_pairs):
    """A reference table from out_dir, read as hostile: (n_pairs, 2) finite floats, no pickle."""
    try:
        table = np.load(file, allow_pickle=False)
    except (OSError, ValueError) as e:
        raise UserError(f"{file} cannot be read ({e}): delete it and start the run again in a "
                        f"new out_dir") from None
    if table.shape != (n_pairs, 2) or table.dtype != np.float64 or not np.isfinite(table).all():
        raise UserError(f"{file} is not a table of {n_pairs} pairs' finite log-probs: it is "
                        f"damaged; start the run again in a new out_dir")
    return table


# ---------------------------------------------------------------------------------------
# sample.py eval=True on a dataset of pairs


def val_metrics(model, data_dir, c, ref_model=None):
    """{the loss, TRL's metrics} of `model` on the whole val split of a dataset of pairs, against
    `ref_model`'s log-probs (None: reference-free, as SimPO: each side's log-prob per token), with
    c's loss_type, beta, label_smoothing and simpo_gamma (the run's, or TRL's defaults)."""
    keys = {"loss_type": "sigmoid", "beta": 0.1, "label_smoothing": 0.0, "simpo_gamma": 0.0,
            **c.get("preference", {})}
    if ref_model is None and keys["loss_type"] != "simpo":
        keys.update(loss_type="simpo", simpo_gamma=0.0)
    c = {**keys, "block_size": c["block_size"], "batch_size": 2 * max(1, c["batch_size"] // 2),
         "grad_accum_steps": 1, "seed": 0, "datasets": "", "phases": []}
    loader = PairLoader(data_dir, "val", c)
    logps = sequence_logps(model, loader, None, nullcontext(), False)
    ref = (sequence_logps(ref_model, loader, None, nullcontext(), False)
           if ref_model is not None else torch.zeros_like(logps))
    n = loader.pair_rows(np.arange(loader.n_chunks))[2].sum(-1)  # (chosen rows, then rejected)
    loss = PairLoss(c, None)
    mean = loss.of_logps(logps.T.reshape(-1), n.double(), ref.T.reshape(-1)).item()
    return {"loss": mean, **loss.metrics(loss.take(), loader.n_chunks)}
