"""
Machine-specific workarounds, named as such so that a reader can skip them and a fork can
drop them: neither changes what is computed.

- keep_freed_memory: glibc's malloc serves a block over its mmap threshold (128 KB at first)
  with a fresh mmap and returns it to the OS when it is freed, so every step's logits, softmax
  and their gradients (768 x 8192 floats = 24 MiB each in the default job) arrive as untouched
  pages that the kernel faults in and zeroes one 4 KB page at a time: ~6,600 page faults per
  step, measured ~7% of the default job's time. Fixing the threshold (32 MB, the most glibc
  allows on 64-bit) and raising the trim threshold lets the heap keep and reuse those blocks.
- exit_now: gloo's worker threads can abort the interpreter's shutdown of a finished run.
"""

import ctypes
import os
import sys


def keep_freed_memory(mmap_mb=32):
    """CPU runs on Linux: keep freed tensor memory in the process instead of handing it back
    (above). Returns whether it took (False where the C library is not glibc: macOS, musl)."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return False
    M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # malloc.h
    return bool(libc.mallopt(M_MMAP_THRESHOLD, mmap_mb << 20)
                and libc.mallopt(M_TRIM_THRESHOLD, 1 << 30))


def exit_now(code=0):
    """Ends a process that has torn its process group down and written everything, without
    the interpreter's shutdown. There gloo's worker threads, still holding finished work, can
    take the whole process down with SIGABRT ("terminate called without an active
    exception"; pytorch/pytorch#190489), and a run that did all its work would exit as failed:
    seen here about once in a few hundred multi-process runs."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
