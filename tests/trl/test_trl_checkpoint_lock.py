"""The TRL checkpoint path inherits the checkpoint lock: a replay state directory another live process is writing is
refused at save time, naming that process, and the checkpoint stays marked incomplete (never resumed)."""

from __future__ import annotations

import pytest

pytest.importorskip("trl")
pytestmark = pytest.mark.trl

from foreign_lock import held_by_another_process  # noqa: E402
from hdreplay.errors import CheckpointLockedError  # noqa: E402
from hdreplay.integrations.common import STATE_DIR  # noqa: E402
from hdreplay.integrations.trl.checkpoints import checkpoint_problem  # noqa: E402
from trl_fixtures import RecordingTrainer, make_args, prompts, reward_digit, tiny_model  # noqa: E402


def test_a_trl_checkpoint_whose_replay_state_another_process_writes_is_refused(tmp_path):
    model, tok = tiny_model(tmp_path / "model")
    out = tmp_path / "out"
    tr = RecordingTrainer(model=model, reward_funcs=reward_digit, processing_class=tok, train_dataset=prompts(),
                          args=make_args(out, max_steps=2, save_strategy="steps", save_steps=2))
    with held_by_another_process(out / "checkpoint-2" / STATE_DIR) as pid:
        with pytest.raises(CheckpointLockedError, match=rf"pid {pid}, started .*delete"):
            tr.train()
    assert "incomplete" in checkpoint_problem(out / "checkpoint-2", replay=True)  # never picked for a resume
