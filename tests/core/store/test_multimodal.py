"""Groups with images: the prompt's multimodal inputs are stored once per group, dtype kept, checkpointed
through the crash-safe path and restored exactly; bad inputs are refused naming the key, buffer unchanged."""

import dataclasses

import numpy as np
import pytest
import torch

from hdreplay import CheckpointError, ReplayBuffer, ReplayConfig, ReplayController, ReplayInputError
from hdreplay.store.blocks import BLOCK_GROUPS
from hdreplay_lab.synthetic import TablePolicy, make_group
from protocol import state_hash

POLICY = TablePolicy(seed=0)

pytestmark = pytest.mark.multimodal


def mm(seed: int, images: int = 1, P: int = 6, *, grid=(1, 4, 4)) -> dict:
    """Qwen2-VL-like inputs of one prompt: per image prod(grid) patches of 1176 floats, its grid, per-token ids,
    and a bf16 and a bool tensor to check dtypes survive."""
    g = torch.Generator().manual_seed(seed)
    patches = images * int(np.prod(grid))
    return {"pixel_values": torch.randn(patches, 1176, generator=g),
            "image_grid_thw": torch.tensor([list(grid)] * images, dtype=torch.int64),
            "mm_token_type_ids": (torch.arange(P) % 3 == 0).long(),
            "pixel_bf16": torch.randn(patches, 4, generator=g).to(torch.bfloat16),
            "pixel_attention_mask": torch.rand(images, 2, 2, generator=g) > 0.5}


def group(gid, step=0, *, n=4, inputs=None, seed=0):
    g = make_group(gid, policy=POLICY, step=step, n=n, seed=seed, prompt_len=6)
    return dataclasses.replace(g, mm_inputs=mm(seed) if inputs is None else inputs)


def same_mm(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]) for k in a)


def fill(buf, k=10, step=0, images=lambda j: 1 + j % 3):
    gs = [group(f"g{step}-{j}", step, inputs=mm(100 * step + j, images(j)), seed=j) for j in range(k)]
    buf.append(gs, ref_headroom=[0.1 * j for j in range(k)], step=step)
    return gs


def test_inputs_are_stored_once_with_their_dtypes_and_handed_out_as_copies():
    buf = ReplayBuffer(8)
    gs = fill(buf, 6) + fill(buf, 5, step=1)  # 11 groups into 8: the front block is compacted
    live = buf.get(buf.insertion_ids().tolist())
    assert [g.group_id for g in live] == [g.group_id for g in gs[3:]]
    for orig, got in zip(gs[3:], live):
        assert same_mm(orig.mm_inputs, got.mm_inputs)
        assert got.mm_inputs["pixel_bf16"].dtype == torch.bfloat16 and got.mm_inputs["pixel_attention_mask"].dtype \
            == torch.bool
    # one copy per group, whatever n is: the bytes are exactly the groups' own inputs plus the (k+1) offsets
    one_copy = sum(g.mm_nbytes for g in gs[3:])
    assert buf.mm_nbytes() == one_copy + 5 * 8 * ((3 + 1) + (5 + 1))  # 5 keys x int64 offsets, blocks of 3 and 5
    live[0].mm_inputs["pixel_values"].zero_()  # a caller editing its copy changes nothing stored
    assert same_mm(buf.get([buf.insertion_ids()[0]])[0].mm_inputs, gs[3].mm_inputs)


def test_checkpoint_round_trip_is_exact(tmp_path):
    buf = ReplayBuffer(200)
    gs = [g for s in range(3) for g in fill(buf, BLOCK_GROUPS + 7, step=s)][-200:]  # several blocks, evictions
    buf.save(tmp_path / "b")
    again = ReplayBuffer.load(tmp_path / "b")
    assert again.mm_schema == buf.mm_schema and again.mm_nbytes() <= buf.mm_nbytes()
    for orig, got in zip(gs, again.get(again.insertion_ids().tolist())):
        assert orig.group_id == got.group_id and same_mm(orig.mm_inputs, got.mm_inputs)
    # the reloaded buffer keeps refusing foreign inputs
    with pytest.raises(ReplayInputError, match="pixel_values"):
        again.append([group("x", 3, inputs={**mm(1), "pixel_values": torch.zeros(16, 588)})], ref_headroom=[0.0],
                     step=3)


