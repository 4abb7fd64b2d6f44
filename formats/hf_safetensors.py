"""
Hugging Face's weight files (safetensors) through their own library, which is made for the
format, hardened and fuzzed: a header whose offsets overlap, leave gaps or pass the file is
refused, and loading never runs code. Its refusals become one line naming the file;
get_slice reads only a rank's rows. hf.py and lora.py read and write with these.
"""

import contextlib
import os

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from guards.guard_errors import UserError

SAFETENSORS_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16,
                      "BF16": torch.bfloat16,
                      "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
                      "U8": torch.uint8, "BOOL": torch.bool}


def _corrupt(path, problem):
    return UserError(f"{path}: {problem}; the file is truncated, damaged or not safetensors: copy "
                     f"or download it again")


@contextlib.contextmanager
def open_safetensors(path):
    """safe_open(path), its refusals (and a file that shrank while read) one UserError line."""
    try:
        with safe_open(path, "pt") as f:
            yield f
    except SafetensorError as e:
        raise _corrupt(path, str(e).strip().splitlines()[0][:200]) from None


def read_safetensors_header(path):
    """(None, {name: (None, None, dtype, shape)}) of a .safetensors file, its header checked by
    the library; a dtype outside SAFETENSORS_DTYPES is refused. Reads the header only."""
    entries = {}
    with open_safetensors(path) as f:
        for name in f.keys():
            part = f.get_slice(name)
            dtype = SAFETENSORS_DTYPES.get(part.get_dtype())
            if dtype is None:
                raise UserError(f"{path}: tensor '{name}' has dtype {part.get_dtype()!r}, which "
                                f"this reader does not support ({', '.join(SAFETENSORS_DTYPES)}): "
                                "convert it to one of those")
            entries[name] = (None, None, dtype, list(part.get_shape()))
    return None, entries


def read_safetensors_part(f, path, data_start, name, entry, dim=None, start=0, stop=0):
    """Tensor `name` of the open safetensors file f (open_safetensors), or only rows
    [start, stop) of it along dim: only those bytes are read."""
    try:
        if dim is None:
            return f.get_tensor(name)
        return f.get_slice(name)[(slice(None),) * dim + (slice(start, stop),)]
    except SafetensorError as e:
        raise _corrupt(path, f"tensor '{name}': {str(e).strip().splitlines()[0][:200]}") from None


def read_safetensors(path):
    """{name: tensor} of a .safetensors file, on CPU; a malformed file is one UserError line."""
    read_safetensors_header(path)  # (the dtypes this reader supports)
    with open_safetensors(path) as f:
        return {name: read_safetensors_part(f, path, None, name, None) for name in f.keys()}


def write_safetensors(path, tensors, metadata=None):
    """Writes {name: tensor} as a .safetensors file (the library's save_file). Atomic: a temp
    file renamed into place, so a crash never leaves half a file under `path`."""
    tensors = {name: t.detach().to("cpu").contiguous() for name, t in tensors.items()}
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        with open(tmp, "wb"):  # made as open() makes a file: its mode is what the umask allows
            mode = os.stat(tmp).st_mode & 0o777
        save_file(tensors, tmp,
                  {str(k): str(v) for k, v in metadata.items()} if metadata else None)
        # (the library writes through a temp file of its own, of mode 0600)
        os.chmod(tmp, mode)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
