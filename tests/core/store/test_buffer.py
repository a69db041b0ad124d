import json
import zlib

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from hdreplay import CheckpointError, ReplayBuffer, ReplayConfigError, ReplayInputError
from hdreplay_lab.synthetic import TablePolicy, make_group

POL = TablePolicy()


def groups(prefix, k, step=0, **kw):
    return [make_group(f"{prefix}{i}", policy=POL, step=step, seed=zlib.crc32(f"{prefix}{i}".encode()) % 10_000, **kw)
            for i in range(k)]


def assert_same_record(a, b):
    assert a.group_id == b.group_id and a.birth_step == b.birth_step
    for f in ("prompt_ids", "completion_ids", "response_lengths", "loss_mask", "logprobs", "advantages", "rewards"):
        assert torch.equal(getattr(a, f), getattr(b, f)), f
    assert a.extras.keys() == b.extras.keys()
    for k in a.extras:
        assert torch.equal(a.extras[k], b.extras[k])
    assert a.mm_inputs.keys() == b.mm_inputs.keys()
    for k in a.mm_inputs:
        assert a.mm_inputs[k].dtype == b.mm_inputs[k].dtype and torch.equal(a.mm_inputs[k], b.mm_inputs[k])


def test_fifo_eviction_and_capacity():
    buf = ReplayBuffer(5)
    gs = groups("a", 3) + groups("b", 4)
    ev1 = buf.append(gs[:3], ref_headroom=[0.1] * 3, step=0)
    ev2 = buf.append(gs[3:], ref_headroom=[0.2] * 4, step=1)
    assert ev1 == [] and [e["group_id"] for e in ev2] == ["a0", "a1"]
    assert len(buf) == 5
    assert [g.group_id for g in buf.get(buf.insertion_ids().tolist())] == ["a2", "b0", "b1", "b2", "b3"]
    for orig, got in zip(gs[2:], buf.get(buf.insertion_ids().tolist())):
        assert_same_record(orig, got)
    # more than capacity in one call: only the newest C survive
    buf.append(groups("c", 7), ref_headroom=[0.0] * 7, step=2)
    assert [g.group_id for g in buf.get(buf.insertion_ids().tolist())] == ["c2", "c3", "c4", "c5", "c6"]


def test_storage_is_compact_and_tracks_live_groups():
    buf = ReplayBuffer(4)
    gs = groups("a", 6, max_len=30)
    buf.append(gs[:3], ref_headroom=[0.0] * 3, step=0)
    buf.append(gs[3:], ref_headroom=[0.0] * 3, step=1)  # evicts 2, compacts the first block
    live = gs[2:]
    payload = sum(4 * g.num_tokens + 4 * g.num_tokens + 4 * g.prompt_ids.numel() + 16 * g.num_responses
                  for g in live)  # ids, logprobs, prompt, (int64 len, adv, reward) per response; masks all ones
    slot_and_offsets = buf.nbytes() - payload
    assert buf.stored_response_tokens() == sum(g.num_tokens for g in live)
    assert 0 < slot_and_offsets <= 10 * 8 * 4 + 3 * 8 * (4 + 2) + 8  # slot arrays (10 fields) + offsets only


def test_tool_mask_stored_only_when_needed():
    buf = ReplayBuffer(8)
    plain, tool = groups("p", 2), groups("t", 2, tool_every=3)
    buf.append(plain, ref_headroom=[0, 0], step=0)
    buf.append(tool, ref_headroom=[0, 0], step=1)
    assert buf._blocks[0].loss_mask is None and buf._blocks[1].loss_mask is not None
    for orig, got in zip(plain + tool, buf.get(buf.insertion_ids().tolist())):
        assert_same_record(orig, got)


def test_ties_go_to_older_groups_and_order_is_descending():
    buf = ReplayBuffer(10)
    buf.append(groups("a", 6), ref_headroom=[0.5, 0.9, 0.5, 0.1, 0.9, 0.5], step=0)
    ids = buf.order_by_cached_headroom(6)
    assert [buf.group_id(int(i)) for i in ids] == ["a1", "a4", "a0", "a2", "a5", "a3"]
    assert [buf.group_id(int(i)) for i in buf.order_by_cached_headroom(3)] == ["a1", "a4", "a0"]
    assert [buf.group_id(int(i)) for i in buf.order_by_recency(2)] == ["a5", "a4"]


