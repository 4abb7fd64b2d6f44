"""Encoding the default corpus (its first ~30 MB) with the default tokenizer (cl100k_base cut to
8,192 ids) through tiktoken, and with the same BPE exported as a tokenizer.json
(hf.hf_tokenizer) read back by hf_tokenizer.load (how a model's tokenizer.json is read: its
tiktoken twin where that is exact, as here) and through the `tokenizers` library alone,
tokenizer_py.encode_batch on the machine's threads, best of 3: tokens/s and MB/s; the ids are
checked equal. Then prepare.py's peak memory (its process's maximum resident set) on one long
document (long_mb of the corpus as one line of JSONL, beside a few short ones), encoded whole
and in pieces of PIECE_CHARS (tokenizer.encode_long), the datasets checked equal."""

import copy
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

import tokenizer as tokenizer_py


def table_tokenize(max_mb=30, repeats=3, long_mb=50):
    from formats import hf
    from formats import corpora
    from formats import hf_tokenizer
    enc = tokenizer_py.get_tokenizer("cl100k_base", 8192)
    tmp = tempfile.mkdtemp()
    tj, config = hf.hf_tokenizer(enc, 256)
    for name, obj in (("tokenizer.json", tj), ("tokenizer_config.json", config)):
        with open(os.path.join(tmp, name), "w", encoding="utf-8") as f:
            json.dump(obj, f, ensure_ascii=False)
    ours = hf_tokenizer.load(os.path.join(tmp, "tokenizer.json"))
    texts, size = [], 0
    for path in corpora.stdlib_files()[1]:
        with open(path, encoding="utf-8", errors="replace") as f:
            texts.append(f.read())
        size += len(texts[-1].encode())
        if size > max_mb * 1e6:
            break
    threads = os.cpu_count() or 1
    print(f"\n## encoding {len(texts)} files ({size / 1e6:.1f} MB) of the default corpus with "
          f"cl100k_base/8192, tokenizer_py.encode_batch on {threads} threads, best of {repeats}")
    print(f"{'backend':52} | {'tokens/s':>12} | {'MB/s':>6}")
    print("-" * 78)
    slow = copy.copy(ours)
    slow.twin = None
    got = {}
    for label, e in (("tiktoken (cl100k_base/8192)", enc),
                     ("hf_tokenizer.load of its tokenizer.json (tiktoken twin)", ours),
                     ("the same, `tokenizers` alone (no twin)", slow)):
        best = min(
            timed(lambda: got.__setitem__(label, tokenizer_py.encode_batch(e, texts, threads)))
            for _ in range(repeats))
        n = sum(map(len, got[label]))
        print(f"{label:52} | {n / best:12,.0f} | {size / 1e6 / best:6.2f}")
    assert (ours.twin is not None
            and len(set(map(str, got.values()))) == 1), "the backends gave different ids"
    prepare_peak(texts, long_mb, tmp)
    shutil.rmtree(tmp, ignore_errors=True)


# prepare.py in a process of its own: its peak resident set, in MB (ru_maxrss is kB on Linux)
PEAK = """
import resource, sys
sys.path.insert(0, sys.argv[1])
import prepare, tokenizer
tokenizer.PIECE_CHARS = int(sys.argv[4]) or tokenizer.PIECE_CHARS
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
prepare.prepare(sys.argv[2], sys.argv[3], "cl100k_base", 8192, 0.5, verbose=False)
print(base, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
"""


def prepare_peak(texts, long_mb, tmp):
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    src = os.path.join(tmp, "long")
    os.makedirs(src)
    doc, size = [], 0
    while size < long_mb * 1e6:
        doc += texts
        size += sum(len(t) for t in texts)
    with open(os.path.join(src, "long.jsonl"), "w", encoding="utf-8") as f:
        f.write(json.dumps({"text": "".join(doc)[:int(long_mb * 1e6)]}) + "\n")
        f.writelines(json.dumps({"text": t}) + "\n" for t in texts[:20])
    print(f"\n## prepare.py on one document of {long_mb:g} MB (JSONL, cl100k_base/8192): peak "
          f"resident memory")
    print(f"{'encoding':40} | {'peak MB':>8} | {'past imports':>12} | {'x the document':>14} "
          f"| {'s':>6}")
    print("-" * 94)
    made = []
    for label, piece in (("whole (one encode call)", 1 << 62),
                         (f"pieces of {tokenizer_py.PIECE_CHARS:,} characters", 0)):
        out = os.path.join(tmp, f"out{len(made)}")
        t0 = time.perf_counter()
        p = subprocess.run([sys.executable, "-c", PEAK, root, src, out, str(piece)],
                           capture_output=True, text=True, check=True)
        dt, (base, peak) = time.perf_counter() - t0, map(float, p.stdout.split()[-2:])
        print(f"{label:40} | {peak:8,.0f} | {peak - base:12,.0f} | "
              f"{(peak - base) / long_mb:14.1f} | {dt:6.1f}")
        made.append([open(os.path.join(out, n), "rb").read() for n in ("train.bin", "val.bin")])
    assert made[0] == made[1], "the pieces gave other tokens than the whole document"


def timed(fn):
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0
