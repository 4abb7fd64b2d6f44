"""Encoding the default corpus (its first ~30 MB) with the default tokenizer (cl100k_base cut to
8,192 ids) through tiktoken, and with the same BPE exported as a tokenizer.json
(hf.hf_tokenizer) read back by hf_tokenizer.load (how a model's tokenizer.json is read: its
tiktoken twin where that is exact, as here) and through the `tokenizers` library alone,
tokenizer_py.encode_batch on the machine's threads, best of 3: tokens/s and MB/s; the ids are
checked equal."""

import copy
import json
import os
import tempfile
import time

import tokenizer as tokenizer_py


def table_tokenize(max_mb=30, repeats=3):
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


def timed(fn):
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0