@given(vals=st.lists(st.sampled_from([0.0, 0.25, 0.5, 0.75, 1.0]), min_size=1, max_size=40),
       cap=st.integers(1, 30), m=st.integers(1, 45))
def test_partial_order_equals_full_sort(vals, cap, m):
    buf = ReplayBuffer(cap)
    recs = [make_group(i, policy=POL, step=0, seed=i, n=2, max_len=2) for i in range(len(vals))]
    buf.append(recs, ref_headroom=vals, step=0)
    ids = buf.insertion_ids()
    key = buf.slot_values("cached_headroom", ids)
    full = ids[np.lexsort((ids, -key))]
    assert buf.order_by_cached_headroom(m).tolist() == full[:m].tolist()


def test_rejected_append_leaves_buffer_unchanged():
    buf = ReplayBuffer(6, group_size=4)
    buf.append(groups("a", 3), ref_headroom=[0.1, 0.2, 0.3], step=0)
    before = buf.state_dict()
    with pytest.raises(ReplayInputError, match="duplicate group_id 'a1'"):
        buf.append(groups("b", 2) + groups("a", 2)[1:], ref_headroom=[0, 0, 0], step=1)
    with pytest.raises(ReplayInputError, match="group_size=4"):
        buf.append(groups("c", 1, n=3), ref_headroom=[0], step=1)
    with pytest.raises(ReplayInputError, match="extras"):
        buf.append(groups("d", 1, extras=True), ref_headroom=[0], step=1)
    with pytest.raises(ReplayInputError, match="ref_headroom"):
        buf.append(groups("e", 2), ref_headroom=[0], step=1)
    after = buf.state_dict()
    assert before[1] == after[1]
    assert all(torch.equal(before[0][k], after[0][k]) for k in before[0])


@pytest.mark.parametrize("cap", [0, -1, 2.5, True, "8", 10**11, 1e11, None])
def test_bad_capacity(cap):
    with pytest.raises(ReplayConfigError, match=r"capacity: must be an int in \[1, 16777216\]") as e:
        ReplayBuffer(cap)
    assert e.value.field == "capacity"


def test_a_large_capacity_costs_nothing_until_used():
    big, small = ReplayBuffer(1 << 24), ReplayBuffer(64)
    assert big.nbytes() == small.nbytes() < 10 * 8 * 64 + 1  # slot arrays grow with the groups held
    big.append(groups("a", 70), ref_headroom=[0.5] * 70, step=0)
    assert len(big) == 70 and [g.group_id for g in big.get([0, 69])] == ["a0", "a69"]


def test_state_roundtrip_exact(tmp_path):
    buf = ReplayBuffer(5, group_size=4)
    buf.append(groups("a", 4, tool_every=4, extras=False), ref_headroom=[0.1, 0.2, 0.3, 0.4], step=0)
    buf.append(groups("b", 3, tool_every=4), ref_headroom=[0.5, 0.6, 0.7], step=1)
    buf.refresh(buf.insertion_ids()[:2], [0.9, 0.8], step=2)
    buf.record_use(buf.insertion_ids()[1:3], weight=0.25)
    buf.save(tmp_path / "ck")
    back = ReplayBuffer.load(tmp_path / "ck")
    assert back.insertion_ids().tolist() == buf.insertion_ids().tolist()
    for f in ReplayBuffer._SLOT_FIELDS:
        assert np.array_equal(back.slot_values(f, back.insertion_ids()), buf.slot_values(f, buf.insertion_ids()))
    for a, b in zip(buf.get(buf.insertion_ids().tolist()), back.get(back.insertion_ids().tolist())):
        assert_same_record(a, b)
    # both continue identically
    for b in (buf, back):
        b.append(groups("c", 2, step=3), ref_headroom=[0.95, 0.05], step=3)
    assert buf.order_by_cached_headroom(5).tolist() == back.order_by_cached_headroom(5).tolist()
    with pytest.raises(ReplayInputError, match="duplicate"):
        back.append(groups("c", 1), ref_headroom=[0], step=4)  # group-id index restored too


