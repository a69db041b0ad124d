"""A group's multimodal prompt inputs: stored once per group, ragged on the leading axis, dtype kept.

A vision-language group's n responses share one prompt, and so one set of processor outputs
(``pixel_values``, ``image_grid_thw``, ``pixel_attention_mask``, ``image_sizes``, per-token fields such as
``mm_token_type_ids`` ...).  :attr:`GroupRecord.mm_inputs <hdreplay.store.record.GroupRecord.mm_inputs>` holds them
as ``name -> tensor`` for ONE sample; frameworks hold n copies per group (one per response row), the buffer
holds one.

Shapes: every tensor has a free leading axis (patches, images, tiles or prompt tokens: per-token fields are
stored token axis first, e.g. verl's ``(4, P)`` mrope position ids as ``(P, 4)``) and trailing axes that
every group of a buffer shares.  The *schema* of a group, ``name -> (dtype, trailing shape)``, must be the
same for every group of a buffer (one processor, one setting); a group that differs is refused before the
buffer changes.  Allowed dtypes: bool, uint8, int8/16/32/64, float16, bfloat16, float32, float64;
floating values must be finite.

Storage (:class:`Ragged`): per name one flat tensor over the groups of a block, with ``(k+1,)`` int64
offsets into its leading axis; checkpoint tensors ``mm.<name>`` (dtype kept) and ``mm_off.<name>``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

import numpy as np
import torch

from ..checkpoint.tensorfile import FileTensor, rows
from ..errors import ReplayInputError

DTYPES = (torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.float16,
          torch.bfloat16, torch.float32, torch.float64)
_BY_NAME = {str(d).removeprefix("torch."): d for d in DTYPES}
#: name -> (dtype, trailing shape)
Schema = dict[str, tuple[torch.dtype, tuple[int, ...]]]


def check_mm_inputs(mm: Any, gid) -> dict[str, torch.Tensor]:
    """Validated CPU, contiguous, detached copies-or-views of ``mm`` (dtype kept); raises ReplayInputError."""
    if not isinstance(mm, Mapping):
        raise ReplayInputError(f"group {gid!r}: `mm_inputs` must be a mapping name -> tensor, got {type(mm).__name__}")
    out = {}
    for key, val in mm.items():
        where = f"group {gid!r}: `mm_inputs[{key!r}]`"
        if not isinstance(key, str) or not key:
            raise ReplayInputError(f"group {gid!r}: `mm_inputs` keys must be non-empty str, got {key!r}")
        if not isinstance(val, torch.Tensor):
            raise ReplayInputError(f"{where} must be a torch.Tensor (the processor's output), got "
                                   f"{type(val).__name__}")
        if val.dtype not in DTYPES:
            raise ReplayInputError(f"{where} has dtype {val.dtype}; allowed: {sorted(_BY_NAME)}")
        if val.dim() < 1:
            raise ReplayInputError(f"{where} is 0-d; give it a leading axis (e.g. shape (1,))")
        t = val.detach().to("cpu").contiguous()
        if t.is_floating_point() and t.numel() and not bool(torch.isfinite(t).all()):
            raise ReplayInputError(f"{where} has non-finite values; the image inputs must be finite")
        out[key] = t
    return out


def schema_of(mm: Mapping[str, torch.Tensor]) -> Schema:
    return {k: (v.dtype, tuple(v.shape[1:])) for k, v in sorted(mm.items())}


def schema_difference(have: Schema, want: Schema) -> str | None:
    """What differs between a group's schema ``have`` and the buffer's ``want`` (None if nothing)."""
    if set(have) != set(want):
        return f"keys {sorted(have)} but the buffer holds {sorted(want)}"
    for k in sorted(want):
        if have[k] != want[k]:
            show = lambda s: f"{str(s[0]).removeprefix('torch.')} (*, {', '.join(map(str, s[1]))})"  # noqa: E731
            return f"`{k}` is {show(have[k])} but the buffer holds {show(want[k])}"
    return None


def schema_to_json(schema: Schema | None) -> dict | None:
    if schema is None:
        return None
    return {k: {"dtype": str(d).removeprefix("torch."), "shape": list(s)} for k, (d, s) in schema.items()}


def schema_from_json(obj: Any, bad: Callable[[str], Exception]) -> Schema | None:
    """Parse ``mm_schema`` of a checkpoint's meta (None: no multimodal inputs)."""
    if obj is None:
        return None
    if not isinstance(obj, Mapping):
        raise bad(f"mm_schema must be a mapping or null, got {type(obj).__name__}")
    out = {}
    for k, v in obj.items():
        ok = (isinstance(k, str) and k and isinstance(v, Mapping) and v.get("dtype") in _BY_NAME
              and isinstance(v.get("shape"), list) and all(isinstance(x, int) and not isinstance(x, bool) and x >= 0
                                                           for x in v["shape"]))
        if not ok:
            raise bad(f"mm_schema entry {k!r} is not {{'dtype': one of {sorted(_BY_NAME)}, 'shape': [ints]}}")
        out[k] = (_BY_NAME[v["dtype"]], tuple(v["shape"]))
    return dict(sorted(out.items()))


