"""The workflow on the real model, measured: continued pretraining, SFT, DPO and the export of
SmolLM2-135M-Instruct (.cache/smollm2: tests/real_model.py), each stage a train.py run with its
config/ recipe shortened to fit a 2-core CPU, on text no one here wrote: this machine's man pages.

- CPT: the Swedish man pages (/usr/share/man/sv), troff stripped to text.
- SFT: English man pages (/usr/share/man/man1) as conversations: "What does the `cmd` command
  do?", answered with the page's NAME line.
- DPO: pairs from other English pages (none of SFT's): the same question, chosen the page's own
  answer, rejected another page's description in the same words ("The `cmd` command: ...").

Measured with transformers on the exports (float32): on the held-out pairs (val_fraction), the
share whose chosen reply has the higher log-prob (accuracy) and the mean log-prob margin, for the
SFT model (before) and each DPO model (after), and DPO's own rewards against the SFT model (beta
0.1: TRL's rewards/accuracies and rewards/margins); the forgetting: the mean loss over fixed
256-token blocks of Python (the stdlib's json package: text the base knew) and of held-out
Swedish pages, before and after. Then the DPO export's checks: the base's chat template kept,
and transformers' logits equal to the checkpoint's through model.py.

    python -m bench.dpo [model=DIR] [work=DIR] [rates=1e-5,3e-6] [dpo_iters=12]

Not a bench.py table (minutes of a real model, not a timing): run from the repository root.
"""

import glob
import gzip
import json
import os
import re
import shutil
import subprocess
import sys
import time

import numpy as np
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ARGS = dict(a.split("=", 1) for a in sys.argv[1:] if "=" in a)
SHORT = ["batch_size=2", "block_size=256", "grad_accum_steps=1", "warmup_iters=2",
         "compile=False", "eval_iters=2", "log_interval=1", "sample_tokens=0"]


GLYPHS = {":a": "ä", ":o": "ö", "oa": "å", ":A": "Ä", ":O": "Ö", "oA": "Å", ":u": "ü",
          ":U": "Ü", "ss": "ß", "'e": "é", "aq": "'", "dq": '"', "em": "-", "en": "-",
          "lq": '"', "rq": '"', "cq": "'", "oq": "'", "bu": "*", "co": "(c)", "rs": "\\"}


def troff_text(raw):
    """A man page's troff source as plain text: requests dropped (a font macro keeps its
    words), escapes undone."""
    out = []
    for line in raw.splitlines():
        if line.startswith((".\\\"", "'\\\"")):
            continue
        if line.startswith("."):
            parts = line.split(None, 1)
            if len(parts) > 1 and parts[0] in (".B", ".I", ".BR", ".IR", ".BI", ".RB", ".IB",
                                               ".RI", ".SH", ".SS"):
                out.append(parts[1].replace('"', ""))
            elif parts[0] in (".PP", ".P", ".LP", ".sp", ".TP", ".IP"):
                out.append("")
            continue
        out.append(line)
    text = re.sub(r"\\f(\[[^]]*\]|\(..|.)", "", "\n".join(out))
    text = text.replace("\\-", "-").replace("\\e", "\\").replace("\\ ", " ").replace("\\&", "")
    text = text.replace("\\*(Aq", "'").replace("\\*[Aq]", "'")
    # named characters: \(xx or \[xx]
    text = re.sub(r"\\(?:\((..)|\[(..)\])", lambda m: GLYPHS.get(m.group(1) or m.group(2), ""),
                  text)
    return re.sub(r"\\(\*?\(..|\*?\[[^]]*\]|.)", "", text)


def name_line(raw):
    """(command, description) from a page's NAME section, or None."""
    m = re.search(r'^\.SH "?NAME"?\s*\n(.*?)^\.S[HS]', raw, re.M | re.S)
    if not m:
        return None
    line = " ".join(troff_text(m.group(1)).split())
    cmd, sep, desc = line.partition(" - ")
    cmd = cmd.split(",")[0].strip()
    ok = sep and re.fullmatch(r"[a-z][a-z0-9_.+-]{1,20}", cmd) and 15 <= len(desc) <= 100
    return (cmd, desc.strip().rstrip(".")) if ok else None


def man_pages(pattern):
    for path in sorted(glob.glob(pattern)):
        try:
            yield path, gzip.open(path).read().decode("utf-8", "replace")
        except (OSError, EOFError):
            continue


def ask(cmd):
    return [{"role": "user", "content": f"What does the `{cmd}` command do?"}]


