"""A safetensors file written piece by piece, so that a checkpoint never needs a second copy of the state.

``safetensors.torch.save`` takes whole tensors and returns the whole file as one ``bytes``: saving a buffer with it
means concatenating every block into checkpoint tensors (one copy of the state) and then serialising them (a second
copy).  The format is simple enough to stream instead (https://github.com/huggingface/safetensors, "Format"):

    8 bytes      N, little-endian u64
    N bytes      JSON header {name: {"dtype", "shape", "data_offsets": [begin, end]}}, padded with spaces to 8 bytes
    rest         the tensors' bytes, back to back, offsets relative to the end of the header

A :class:`Streamed` tensor declares its dtype and shape up front and yields its data as pieces (views of the
buffer's blocks) whose concatenation along the first axis is the tensor; :func:`chunks` emits the file as byte
chunks of about :data:`CHUNK_BYTES`, copying only small pieces into a reusable staging buffer.  Files are read back
with safetensors itself (:func:`hdreplay.checkpoint.read_checkpoint_dir`), which checks the header, the offsets and
the sizes.  Hand-written because safetensors offers no incremental writer.
"""

from __future__ import annotations

import json
import math
import struct
import sys
from dataclasses import dataclass
from typing import Callable, Iterable, Iterator, Mapping

import torch

#: torch dtype -> safetensors dtype name
DTYPES = {torch.bool: "BOOL", torch.uint8: "U8", torch.int8: "I8", torch.int16: "I16", torch.int32: "I32",
          torch.int64: "I64", torch.float16: "F16", torch.bfloat16: "BF16", torch.float32: "F32", torch.float64: "F64"}
#: target size of one emitted chunk (pieces smaller than this are staged together)
CHUNK_BYTES = 1 << 20


@dataclass(frozen=True)
class Streamed:
    """A checkpoint tensor of ``dtype`` and ``shape`` whose data ``parts()`` yields as CPU tensors of shape
    ``(k_i, *shape[1:])`` with ``sum k_i == shape[0]``, in order (a 0-d tensor: one part of shape ``()``)."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    parts: Callable[[], Iterable[torch.Tensor]]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * torch.empty(0, dtype=self.dtype).element_size()


def streamed(t: torch.Tensor) -> Streamed:
    """A whole tensor as a one-part :class:`Streamed` (moved to the CPU when written)."""
    return Streamed(t.dtype, tuple(t.shape), lambda: [t.detach().cpu()])


def specs(tensors: Mapping[str, "torch.Tensor | Streamed"]) -> dict[str, Streamed]:
    """Checked :class:`Streamed` of every entry (ValueError / TypeError saying what cannot be written)."""
    if sys.byteorder != "little":  # pragma: no cover - safetensors is little-endian
        raise ValueError("streaming a safetensors file needs a little-endian machine")
    out = {}
    for name, t in tensors.items():
        if not isinstance(name, str) or not name or name == "__metadata__":
            raise TypeError(f"tensor names must be non-empty strings, got {name!r}")
        s = streamed(t) if isinstance(t, torch.Tensor) else t
        if not isinstance(s, Streamed):
            raise TypeError(f"{name!r}: expected a torch.Tensor, got {type(t).__name__}")
        if s.dtype not in DTYPES:
            raise TypeError(f"{name!r}: dtype {s.dtype} cannot be saved (allowed: {sorted(map(str, DTYPES))})")
        out[name] = s
    return dict(sorted(out.items()))


def header(specs: Mapping[str, Streamed]) -> tuple[bytes, int]:
    """(the file's first bytes: length + padded JSON header, total file size)."""
    entries, off = {}, 0
    for name, s in specs.items():
        entries[name] = {"dtype": DTYPES[s.dtype], "shape": list(s.shape), "data_offsets": [off, off + s.nbytes]}
        off += s.nbytes
    text = json.dumps(entries, separators=(",", ":")).encode()
    text += b" " * (-(8 + len(text)) % 8)
    prefix = struct.pack("<Q", len(text)) + text
    return prefix, len(prefix) + off


def _bytes(t: torch.Tensor) -> memoryview:
    if t.numel() == 0:
        return memoryview(b"")
    u8 = t.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
    return memoryview(u8.numpy())


def chunks(specs: Mapping[str, Streamed], prefix: bytes, *, chunk: int = CHUNK_BYTES) -> Iterator[memoryview]:
    """The file's bytes after ``prefix`` (which comes first) as chunks; ValueError if a tensor's pieces do not match
    its declared dtype / shape (nothing past that point is emitted)."""
    stage = bytearray(chunk)
    fill = 0
    yield memoryview(prefix)
    for name, s in specs.items():
        rows, want = 0, s.nbytes
        got = 0
        for p in s.parts():
            if not isinstance(p, torch.Tensor) or p.dtype != s.dtype or tuple(p.shape[1:]) != tuple(s.shape[1:]):
                raise ValueError(f"{name!r}: a piece of {getattr(p, 'dtype', type(p).__name__)} "
                                 f"{tuple(getattr(p, 'shape', ()))} does not fit {s.dtype} {s.shape}")
            rows += p.shape[0] if p.dim() else 1
            data = _bytes(p)
            got += len(data)
            if fill and fill + len(data) > chunk:
                yield memoryview(stage)[:fill]
                fill = 0
            if len(data) >= chunk:
                yield data
            else:
                stage[fill:fill + len(data)] = data
                fill += len(data)
        if got != want or (s.shape and rows != s.shape[0]):
            raise ValueError(f"{name!r}: its pieces hold {got} bytes, the declared {s.dtype} {s.shape} {want}")
    if fill:
        yield memoryview(stage)[:fill]
