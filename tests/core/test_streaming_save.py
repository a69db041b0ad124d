"""A save streams the buffer's tensors into the checkpoint block by block: the file is a safetensors file equal to
``state_dict()``, and the extra memory of a save is a small fraction of the checkpoint (it was twice its size:
``state_dict`` copies of every tensor, then the whole file as one ``bytes``)."""

import gc
import json
import os
import sys

import numpy as np
import pytest
import torch
from safetensors.torch import load as load_tensors

from hdreplay import CheckpointError, ReplayBuffer, ReplayConfig, ReplayController, checkpoint
from hdreplay.record import GroupRecord
from hdreplay.tensorfile import DTYPES, Streamed, chunks, header, specs
from hdreplay_lab.synthetic import TablePolicy, make_group
from protocol import run_steps, state_hash


def _file(tensors, chunk=1 << 20):
    sp = specs(tensors)
    prefix, size = header(sp)
    data = b"".join(bytes(c) for c in chunks(sp, prefix, chunk=chunk))
    assert len(data) == size
    return data


def _pieces(t, cuts):
    return Streamed(t.dtype, tuple(t.shape), lambda: list(t.tensor_split(cuts)))


@pytest.mark.parametrize("chunk", [1 << 20, 16, 1])  # staged together, and pieces larger than a chunk
def test_a_streamed_file_is_a_safetensors_file_holding_exactly_the_tensors(chunk):
    g = torch.Generator().manual_seed(0)
    want = {}
    for i, dt in enumerate(DTYPES):
        x = torch.randn(7, 3, generator=g) * 50
        want[f"t{i}"] = x > 0 if dt == torch.bool else x.to(dt)
    want["empty"], want["scalar"], want["long"] = torch.zeros(0, 4), torch.tensor(3.5), torch.arange(10_000)
    given = {k: (_pieces(v, [1, 1, 5]) if v.dim() and k != "long" else v) for k, v in want.items()}
    given["long"] = _pieces(want["long"], list(range(0, 10_000, 997)))
    got = load_tensors(_file(given, chunk))
    assert set(got) == set(want)
    for k, v in want.items():
        assert got[k].dtype == v.dtype and got[k].shape == v.shape and torch.equal(got[k], v), k


def test_pieces_that_do_not_match_their_declaration_are_refused_and_the_old_checkpoint_stays(tmp_path):
    ctrl = run_steps(ReplayController(ReplayConfig(k_rep=2, capacity=8, group_size=4)), range(3), k=2)
    ctrl.save(tmp_path / "ck")
    x = torch.arange(6)
    for bad in (Streamed(torch.int64, (7,), lambda: [x]), Streamed(torch.int64, (6,), lambda: [x.float()]),
                Streamed(torch.int64, (6, 1), lambda: [x])):
        with pytest.raises(CheckpointError, match="cannot serialise.*intact"):
            checkpoint.write_checkpoint_dir(tmp_path / "ck", format_name="hdreplay.controller", version=2,
                                            tensors={"x": bad}, meta={})
        assert sorted(p.name for p in (tmp_path / "ck").iterdir())[0] == "manifest.json"
        assert len(list((tmp_path / "ck").iterdir())) == 2  # the partial version was removed
        again = ReplayController(ctrl.config)
        again.load(tmp_path / "ck")
        assert state_hash(again) == state_hash(ctrl)


def test_the_saved_file_equals_state_dict_for_text_and_image_buffers(tmp_path):
    buf = ReplayBuffer(100)
    for t in range(24):  # several blocks, the front one compacted by eviction, masks with tool tokens in some
        buf.append([make_group(f"{t}-{i}", policy=TablePolicy(), step=t, seed=i, tool_every=3 * (t % 2))
                    for i in range(5)], ref_headroom=[0.1 * t] * 5, step=t)
    assert len(buf._blocks) > 3 and buf._blocks[0].first_id > 0
    buf.save(tmp_path / "ck")
    man = json.loads((tmp_path / "ck" / "manifest.json").read_text())
    got = load_tensors((tmp_path / "ck" / man["dir"] / "tensors.safetensors").read_bytes())
    want, _ = buf.state_dict()
    assert set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in want)
    from strategy_states import _group
    buf = ReplayBuffer(16)
    for t in range(3):
        buf.append([_group(f"m{t}.{i}", t, [1, 0, 1, 0], [1, 2, t], mm=True) for i in range(3)],
                   ref_headroom=[0.5] * 3, step=t)
    buf.save(tmp_path / "mm")
    back = ReplayBuffer.load(tmp_path / "mm")
    want, got = buf.state_dict()[0], back.state_dict()[0]
    assert any(k.startswith("mm.") for k in want) and all(torch.equal(got[k], want[k]) for k in want)


def _status(key):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key))


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="peak RSS reset needs Linux /proc")
def test_a_save_needs_a_small_fraction_of_the_checkpoint_in_extra_memory(tmp_path, monkeypatch):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # (building the groups: torch's thread pool is slow on a busy machine)
    try:
        _extra_memory_of_a_save(tmp_path)
    finally:
        torch.set_num_threads(threads)


def _extra_memory_of_a_save(tmp_path):
    rng = np.random.default_rng(0)
    T, n, k = 6000, 8, 1750  # 1,750 groups of 8 x 750 tokens: a ~95 MB checkpoint
    buf = ReplayBuffer(k)
    for s in range(0, k, 250):
        gs = [GroupRecord(group_id=s + j, prompt_ids=torch.from_numpy(rng.integers(0, 1000, 64, dtype=np.int32)),
                          completion_ids=torch.from_numpy(rng.integers(0, 1000, T, dtype=np.int32)),
                          response_lengths=torch.full((n,), T // n), loss_mask=torch.ones(T, dtype=torch.bool),
                          logprobs=-torch.rand(T), advantages=torch.zeros(n), rewards=torch.zeros(n), birth_step=0)
              for j in range(250)]
        buf.append(gs, ref_headroom=[0.0] * len(gs), step=0)
        del gs
    gc.collect()
    ReplayBuffer(4).save(tmp_path / "warm")  # first-use costs (imports) are not the save's
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # reset the peak RSS
    except OSError:
        pytest.skip("cannot reset the peak RSS here")
    base = _status("VmRSS")
    buf.save(tmp_path / "ck")
    extra = _status("VmHWM") - base
    size = sum(p.stat().st_size for p in (tmp_path / "ck").rglob("*") if p.is_file())
    assert size > 90e6
    assert extra < 0.05 * size, (extra / 2**20, size / 2**20)  # (before: about 2 x size)
    assert os.path.exists(tmp_path / "ck" / "manifest.json")