def test_truncated_and_foreign_checkpoints_are_rejected(tmp_path):
    buf = ReplayBuffer(3)
    buf.append(groups("a", 2), ref_headroom=[0.1, 0.2], step=0)
    buf.save(tmp_path / "ck")
    manifest = json.loads((tmp_path / "ck" / "manifest.json").read_text())
    t = tmp_path / "ck" / manifest["dir"] / "tensors.safetensors"
    data = t.read_bytes()
    t.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="checksum mismatch"):
        ReplayBuffer.load(tmp_path / "ck")
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match="holds no complete hdreplay checkpoint"):
        ReplayBuffer.load(tmp_path / "empty")
    buf.save(tmp_path / "ck2")
    m = tmp_path / "ck2" / "manifest.json"
    m.write_text(m.read_text()[:20])
    with pytest.raises(CheckpointError, match="unreadable JSON"):
        ReplayBuffer.load(tmp_path / "ck2")
    with pytest.raises(CheckpointError, match="not a directory"):
        ReplayBuffer.load(tmp_path / "nope")


def test_load_state_into_wrong_capacity_fails_without_change():
    buf = ReplayBuffer(3)
    buf.append(groups("a", 2), ref_headroom=[0.1, 0.2], step=0)
    other = ReplayBuffer(4)
    other.append(groups("z", 1), ref_headroom=[0.3], step=0)
    with pytest.raises(CheckpointError, match="capacity 3"):
        other.load_state_dict(*buf.state_dict())
    assert [g.group_id for g in other.get(other.insertion_ids().tolist())] == ["z0"]


def test_save_replaces_existing_checkpoint_atomically(tmp_path):
    buf = ReplayBuffer(3)
    buf.append(groups("a", 1), ref_headroom=[0.1], step=0)
    buf.save(tmp_path / "ck")
    buf.append(groups("b", 1), ref_headroom=[0.2], step=1)
    buf.save(tmp_path / "ck")
    assert len(ReplayBuffer.load(tmp_path / "ck")) == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck"]  # no temp or old dirs left
    inside = sorted(p.name for p in (tmp_path / "ck").iterdir())
    assert len(inside) == 2 and inside[0] == "manifest.json" and inside[1].startswith("v-")


def test_refused_calls_change_nothing_not_even_partly():
    from protocol import buffer_hash

    buf = ReplayBuffer(4)
    buf.append(groups("a", 4), ref_headroom=[0.1, 0.2, 0.3, 0.4], step=0)
    before = buffer_hash(buf)
    ids = buf.insertion_ids()
    refusals = [
        lambda: buf.append(groups("b", 2), ref_headroom=[0.5, 0.5], step=-1),  # used to evict before this check
        lambda: buf.append(groups("b", 2), ref_headroom=[0.5, 0.5], step=2**63),
        lambda: buf.refresh(ids[:2], [0.5, float("nan")], step=1),  # used to write the cache first
        lambda: buf.refresh(ids[:2], [0.5, 0.6], step=-3),
        lambda: buf.refresh([int(ids[0]), int(ids[0])], [0.5, 0.6], step=1),
        lambda: buf.record_use(ids[:2], weight=float("inf")),  # used to count the use first
        lambda: buf.record_use([1.7], weight=0.5),  # a float id is not truncated to 1
        lambda: buf.add_exposure(ids[:1], -1.0),
    ]
    for call in refusals:
        with pytest.raises(ReplayInputError):
            call()
        assert buffer_hash(buf) == before


def test_what_the_buffer_hands_out_is_a_copy():
    from protocol import buffer_hash

    buf = ReplayBuffer(4)
    buf.append(groups("a", 2) + groups("t", 2, tool_every=3), ref_headroom=[0.1] * 4, step=0)
    before = buffer_hash(buf)
    for g in buf.get(buf.insertion_ids()):
        for t in (g.prompt_ids, g.completion_ids, g.logprobs, g.advantages, g.rewards, g.loss_mask):
            t.zero_()
    buf.slot_values("cached_headroom", buf.insertion_ids())[:] = 9.0
    assert buffer_hash(buf) == before
    assert bool(buf.get([0])[0].loss_mask.all())  # the shared all-ones mask was not zeroed either
