"""
Preference pairs in TRL's formats, as prepare.py reads them (JSONL or Parquet records):

    {"prompt": [messages], "chosen": [messages], "rejected": [messages]}   # explicit prompt
    {"chosen": [messages], "rejected": [messages]}   # implicit: the shared turns are the prompt
    {"prompt": "text", "chosen": "text", "rejected": "text"}               # plain text

A pair becomes two sequences, prompt + chosen and prompt + rejected, each with a loss mask
on its completion only; TRL's cut (its collator's `keep_start`) shortens a sequence past the
row, and a pair whose prompt alone fills the row is dropped, as TRL drops it.
"""

import numpy as np

from formats import corpora
from guards.guard_errors import UserError

EXAMPLE = ('{"prompt": [{"role": "user", "content": "..."}], "chosen": [{"role": "assistant", '
           '"content": "..."}], "rejected": [{"role": "assistant", "content": "..."}]}')


def is_pair(record):
    return isinstance(record, dict) and "chosen" in record and "rejected" in record


def text_pairs(files, text_field, decode):
    """Whether the source's first pair is plain text (its completions strings)."""
    for path in files:
        for _, record, _ in corpora.records(path, text_field, decode):
            return isinstance(record.get("chosen"), str)
    return False


def split_pair(record, where):
    """("chat", prompt, chosen, rejected) with message lists (the prompt may be empty), or
    ("text", prompt, chosen, rejected) with strings. An implicit prompt is the turns chosen and
    rejected share, as TRL's extract_prompt takes it."""
    if not is_pair(record):
        raise UserError(f"{where}: not a preference pair (the source's first record is one): "
                        f"write every line as {EXAMPLE}")
    chosen, rejected, prompt = record["chosen"], record["rejected"], record.get("prompt")
    if isinstance(chosen, str) and isinstance(rejected, str):
        if not isinstance(prompt, str):
            raise UserError(f"{where}: a plain-text pair needs a string 'prompt' beside 'chosen' "
                            f"and 'rejected'")
        return "text", prompt, chosen, rejected
    if not (isinstance(chosen, list) and isinstance(rejected, list)):
        raise UserError(f"{where}: 'chosen' and 'rejected' must both be strings or both lists of "
                        f"messages: write {EXAMPLE}")
    if prompt is None:  # implicit: the longest run of turns both share
        n = 0
        while n < min(len(chosen), len(rejected)) and chosen[n] == rejected[n]:
            n += 1
        prompt, chosen, rejected = chosen[:n], chosen[n:], rejected[n:]
    if not isinstance(prompt, list):
        raise UserError(f"{where}: 'prompt' must be a list of messages when 'chosen' is one")
    return "chat", prompt, chosen, rejected


def completion_mask(mask, prompt_replies):
    """The chat mask (1 on every assistant reply) kept on the completion's replies only: those
    after the prompt's own `prompt_replies` assistant turns."""
    mask, runs = list(mask), 0
    for i, m in enumerate(mask):
        runs += m and (i == 0 or not mask[i - 1])
        if runs > prompt_replies:
            return [0] * i + mask[i:]
    return [0] * len(mask)


def pair_rows(pairs_index, n_tokens, path):
    """A preference split's index (n_pairs, 4): start and length of chosen, then rejected, each
    inside the token file: read as hostile (np.load without pickle)."""
    fix = f"prepare the dataset again ({path} is damaged or from another dataset)"
    try:
        index = np.load(pairs_index, allow_pickle=False)
    except (OSError, ValueError) as e:
        raise UserError(f"{pairs_index} cannot be read ({e}): {fix}") from None
    if (index.ndim != 2 or index.shape[1] != 4 or not len(index)
            or index.dtype.kind not in "iu"):
        raise UserError(f"{pairs_index} is not a (pairs, 4) integer table: {fix}")
    index = index.astype(np.int64)
    starts, lengths = index[:, 0::2], index[:, 1::2]
    if (starts < 0).any() or (lengths < 2).any() or (starts + lengths > n_tokens).any():
        raise UserError(f"{pairs_index} points outside {path}'s {n_tokens} tokens: {fix}")
    return index
