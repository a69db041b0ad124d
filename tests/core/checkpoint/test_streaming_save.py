"""A save streams the buffer's tensors into the checkpoint block by block: the file is a safetensors file equal to
``state_dict()``, and the extra memory of a save is a small fraction of the checkpoint (it was twice its size:
``state_dict`` copies of every tensor, then the whole file as one ``bytes``)."""

import gc
import hashlib
import json
import os
import struct
import sys
import threading
import time

import numpy as np
import pytest
import torch
from safetensors.torch import load as load_tensors

from hdreplay import CheckpointError, ReplayBuffer, ReplayConfig, ReplayController
from hdreplay.checkpoint import files as checkpoint
from hdreplay.checkpoint.tensorfile import DTYPES, Streamed, chunks, header, specs
from hdreplay.store.record import GroupRecord
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


# ---------------------------------------------------------------- streaming load
def _big_buffer(k=1750, T=6000, n=8):
    """1,750 groups of 8 x 750 tokens (a ~95 MB checkpoint); loss masks with prompt-side zeros in every 7th group."""
    rng = np.random.default_rng(0)
    buf = ReplayBuffer(k)
    for s in range(0, k, 250):
        gs = []
        for j in range(250):
            mask = torch.ones(T, dtype=torch.bool)
            lp = -torch.rand(T)
            if (s + j) % 7 == 0:
                mask[:5] = False
                lp[:5] = 0
            gs.append(GroupRecord(group_id=s + j,
                                  prompt_ids=torch.from_numpy(rng.integers(0, 1000, 64, dtype=np.int32)),
                                  completion_ids=torch.from_numpy(rng.integers(0, 1000, T, dtype=np.int32)),
                                  response_lengths=torch.full((n,), T // n), loss_mask=mask, logprobs=lp,
                                  advantages=torch.zeros(n), rewards=torch.zeros(n), birth_step=0))
        buf.append(gs, ref_headroom=[0.0] * len(gs), step=0)
        del gs
    return buf


def _load_extra(path: str):
    """In a fresh process: (bytes of peak RSS a load of the checkpoint at ``path`` needs beyond the state it builds,
    the checkpoint's size), or None where the peak RSS cannot be reset."""
    import ctypes
    from pathlib import Path

    torch.set_num_threads(1)
    ck = Path(path)
    ReplayBuffer.load(ck).state_dict()  # first-use costs are not the load's
    gc.collect()
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):
        pass
    size = sum(p.stat().st_size for p in ck.rglob("*") if p.is_file())
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return None
    base = _status("VmRSS")
    back = ReplayBuffer.load(ck)
    return _status("VmHWM") - base - back.nbytes(), size


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="peak RSS reset needs Linux /proc")
def test_a_load_needs_a_small_fraction_of_the_checkpoint_beyond_the_state_it_builds(tmp_path):
    """Before: the whole file read into one ``bytes``, parsed into a second copy, then cut into blocks (a third), about
    1.5 x the checkpoint beyond the loaded state (2.4 x in all).  Now the blocks are read from the file one by one.
    Measured in a fresh process: in the suite's long-lived one, the heap left by earlier tests (threads' arenas
    included) moved the peak by megabytes."""
    import multiprocessing as mp

    _big_buffer().save(tmp_path / "ck")
    with mp.get_context("spawn").Pool(1) as pool:
        got = pool.apply(_load_extra, (str(tmp_path / "ck"),))
    if got is None:
        pytest.skip("cannot reset the peak RSS here")
    extra, size = got
    assert size > 90e6
    assert extra < 0.1 * size, (extra / 2**20, size / 2**20)


def _reference_load(d):
    """What the load returned before it streamed: safetensors' whole-file parse, then load_state_dict."""
    man = json.loads((d / "manifest.json").read_text())
    tensors = load_tensors((d / man["dir"] / "tensors.safetensors").read_bytes())
    state = json.loads((d / man["dir"] / "state.json").read_text())
    return tensors, state["meta"]


def test_the_streamed_load_is_bit_identical_to_a_whole_file_load(tmp_path):
    from strategy_states import _group
    text = ReplayBuffer(300)
    for t in range(12):  # blocks cut at other places than the load's (eviction compacts the front one)
        text.append([make_group(f"{t}-{i}", policy=TablePolicy(), step=t, seed=i, tool_every=3 * (t % 2))
                     for i in range(37)], ref_headroom=[0.1 * t] * 37, step=t)
    image = ReplayBuffer(200)
    for t in range(3):
        image.append([_group(f"m{t}.{i}", t, [1, 0, 1, 0], [1, 2, t], mm=True) for i in range(70)],
                     ref_headroom=[0.5] * 70, step=t)
    for name, buf in (("text", text), ("image", image)):
        buf.save(tmp_path / name)
        back = ReplayBuffer.load(tmp_path / name)
        ref = ReplayBuffer(buf.capacity, group_size=buf.group_size)
        ref.load_state_dict(*_reference_load(tmp_path / name))
        (got, gmeta), (want, wmeta) = back.state_dict(), ref.state_dict()
        assert gmeta == wmeta and set(got) == set(want), name
        for k in want:
            assert got[k].dtype == want[k].dtype and torch.equal(got[k], want[k]), (name, k)
        assert [(b.first_id, b.count) for b in back._blocks] == [(b.first_id, b.count) for b in ref._blocks]
        for b in back._blocks:  # every block owns exactly its memory
            assert b.tokens.untyped_storage().nbytes() == b.tokens.numel() * 4
    ctrl = run_steps(ReplayController(ReplayConfig(k_rep=3, capacity=40, group_size=4)), range(12), k=6)
    ctrl.save(tmp_path / "ctrl")
    again = ReplayController(ctrl.config)
    again.load(tmp_path / "ctrl")
    assert state_hash(again) == state_hash(ctrl)
    assert ReplayController.verify(tmp_path / "ctrl") == ctrl.last_step


