"""Vision-language rows of a verl batch <-> a group's stored multimodal inputs.

verl 0.9.1's agent loop gives every row of a vision-language rollout (shape glossary of :mod:`hdreplay.store.record`):

    non_tensor_batch["multi_modal_inputs"][i]   dict of the processor's outputs for the row's prompt
                                                (``pixel_values (patches, C)``, ``image_grid_thw (I, 3)``,
                                                ``images_seqlens (I,)``, ...); the n rows of a uid hold copies
    position_ids[i]                             (K, P+R) for multimodal rotary models (Qwen2/2.5/3-VL: K = 4,
                                                row 0 the text positions, rows 1-3 the mrope positions from the
                                                model's ``get_rope_index``); (P+R,) for 1-D rotary VLMs

A group stores the dict ONCE (:attr:`GroupRecord.mm_inputs`, dtype kept) plus, for K-row positions, the prompt's
positions ``(P, K)`` under :data:`POSITIONS`.  Responses are text: their positions continue the prompt's, row by
row, from ``max(prompt positions) + 1`` (what ``get_rope_index`` does for text after the last image, and what
row 0's ``arange`` does).  Ingress checks that rule on every row and skips a group that breaks it (an image or
video inside a response, multi-turn images: not supported); replay rebuilds the positions from it.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np
import torch

from ...store.record import GroupRecord

#: key of the prompt's ``(P, K)`` multi-row position ids in ``GroupRecord.mm_inputs`` (hdreplay's own entry)
POSITIONS = "hdr.prompt_position_ids"


def is_multirow(position_ids: torch.Tensor | None) -> bool:
    """True for ``(B, K, L)`` position ids (multimodal rotary), False for ``(B, L)``."""
    return position_ids is not None and position_ids.dim() == 3


def processor_inputs(group: GroupRecord) -> dict[str, torch.Tensor]:
    """The group's ``multi_modal_inputs`` dict as verl's rows carry it (hdreplay's own entries left out)."""
    return {k: v for k, v in group.mm_inputs.items() if not k.startswith("hdr.")}


def continuation(prompt_positions: torch.Tensor, length: int) -> torch.Tensor:
    """``(K, length)`` positions of ``length`` text tokens after a prompt with ``(K, P)`` positions."""
    start = prompt_positions.max(dim=1).values + 1
    return start[:, None] + torch.arange(length, dtype=prompt_positions.dtype)[None]


def capture(rows: Sequence[int], mm_rows: Any, position_ids: torch.Tensor | None, attention: torch.Tensor,
            P: int) -> tuple[dict[str, torch.Tensor], str | None]:
    """The mm_inputs of the group made of batch ``rows`` (v0 padded batch), or ({}, why) when it cannot be stored.

    Args:
        rows: the group's row indices; mm_rows: ``non_tensor_batch["multi_modal_inputs"]`` (or None);
        position_ids: ``(B, K, P+R)`` or ``(B, P+R)`` (or None); attention: ``(B, P+R)`` bool; P: prompt width.
    """
    out, why = group_dict(rows, mm_rows)
    if why is None and is_multirow(position_ids):
        pm = attention[rows[0], :P]
        prompt = position_ids[rows[0]][:, :P][:, pm]
        seqs = {r: (position_ids[r][:, :P][:, attention[r, :P]], position_ids[r][:, P:][:, attention[r, P:]])
                for r in rows}
        why = check_positions(prompt, seqs)
        out[POSITIONS] = prompt.T.contiguous()
    return (out, None) if why is None else ({}, why)


def capture_rows(rows: Sequence[int], mm_rows: Any, positions: Sequence[torch.Tensor], prompt_lens: Sequence[int]
                 ) -> tuple[dict[str, torch.Tensor], str | None]:
    """The same for unpadded rows (verl's v1 TransferQueue rows): ``positions[r]`` is row r's ``(K, P_r+L_r)`` or
    ``(P_r+L_r,)``, ``prompt_lens[r]`` its prompt length P_r."""
    out, why = group_dict(rows, mm_rows)
    first = positions[rows[0]]
    if why is None and first.dim() == 2:
        prompt = first[:, :prompt_lens[rows[0]]]
        why = check_positions(prompt, {r: (positions[r][:, :prompt_lens[r]], positions[r][:, prompt_lens[r]:])
                                       for r in rows})
        out[POSITIONS] = prompt.T.contiguous()
    return (out, None) if why is None else ({}, why)


def group_dict(rows: Sequence[int], mm_rows: Any) -> tuple[dict[str, torch.Tensor], str | None]:
    """The one ``multi_modal_inputs`` dict the rows of a group share (``{}`` for text), or ({}, why)."""
    first = mm_rows[rows[0]] if mm_rows is not None else {}
    first = first or {}
    if not isinstance(first, dict):
        return {}, f"multi_modal_inputs of row {rows[0]} is a {type(first).__name__}, not a dict"
    for r in rows[1:]:
        other = (mm_rows[r] or {}) if mm_rows is not None else {}
        if set(other) != set(first) or not all(_same(other[k], first[k]) for k in first):
            return {}, (f"rows {list(rows)} share a uid but not their multi_modal_inputs (keys {sorted(first)} vs "
                        f"{sorted(other)} or different values: random image augmentation?); the group's responses "
                        "must be conditioned on one prompt")
    bad = sorted(k for k, v in first.items() if not isinstance(v, torch.Tensor))
    if bad:
        return {}, f"multi_modal_inputs entries {bad} are not tensors; hdreplay stores tensors only"
    return dict(first), None


def check_positions(prompt: torch.Tensor, seqs: dict[int, tuple[torch.Tensor, torch.Tensor]]) -> str | None:
    """Why rows with ``(K, P)`` prompt positions ``prompt`` and per-row (prompt, response) positions ``seqs``
    cannot be replayed with rebuilt positions, or None: every prompt must equal ``prompt`` and every response
    continue it (:func:`continuation`)."""
    for r, (p, resp) in seqs.items():
        if not torch.equal(p, prompt) or not torch.equal(resp, continuation(prompt, resp.shape[1]).to(resp.dtype)):
            return (f"row {r}: the response's position ids do not continue the prompt's (an image or video "
                    "inside the response, or multi-turn images); hdreplay replays responses of text only")
    return None


def sequence_positions(group: GroupRecord, length: int) -> torch.Tensor:
    """``(K, P_g + length)`` unpadded positions of one of the group's rows (verl v1 rows)."""
    prompt = group.mm_inputs[POSITIONS].T
    return torch.cat([prompt, continuation(prompt, length)], dim=1)


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    return a is b or (not isinstance(a, torch.Tensor) and not isinstance(b, torch.Tensor) and a == b)


def row_positions(group: GroupRecord, *, P: int, R: int, like: torch.Tensor) -> torch.Tensor:
    """``(n, K, P+R)`` position ids of the group's rows: prompt left-padded to P, responses right-padded to R.

    Pad positions hold verl's agent-loop values (1 in the text row, 0 in the rope rows); verl's no-padding layout
    and attention masking never read them."""
    prompt = group.mm_inputs[POSITIONS].T.to(like.dtype)  # (K, P_g)
    K, Pg = prompt.shape
    out = torch.zeros(group.num_responses, K, P + R, dtype=like.dtype)
    out[:, 0] = 1
    out[:, :, P - Pg:P] = prompt
    for i, L in enumerate(group.response_lengths.tolist()):
        out[i, :, P:P + L] = continuation(prompt, L)
    return out


def rows_object(groups: Sequence[GroupRecord], row_group: Sequence[int]) -> np.ndarray:
    """verl's per-row ``multi_modal_inputs`` for rows of ``groups`` (``row_group[i]``: the group of row i); the rows
    of one group share one dict, as they share the prompt."""
    dicts = [processor_inputs(g) for g in groups]
    return np.array([dicts[int(g)] for g in row_group], dtype=object)


def images_seqlens(mm_rows: Any) -> list[int]:
    """``meta_info["images_seqlens"]`` as ``RayPPOTrainer.fit`` computes it (the flops counter reads it)."""
    out: list[int] = []
    for d in mm_rows:
        if d and "image_grid_thw" in d and "images_seqlens" in d:
            out.extend(d["images_seqlens"].tolist())
    return out
