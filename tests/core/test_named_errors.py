"""Bad input found outside the first round's reach gets the documented error type, naming the field and the fix."""

import pytest
import torch

from hdreplay import CheckpointError, ReplayBuffer, ReplayConfig, ReplayConfigError, ReplayController
from protocol import run_steps


def test_a_loaded_loss_mask_shorter_than_its_log_probs_is_a_checkpoint_error():
    ctrl = run_steps(ReplayController(ReplayConfig(k_rep=2, capacity=8, group_size=4)), range(3), k=2)
    tensors, meta = ctrl.buffer.state_dict()
    for name in ("loss_mask", "logprobs"):
        bad = dict(tensors, **{name: tensors[name][:-3]})
        buf = ReplayBuffer(8, group_size=4)
        with pytest.raises(CheckpointError, match=f"'{name}'|log-probs / loss mask"):
            buf.load_state_dict(bad, meta)
        assert len(buf) == 0


def test_a_diagnostics_dir_that_is_a_file_is_a_config_error_naming_it(tmp_path):
    f = tmp_path / "diag"
    f.write_text("a file, not a directory")
    with pytest.raises(ReplayConfigError, match="diagnostics_dir.*is a file") as e:
        ReplayController(ReplayConfig(), diagnostics_dir=f)
    assert e.value.field == "diagnostics_dir"
    with pytest.raises(ReplayConfigError, match="diagnostics_dir"):
        ReplayController(ReplayConfig(), diagnostics_dir=f / "below")
    assert f.read_text() == "a file, not a directory"


def test_a_mask_of_the_wrong_dtype_in_a_loaded_state_is_a_checkpoint_error():
    ctrl = run_steps(ReplayController(ReplayConfig(k_rep=2, capacity=8, group_size=4)), range(2), k=2)
    tensors, meta = ctrl.buffer.state_dict()
    with pytest.raises(CheckpointError, match="loss_mask"):
        ReplayBuffer(8, group_size=4).load_state_dict(dict(tensors, loss_mask=tensors["loss_mask"].to(torch.int64)),
                                                      meta)