def say(cmd, desc):
    return [{"role": "assistant", "content": f"The `{cmd}` command: {desc}."}]


def write_jsonl(path, records):
    with open(path, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in records)
    return path


def make_data(work):
    """The stages' sources in work/: sv/*.txt (CPT), chat.jsonl, pairs.jsonl; and the texts
    the forgetting is measured on: sv_held/*.txt (pages CPT never sees), python.txt."""
    for i, (path, raw) in enumerate(list(man_pages("/usr/share/man/sv/man1/*.gz"))[:40]):
        folder = os.path.join(work, "sv" if i % 5 else "sv_held")
        os.makedirs(folder, exist_ok=True)
        with open(os.path.join(folder, os.path.basename(path).split(".")[0] + ".txt"), "w") as f:
            f.write(troff_text(raw))
    pages, seen = [], set()
    for _, raw in man_pages("/usr/share/man/man1/*.1.gz"):
        entry = name_line(raw)
        if entry and entry[0] not in seen and entry[1] not in {d for _, d in pages}:
            seen.add(entry[0])
            pages.append(entry)
    rng = np.random.default_rng(0)
    order = rng.permutation(len(pages))
    sft, dpo = [pages[i] for i in order[:400]], [pages[i] for i in order[400:448]]
    write_jsonl(os.path.join(work, "chat.jsonl"),
                [{"messages": ask(c) + say(c, d)} for c, d in sft])
    other = rng.permutation(len(dpo))
    other = np.where(other == np.arange(len(dpo)), (other + 1) % len(dpo), other)
    write_jsonl(os.path.join(work, "pairs.jsonl"),
                [{"prompt": ask(c), "chosen": say(c, d), "rejected": say(c, dpo[j][1])}
                 for (c, d), j in zip(dpo, other)])
    json_pkg = os.path.join(os.path.dirname(json.__file__), "*.py")
    with open(os.path.join(work, "python.txt"), "w") as f:
        f.write("\n".join(open(p).read() for p in sorted(glob.glob(json_pkg))))


def train(*args):
    t0 = time.time()
    subprocess.run([sys.executable, "train.py", *args], cwd=ROOT, check=True)
    return time.time() - t0


def block_loss(model, ids, n=4, T=256):
    """The mean next-token loss over n fixed T-token blocks of ids."""
    blocks = torch.tensor(ids[:n * (T + 1)]).view(n, T + 1)
    with torch.no_grad():
        logits = model(blocks[:, :-1]).logits
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), blocks[:, 1:].flatten()).item()


def pair_logps(model, data_dir):
    """(n, 2): each held-out pair's (chosen, rejected) completion log-prob, from the ids and masks
    the run trained on (data_dir's val split)."""
    meta = json.load(open(os.path.join(data_dir, "meta.json")))
    tokens = np.fromfile(os.path.join(data_dir, "val.bin"), dtype=meta["dtype"]).astype(np.int64)
    mask = np.fromfile(os.path.join(data_dir, "val.mask.bin"), dtype=np.uint8)
    out = []
    with torch.no_grad():
        for row in np.load(os.path.join(data_dir, "val.pairs.npy")):
            pair = []
            for start, n in row.reshape(2, 2):
                ids = torch.from_numpy(tokens[start:start + n])[None]
                logp = torch.log_softmax(model(ids).logits[0, :-1].float(), -1)
                picked = logp.gather(1, ids[0, 1:, None])[:, 0]
                pair.append((picked * torch.from_numpy(mask[start + 1:start + n])).sum().item())
            out.append(pair)
    return np.array(out)