def test_controller_checkpoint_and_scorer_see_the_images(tmp_path):
    cfg = ReplayConfig(k_rep=2, tau=10.0, capacity=6)
    ctrl = ReplayController(cfg)
    seen = []

    def scorer(groups):
        seen.extend((g.group_id, g.mm_inputs) for g in groups)
        return POLICY.scorer(groups)

    stored = {}
    for t in range(4):
        ctrl.select(step=t, scorer=scorer)
        gs = [group(f"s{t}g{k}", t, inputs=mm(10 * t + k, 1 + k % 2), seed=k) for k in range(3)]
        stored.update({g.group_id: g.mm_inputs for g in gs})
        ctrl.stage(gs, step=t)
        ctrl.commit()
    assert seen and all(same_mm(m, stored[gid]) for gid, m in seen)  # re-scoring gets each group's own images
    ctrl.save(tmp_path / "c")
    again = ReplayController(cfg)
    again.load(tmp_path / "c")
    assert state_hash(again) == state_hash(ctrl)


def test_bad_inputs_name_the_key_and_change_nothing():
    buf = ReplayBuffer(10)
    fill(buf, 3)
    before = buf.state_dict()
    base = mm(0)
    bad_groups = {
        "keys": {k: v for k, v in base.items() if k != "image_grid_thw"},
        "dtype": {**base, "pixel_values": base["pixel_values"].half()},
        "trailing shape": {**base, "pixel_values": torch.zeros(16, 588)},
        "text group": {},
    }
    for what, inputs in bad_groups.items():
        with pytest.raises(ReplayInputError, match="multimodal inputs differ") as e:
            buf.append([group("ok", inputs=mm(5)), group("bad", inputs=inputs)], ref_headroom=[0, 0], step=1)
        assert "bad" in str(e.value), what
        t, m = buf.state_dict()
        assert m == before[1] and all(torch.equal(t[k], before[0][k]) for k in t), what  # all or nothing
    # an image group cannot join a text buffer either
    text = ReplayBuffer(4)
    text.append([make_group("t", policy=POLICY, step=0)], ref_headroom=[0.0], step=0)
    with pytest.raises(ReplayInputError, match=r"keys \[.*pixel_values.*\] but the buffer holds \[\]"):
        text.append([group("img")], ref_headroom=[0.0], step=1)


@pytest.mark.parametrize("inputs, match", [
    ({"pixel_values": [[0.0] * 4]}, "must be a torch.Tensor"),
    ({"pixel_values": torch.tensor(1.0)}, "0-d"),
    ({"pixel_values": torch.ones(2, 3, dtype=torch.complex64)}, "dtype torch.complex64"),
    ({"pixel_values": torch.tensor([[1.0, float("nan")]])}, "non-finite"),
    ({3: torch.ones(2)}, "keys must be non-empty str"),
    ({"": torch.ones(2)}, "keys must be non-empty str"),
    ("pixels", "must be a mapping"),
])
def test_record_refuses_malformed_inputs(inputs, match):
    with pytest.raises(ReplayInputError, match=match):
        group("g", inputs=inputs)


def _corrupt(state, edit):
    tensors, meta = state
    tensors, meta = dict(tensors), {**meta}
    edit(tensors, meta)
    return tensors, meta


@pytest.mark.parametrize("edit, match", [
    (lambda t, m: t.pop("mm_off.pixel_values"), "missing tensor"),
    (lambda t, m: t.update({"mm.pixel_values": t["mm.pixel_values"].double()}), "expected torch.float32"),
    (lambda t, m: t.update({"mm.image_grid_thw": t["mm.image_grid_thw"][:, :2]}), "expected torch.int64"),
    (lambda t, m: t.update({"mm_off.pixel_values": t["mm_off.pixel_values"] + 1}), "do not describe"),
    (lambda t, m: t.update({"mm_off.image_grid_thw": t["mm_off.image_grid_thw"].flip(0)}), "do not describe"),
    (lambda t, m: t["mm.pixel_values"].__setitem__((0, 0), float("inf")), "non-finite"),
    (lambda t, m: m.pop("mm_schema"), "unexpected tensors"),
    (lambda t, m: m.update({"mm_schema": {"pixel_values": {"dtype": "complex64", "shape": [1176]}}}), "mm_schema"),
    (lambda t, m: t.update({"mm.extra_key": torch.ones(3)}), "unexpected tensors"),
])
def test_a_corrupted_checkpoint_is_refused_and_changes_nothing(edit, match):
    src = ReplayBuffer(10)
    fill(src, 4)
    state = src.state_dict()
    state = (state[0], state[1])
    dst = ReplayBuffer(10)
    fill(dst, 2, step=7)
    before = dst.state_dict()
    t, m = _corrupt((dict(state[0]), dict(state[1])), edit)
    with pytest.raises(CheckpointError, match=match):
        dst.load_state_dict({k: v.clone() for k, v in t.items()}, m)
    after = dst.state_dict()
    assert after[1] == before[1] and all(torch.equal(after[0][k], before[0][k]) for k in after[0])
