"""Checkpoint fault injection: a crash at every file-system call of save(), byte flips in every file,
disk-full and permission errors.  Deterministic: crashes are injected through hdreplay.checkpoint.files.FS."""

import errno
import json
import shutil
import warnings
from collections import Counter
from pathlib import Path

import pytest

from hdreplay import CheckpointError, ReplayConfig, ReplayController, ReplayResumeWarning
from hdreplay.checkpoint import files as checkpoint
from protocol import run_steps, state_hash

CFG = ReplayConfig(k_rep=3, tau=5e-3, capacity=12, group_size=4)


class Crash(BaseException):
    """A simulated process death: nothing after it takes effect."""


class CrashingFS:
    """hdreplay.checkpoint.files.FS, dying at call number ``at`` (``torn``: a write dies half-way through)."""

    def __init__(self, real, at=None, torn=False):
        self.real, self.at, self.torn, self.calls, self.crashed = real, at, torn, [], False

    def __getattr__(self, name):
        fn = getattr(self.real, name)

        def call(*args):
            if self.crashed:
                if name == "close":  # the kernel closes a dead process's files; nothing else happens
                    fn(*args)
                raise Crash()
            self.calls.append(name)
            if self.at is not None and len(self.calls) - 1 == self.at:
                self.crashed = True
                if self.torn and name == "write":
                    fn(args[0], bytes(args[1])[: max(1, len(args[1]) // 2)])
                raise Crash()
            return fn(*args)
        return call


def controller(steps):
    return run_steps(ReplayController(CFG), range(steps), k=4)


def loaded_hash(path):
    ctrl = ReplayController(CFG)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ReplayResumeWarning)
            ctrl.load(path)
    except CheckpointError:
        return None
    return state_hash(ctrl)


def prepare(root: Path, scenario: str, old: ReplayController) -> Path:
    """A checkpoint path holding the previous state the way ``scenario`` describes."""
    if root.exists():
        shutil.rmtree(root)
    root.mkdir()
    d = root / "ck"
    if scenario == "fresh":
        return d
    old.save(d)
    if scenario == "leftovers":  # what crashed saves leave behind
        (d / ".tmp-v-0123456789abcdef").mkdir()
        (d / ".tmp-v-0123456789abcdef" / "state.json").write_text("{")
        shutil.copytree(d / json.loads((d / "manifest.json").read_text())["dir"], d / "v-fedcba9876543210")
        (d / ".manifest.json.tmp-00112233445566ff").write_text("{")
    return d


def previous_hash(scenario, old):
    if scenario == "fresh":
        return None
    return state_hash(old)


@pytest.mark.parametrize("scenario", ["fresh", "overwrite", "leftovers"])
def test_a_crash_at_any_fs_call_of_save_leaves_the_old_or_the_new_state(tmp_path, monkeypatch, scenario):
    old, new, third = controller(3), controller(5), controller(6)
    before, after = previous_hash(scenario, old), state_hash(new)
    real = checkpoint.FS
    probe, d = CrashingFS(real), prepare(tmp_path / "probe", scenario, old)
    monkeypatch.setattr(checkpoint, "FS", probe)
    new.save(d)
    monkeypatch.setattr(checkpoint, "FS", real)
    points = [(i, False) for i in range(len(probe.calls))] + [(i, True) for i, n in enumerate(probe.calls)
                                                               if n == "write"]
    outcome = Counter()
    for at, torn in points:
        d = prepare(tmp_path / "run", scenario, old)
        monkeypatch.setattr(checkpoint, "FS", CrashingFS(real, at, torn))
        with pytest.raises(Crash):
            new.save(d)
        monkeypatch.setattr(checkpoint, "FS", real)
        got = loaded_hash(d)
        outcome["old" if got == before else "new" if got == after else
                "unloadable" if got is None else "mixed"] += 1
        third.save(d)  # the next save cleans every leftover
        inside = sorted(p.name for p in d.iterdir())
        orphans = [n for n in inside if n != "manifest.json"][1:] + [
            p.name for p in d.parent.iterdir() if p.name != "ck"]
        outcome["orphans"] += len(orphans)
        assert loaded_hash(d) == state_hash(third)
    assert outcome["unloadable"] == outcome["mixed"] == outcome["orphans"] == 0, outcome
    assert outcome["old"] > 0 and outcome["new"] > 0  # both sides of the commit point were hit
    assert len(points) >= 25


def test_every_byte_flip_in_every_checkpoint_file_is_refused(tmp_path):
    ctrl = controller(5)
    ctrl.save(tmp_path / "ck")
    d = tmp_path / "ck"
    version = json.loads((d / "manifest.json").read_text())["dir"]
    files = [d / "manifest.json", d / version / "state.json", d / version / "tensors.safetensors"]
    outcome = Counter()
    for f in files:
        data = f.read_bytes()
        stride = max(1, len(data) // 800)  # every byte of the small files, >= 800 positions of the tensors
        for pos in range(0, len(data), stride):
            for mask in ((0x01, 0x80)[pos % 2],):  # the lowest and the highest bit, alternately
                f.write_bytes(data[:pos] + bytes([data[pos] ^ mask]) + data[pos + 1:])
                probe = ReplayController(CFG)
                try:
                    probe.load(d)
                    outcome["loaded_same" if state_hash(probe) == state_hash(ctrl) else "loaded_different"] += 1
                except CheckpointError:
                    outcome["refused"] += 1
                    assert probe.last_step is None and len(probe.buffer) == 0  # a refused load changes nothing
        f.write_bytes(data)
        outcome[f.name] = 1
    assert outcome["loaded_different"] == outcome["loaded_same"] == 0, outcome
    assert outcome["refused"] > 2000
    assert loaded_hash(d) == state_hash(ctrl)  # the restored files load again


@pytest.mark.parametrize("call, err", [("write", errno.ENOSPC), ("mkdir", errno.EACCES), ("open", errno.EROFS),
                                       ("replace", errno.EACCES), ("fsync", errno.EIO)])
def test_disk_full_and_permission_errors_name_the_path_and_keep_the_old_checkpoint(tmp_path, monkeypatch, call,
                                                                                  err):
    old, new = controller(3), controller(5)
    d = tmp_path / "ck"
    old.save(d)
    before = sorted(p.name for p in d.iterdir())
    real = checkpoint.FS

    class Failing:
        def __getattr__(self, name):
            fn = getattr(real, name)
            if name != call:
                return fn

            def fail(*args):
                raise OSError(err, "injected", str(args[0]) if isinstance(args[0], Path) else None)
            return fail

    monkeypatch.setattr(checkpoint, "FS", Failing())
    with pytest.raises(CheckpointError, match=f"{d}: cannot write the checkpoint.*previous checkpoint.*intact"):
        new.save(d)
    monkeypatch.setattr(checkpoint, "FS", real)
    assert loaded_hash(d) == state_hash(old)
    assert sorted(p.name for p in d.iterdir()) == before  # the partial version was removed


def test_unserialisable_state_is_refused_before_anything_is_written(tmp_path):
    with pytest.raises(CheckpointError, match="cannot serialise"):
        checkpoint.write_checkpoint_dir(tmp_path / "ck", format_name="x", version=2, tensors={},
                                        meta={"bad": float("nan")})
    assert not (tmp_path / "ck").exists()
