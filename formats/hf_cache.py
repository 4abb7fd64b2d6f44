"""
A model named as on the Hugging Face hub (init_from=ORG/NAME, or ORG/NAME@REV) found in the
local Hugging Face cache, offline, where transformers finds it: $HF_HUB_CACHE, else
$HF_HOME/hub, else ~/.cache/huggingface/hub ($XDG_CACHE_HOME for ~/.cache). There the model
lies as huggingface_hub lays it out: models--ORG--NAME/snapshots/<commit>/, the commit that
refs/<revision> names (refs/main unless a revision is asked for), or the commit itself. The
snapshot is then read as any Hugging Face directory: its files (links into ../../blobs) are as
hostile as any other, and every rule of reading one applies.
"""

import os
import re

from guards.guard_errors import UserError

# the hub's names: an owner and a name, letters, digits, '-', '_', '.'
HUB_NAME = re.compile(r"[A-Za-z0-9][\w.-]{0,95}/[A-Za-z0-9][\w.-]{0,95}")
COMMIT = re.compile(r"[0-9a-f]{40}")


def hub_name(value):
    """(ORG/NAME, revision or '') when value names a hub model rather than a path, else None:
    an existing path is a path, as transformers takes it."""
    if not value or os.path.exists(value):
        return None
    name, _, revision = value.partition("@")
    return (name, revision) if HUB_NAME.fullmatch(name) and ".." not in name else None


def cache_dir():
    """The hub cache transformers reads: huggingface_hub's order of the variables."""
    home = os.environ.get("HF_HOME") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"),
        "huggingface")
    return (os.environ.get("HF_HUB_CACHE") or os.environ.get("HUGGINGFACE_HUB_CACHE")
            or os.path.join(home, "hub"))


def local(revision="", **paths):
    """snapshot() of each key=value of paths (init_from=..., lora_from=...), in their order."""
    return tuple(snapshot(key, value, revision) for key, value in paths.items())


def snapshot(key, value, revision=""):
    """value itself, or for a hub name its snapshot directory in the local cache (`revision`,
    the config's key, unless the name carries @REV); not there: one line naming the name,
    where it looked and the command that downloads it."""
    found = hub_name(value)
    if found is None:
        return value
    name, rev = found
    rev = rev or revision or "main"
    root = cache_dir()
    repo = os.path.join(root, "models--" + name.replace("/", "--"))
    commit = rev if COMMIT.fullmatch(rev) else _ref(repo, rev)
    snapshot = commit and os.path.join(repo, "snapshots", commit)
    if snapshot and os.path.isdir(snapshot):
        return snapshot
    at = "" if rev == "main" else f" --revision {rev}"
    raise UserError(f"{key}={value} is not a directory, and {name} (revision {rev}) is not in "
                    f"the local Hugging Face cache ({root}; HF_HOME / HF_HUB_CACHE move it): "
                    f"download it with `hf download {name}{at}`, or give the model's directory")


def _ref(repo, rev):
    """The commit refs/<rev> names (a branch or tag; refs/pr/1 too), or None: a ref is a file
    of 40 hex digits, and a name that would climb out of refs/ is none."""
    refs = os.path.join(repo, "refs")
    path = os.path.normpath(os.path.join(refs, rev))
    if os.path.commonpath([refs, path]) != refs or not os.path.isfile(path):
        return None
    try:
        with open(path, "rb") as f:
            commit = f.read(64).decode("ascii", "replace").strip()
    except OSError:
        return None
    return commit if COMMIT.fullmatch(commit) else None