def main():
    from transformers import AutoModelForCausalLM, AutoTokenizer
    base = ARGS.get("model", os.path.join(ROOT, ".cache", "smollm2"))
    work = ARGS.get("work", "/tmp/dpo_bench")
    rates = [float(r) for r in ARGS.get("rates", "1e-5").split(",")]
    iters = ARGS.get("dpo_iters", "12")
    if not os.path.isfile(os.path.join(base, "model.safetensors")):
        sys.exit(f"error: no model in {base}: build it (python tests/real_model.py) or model=DIR")
    if not os.path.exists(os.path.join(work, "python.txt")):  # (train.py skips a finished run)
        os.makedirs(work, exist_ok=True)
        make_data(work)

    def run(name):
        return os.path.join(work, name)
    times = {"cpt": train("config/cpt.py", f"init_from={base}", f"dataset={run('d_sv')}",
                          f"data_source={run('sv')}/*.txt", "val_fraction=0.2",
                          f"out_dir={run('cpt')}", "max_iters=6", "eval_interval=6", *SHORT)}
    times["sft"] = train("config/sft.py", f"init_from={run('cpt')}", f"dataset={run('d_chat')}",
                         f"data_source={run('chat.jsonl')}", "val_fraction=0.1",
                         f"out_dir={run('sft')}", f"export_hf={run('sft_hf')}", "max_iters=6",
                         "eval_interval=6", *SHORT)
    dpo = [f"init_from={run('sft')}", f"dataset={run('d_pairs')}", "val_fraction=0.25",
           f"data_source={run('pairs.jsonl')}", "block_size=64", "batch_size=4",
           "grad_accum_steps=2", "warmup_iters=2", "compile=False", "eval_iters=1",
           f"max_iters={iters}", f"eval_interval={iters}", "log_interval=1", "sample_tokens=0"]
    for i, lr in enumerate(rates):
        if i:  # the reference's tables are the SFT model's on the same pairs: kept, not redone
            os.makedirs(run(f"dpo{i}"))
            for f in glob.glob(os.path.join(run("dpo0"), "ref_logps*")):
                shutil.copy(f, run(f"dpo{i}"))
        times[f"dpo {lr:g}"] = train("config/dpo.py", *dpo, f"learning_rate={lr}",
                                     f"min_lr={lr / 10}", f"out_dir={run(f'dpo{i}')}",
                                     f"export_hf={run(f'dpo{i}_hf')}")

    tok = AutoTokenizer.from_pretrained(base)
    python = tok(open(run("python.txt")).read()).input_ids
    held_out = sorted(glob.glob(os.path.join(run("sv_held"), "*.txt")))
    sv = tok("\n".join(open(p).read() for p in held_out)).input_ids
    rows, ref = [], None
    for name in ["sft_hf"] + [f"dpo{i}_hf" for i in range(len(rates))]:
        model = AutoModelForCausalLM.from_pretrained(run(name), dtype=torch.float32).eval()
        logps = pair_logps(model, run("d_pairs"))
        ref = logps if ref is None else ref
        reward = 0.1 * ((logps[:, 0] - ref[:, 0]) - (logps[:, 1] - ref[:, 1]))
        rows.append((name, (logps[:, 0] > logps[:, 1]).mean(), (logps[:, 0] - logps[:, 1]).mean(),
                     (reward > 0).mean(), reward.mean(), block_loss(model, python),
                     block_loss(model, sv)))
    print(f"\n## the workflow on SmolLM2-135M-Instruct ({len(ref)} held-out pairs; "
          f"{time.strftime('%Y-%m-%d %H:%M', time.gmtime())} UTC)")
    print("model | accuracy | margin (log-prob) | rewards/accuracies | rewards/margins | "
          "Python loss | held-out Swedish loss")
    for r in rows:
        print(f"{r[0]} | {r[1]:.3f} | {r[2]:.3f} | {r[3]:.3f} | {r[4]:.4f} | {r[5]:.4f} | "
              f"{r[6]:.4f}")
    print("seconds per stage: " + ", ".join(f"{k} {v:.0f}" for k, v in times.items()))
    check_export(base, run("dpo0"), run("dpo0_hf"))


def check_export(base, out_dir, export):
    """The DPO export keeps the base's chat template, and transformers gives the checkpoint's
    logits (model.py, sample.load_model)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    sys.path.insert(0, ROOT)
    import sample
    chat = [{"role": "user", "content": "What does the `tar` command do?"}]
    ids = [AutoTokenizer.from_pretrained(d).apply_chat_template(chat, add_generation_prompt=True)
           for d in (base, export)]
    # (a list of ids, or a BatchEncoding of them, as transformers' version gives it)
    ids = [list(i) if isinstance(i, list) else list(i["input_ids"]) for i in ids]
    latest = open(os.path.join(out_dir, "ckpt", "latest")).read().strip()
    ours, _ = sample.load_model(os.path.join(out_dir, "ckpt", latest))
    theirs = AutoModelForCausalLM.from_pretrained(export, dtype=torch.float32).eval()
    probe = torch.tensor([ids[1]])
    with torch.no_grad():
        diff = (theirs(probe).logits - ours.eval()(probe)[0]).abs().max().item()
    print(f"export: chat template {'kept' if ids[0] == ids[1] else 'CHANGED'} "
          f"({len(ids[1])} ids), logits max |transformers - ours| = {diff:.2e}")


if __name__ == "__main__":
    main()