def _rewrite_tensors(d, data):
    """Replace the checkpoint's tensor file with ``data`` and re-sign the manifest (a file that passes the
    checksums)."""
    man = json.loads((d / "manifest.json").read_text())
    (d / man["dir"] / "tensors.safetensors").write_bytes(data)
    man["files"]["tensors.safetensors"] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    man["sha256"] = checkpoint._manifest_digest(man)
    (d / "manifest.json").write_text(json.dumps(man, sort_keys=True))


def _header(entries, pad=b""):
    text = json.dumps(entries).encode() + pad
    return struct.pack("<Q", len(text)) + text


BAD_FILES = {
    "empty": b"",
    "short length": b"\x01\x02",
    "header longer than the file": struct.pack("<Q", 1 << 40) + b"{}",
    "header not JSON": struct.pack("<Q", 3) + b"{x}",
    "header nested deeply": struct.pack("<Q", 30_000) + b"[" * 30_000,
    "header a list": _header([1]),
    "unknown dtype": _header({"t": {"dtype": "Q7", "shape": [1], "data_offsets": [0, 1]}}) + b"\0",
    "negative shape": _header({"t": {"dtype": "U8", "shape": [-1], "data_offsets": [0, 1]}}) + b"\0",
    "offsets do not hold the shape": _header({"t": {"dtype": "I32", "shape": [2], "data_offsets": [0, 4]}}) + b"\0" * 4,
    "overlapping tensors": _header({"a": {"dtype": "U8", "shape": [4], "data_offsets": [0, 4]},
                                    "b": {"dtype": "U8", "shape": [4], "data_offsets": [2, 6]}}) + b"\0" * 6,
    "a gap": _header({"a": {"dtype": "U8", "shape": [2], "data_offsets": [2, 4]}}) + b"\0" * 4,
    "trailing bytes": _header({"a": {"dtype": "U8", "shape": [2], "data_offsets": [0, 2]}}) + b"\0" * 3,
}


@pytest.mark.parametrize("case", sorted(BAD_FILES))
def test_a_malformed_tensor_file_with_valid_checksums_is_refused(tmp_path, case):
    ctrl = run_steps(ReplayController(ReplayConfig(k_rep=2, capacity=8, group_size=4)), range(3), k=2)
    ctrl.save(tmp_path / "ck")
    _rewrite_tensors(tmp_path / "ck", BAD_FILES[case])
    probe = ReplayController(ctrl.config)
    with pytest.raises(CheckpointError, match="cannot read tensors"):
        probe.load(tmp_path / "ck")
    assert probe.last_step is None and len(probe.buffer) == 0


def test_a_valid_file_holding_the_wrong_tensors_is_refused_naming_them(tmp_path):
    ctrl = run_steps(ReplayController(ReplayConfig(k_rep=2, capacity=8, group_size=4)), range(3), k=2)
    ctrl.save(tmp_path / "ck")
    d = tmp_path / "ck"
    tensors, meta = _reference_load(d)
    for name, bad in (("tokens", tensors["tokens"].to(torch.int64)), ("tok_off", tensors["tok_off"][:-1]),
                      ("junk", torch.zeros(3))):
        _rewrite_tensors(d, _file({**tensors, name: bad}))
        with pytest.raises(CheckpointError, match=name):
            ReplayController(ctrl.config).load(d)


def test_a_fifo_in_place_of_a_checkpoint_file_is_refused_without_hanging(tmp_path):
    """Before: a FIFO at manifest.json hung every load (it was opened for reading, blocking until a writer came)."""
    ctrl = run_steps(ReplayController(ReplayConfig(k_rep=2, capacity=8, group_size=4)), range(3), k=2)
    ctrl.save(tmp_path / "ck")
    man = tmp_path / "ck" / "manifest.json"
    man.unlink()
    os.mkfifo(man)
    stop = threading.Event()

    def unblock():  # fail instead of hanging on the old code: let a blocked reader through every 10 s
        while not stop.wait(10):
            try:
                os.close(os.open(man, os.O_WRONLY | os.O_NONBLOCK))
            except OSError:
                pass
    threading.Thread(target=unblock, daemon=True).start()
    t0 = time.monotonic()
    try:
        with pytest.raises(CheckpointError, match="not a regular file"):
            ReplayController(ctrl.config).load(tmp_path / "ck")
    finally:
        stop.set()
    assert time.monotonic() - t0 < 5
