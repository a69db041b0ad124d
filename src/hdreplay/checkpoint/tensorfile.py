"""A safetensors file written and read piece by piece, so that a checkpoint never needs a second copy of the state.

``safetensors.torch.save`` takes whole tensors and returns the whole file as one ``bytes``: saving a buffer with it
means concatenating every block into checkpoint tensors (one copy of the state) and then serialising them (a second
copy).  The format is simple enough to stream instead (https://github.com/huggingface/safetensors, "Format"):

    8 bytes      N, little-endian u64
    N bytes      JSON header {name: {"dtype", "shape", "data_offsets": [begin, end]}}, padded with spaces to 8 bytes
    rest         the tensors' bytes, back to back, offsets relative to the end of the header

A :class:`Streamed` tensor declares its dtype and shape up front and yields its data as pieces (views of the
buffer's blocks) whose concatenation along the first axis is the tensor; :func:`chunks` emits the file as byte
chunks of about :data:`CHUNK_BYTES`, copying only small pieces into a reusable staging buffer.  Reading is lazy the
same way: :func:`index` checks a file's header (dtypes, shapes, offsets that tile the data) and returns
:class:`FileTensor` handles whose rows are read on demand, so a load builds the buffer's blocks one at a time instead
of the whole file in memory.  Hand-written because safetensors offers neither an incremental writer nor a ranged
reader of a file it has not memory-mapped.
"""

from __future__ import annotations

import json
import math
import struct
import sys
from dataclasses import dataclass
from typing import BinaryIO, Callable, Iterable, Iterator, Mapping

import torch

#: torch dtype -> safetensors dtype name
DTYPES = {torch.bool: "BOOL", torch.uint8: "U8", torch.int8: "I8", torch.int16: "I16", torch.int32: "I32",
          torch.int64: "I64", torch.float16: "F16", torch.bfloat16: "BF16", torch.float32: "F32", torch.float64: "F64"}
#: target size of one emitted chunk (pieces smaller than this are staged together)
CHUNK_BYTES = 1 << 20
#: a header longer than this is refused (safetensors' own limit)
MAX_HEADER_BYTES = 100_000_000


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


@dataclass(frozen=True)
class FileTensor:
    """A tensor of ``dtype`` and ``shape`` stored at byte ``begin`` of the open file ``file``; ``t[a:b]`` (rows
    ``a..b-1`` of the first axis) and ``t.read()`` return new tensors read from the file (OSError if it ends early)."""

    file: BinaryIO
    dtype: torch.dtype
    shape: tuple[int, ...]
    begin: int

    def dim(self) -> int:
        return len(self.shape)

    def numel(self) -> int:
        return math.prod(self.shape)

    def element_size(self) -> int:
        return torch.empty(0, dtype=self.dtype).element_size()

    def read(self, row0: int = 0, shape: tuple[int, ...] | None = None) -> torch.Tensor:
        out = torch.empty(self.shape if shape is None else shape, dtype=self.dtype)
        view = memoryview(out.reshape(-1).view(torch.uint8).numpy())
        self.file.seek(self.begin + row0 * math.prod(self.shape[1:]) * self.element_size())
        done = 0
        while done < len(view):
            n = self.file.readinto(view[done:])
            if not n:
                raise OSError(f"{self.file.name}: ends inside a tensor's data; the file was modified while loading")
            done += n
        return out

    def __getitem__(self, rows: slice) -> torch.Tensor:
        a, b, _ = rows.indices(self.shape[0])
        return self.read(a, (max(b - a, 0), *self.shape[1:]))


def rows(t: "torch.Tensor | FileTensor", a: int, b: int) -> torch.Tensor:
    """Rows ``a..b-1`` of ``t`` as a new tensor that owns its memory."""
    return t[a:b] if isinstance(t, FileTensor) else t[a:b].clone()


def index(file: BinaryIO, size: int) -> dict[str, FileTensor]:
    """The tensors of the safetensors file ``file`` (``size`` bytes) as :class:`FileTensor`; ValueError saying what is
    wrong if the header does not describe the file (length, JSON, dtypes, shapes, offsets tiling the data)."""
    file.seek(0)
    n = struct.unpack("<Q", file.read(8).ljust(8, b"\xff"))[0]
    if n > min(size - 8, MAX_HEADER_BYTES):
        raise ValueError(f"header length {n} does not fit a file of {size} bytes")
    try:
        entries = json.loads(file.read(n))
    except (ValueError, UnicodeDecodeError, RecursionError) as e:
        raise ValueError(f"unreadable header ({type(e).__name__})") from None
    if not isinstance(entries, dict):
        raise ValueError("the header is not a JSON object")
    by_name, out = {v: k for k, v in DTYPES.items()}, {}
    for name, e in entries.items():
        shape, offs = (e.get("shape"), e.get("data_offsets")) if isinstance(e, dict) else (None, None)
        if name == "__metadata__":
            continue
        if not (e.get("dtype") in by_name and isinstance(shape, list) and isinstance(offs, list) and len(offs) == 2
                and all(type(x) is int and x >= 0 for x in shape + offs)
                and offs[1] - offs[0] == math.prod(shape) * torch.empty(0, dtype=by_name[e["dtype"]]).element_size()):
            raise ValueError(f"{name!r}: malformed header entry (dtype, shape and data offsets must agree)")
        out[name] = FileTensor(file, by_name[e["dtype"]], tuple(shape), 8 + n + offs[0])
    spans = sorted((t.begin, t.begin + t.numel() * t.element_size()) for t in out.values())
    if [a for a, _ in spans] + [size] != [8 + n] + [b for _, b in spans]:
        raise ValueError("the tensors' data offsets do not tile the file")
    return out