def _offsets(sizes: Sequence[int]) -> np.ndarray:
    return np.concatenate([[0], np.cumsum(list(sizes), dtype=np.int64)]).astype(np.int64)


@dataclass
class Ragged:
    """``name -> (sum_j leading_j, *trailing)`` data of k groups with ``(k+1,)`` offsets per name."""

    data: dict[str, torch.Tensor]
    off: dict[str, np.ndarray]

    @classmethod
    def build(cls, mms: Sequence[Mapping[str, torch.Tensor]]) -> "Ragged":
        """Copy the groups' (validated, same-schema) inputs into one flat tensor per name."""
        keys = sorted(mms[0]) if mms else []
        return cls({k: torch.cat([m[k] for m in mms]) for k in keys},
                   {k: _offsets([m[k].shape[0] for m in mms]) for k in keys})

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() + self.off[k].nbytes for k, t in self.data.items())

    def view(self, j: int) -> dict[str, torch.Tensor]:
        """Group j's inputs as views (internal use)."""
        return {k: t[int(self.off[k][j]):int(self.off[k][j + 1])] for k, t in self.data.items()}

    def gather(self, js: Sequence[int]) -> list[dict[str, torch.Tensor]]:
        """Copies of groups ``js`` (one new tensor per name; each dict views its slice of it)."""
        out: list[dict[str, torch.Tensor]] = [{} for _ in js]
        for k, t in self.data.items():
            o = self.off[k]
            parts = torch.cat([t[int(o[j]):int(o[j + 1])] for j in js]).split([int(o[j + 1] - o[j]) for j in js])
            for d, p in zip(out, parts):
                d[k] = p
        return out

    def slice(self, start: int, stop: int) -> "Ragged":
        """Groups ``start..stop-1`` as a Ragged owning copies."""
        return Ragged({k: rows(t, int(self.off[k][start]), int(self.off[k][stop])) for k, t in self.data.items()},
                      {k: o[start:stop + 1] - o[start] for k, o in self.off.items()})

    def to_tensors(self) -> dict[str, torch.Tensor]:
        out = {f"mm.{k}": t for k, t in self.data.items()}
        out.update({f"mm_off.{k}": torch.from_numpy(o) for k, o in self.off.items()})
        return out

    @classmethod
    def from_tensors(cls, tensors: Mapping[str, torch.Tensor], schema: Schema | None, k: int,
                     bad: Callable[[str], Exception]) -> "Ragged":
        """Validate the shapes of checkpoint tensors ``mm.*`` / ``mm_off.*`` of k groups against ``schema`` (the values
        are checked block by block, :meth:`Block.from_tensors <hdreplay.store.blocks.Block.from_tensors>`)."""
        data, off = {}, {}
        for name, (dtype, trailing) in (schema or {}).items():
            t, o = tensors.get(f"mm.{name}"), tensors.get(f"mm_off.{name}")
            if not isinstance(t, (torch.Tensor, FileTensor)) or not isinstance(o, torch.Tensor):
                raise bad(f"missing tensor 'mm.{name}' or 'mm_off.{name}'")
            if t.dtype != dtype or t.dim() < 1 or tuple(t.shape[1:]) != trailing:
                raise bad(f"tensor 'mm.{name}' is {t.dtype} of shape {tuple(t.shape)}, expected {dtype} of shape "
                          f"(*, {', '.join(map(str, trailing))}) as mm_schema says")
            if o.dtype != torch.int64 or o.dim() != 1:
                raise bad(f"offsets 'mm_off.{name}' must be a 1-D int64 tensor")
            a = o.numpy()
            if a.size != k + 1 or a[0] != 0 or a[-1] != t.shape[0] or (np.diff(a) < 0).any():
                raise bad(f"offsets 'mm_off.{name}' do not describe {k} groups of 'mm.{name}'")
            data[name], off[name] = t, a.copy()
        return cls(data, off)
