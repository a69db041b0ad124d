"""beta != 0 with ``sync_ref_model=True``: TRL mixes the policy into the reference model every
``ref_model_sync_steps`` steps, so reference log-probs stored at a group's birth go stale; replay rows of such
groups are re-scored under the current reference model.  Also: prompt-shared re-scoring equals the full forward."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("trl")
pytestmark = pytest.mark.trl

from trl import GRPOTrainer  # noqa: E402

from hdreplay import pad_groups  # noqa: E402
from hdreplay.integrations.trl.rescore import rescore_token_counts, shared_prompt_logps  # noqa: E402
from trl_fixtures import RecordingTrainer, make_args, prompts, reward_digit, tiny_model  # noqa: E402


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("ref_models")


class RefProbe(RecordingTrainer):
    """For every replay chunk, the reference model's log-probs of its rows at the moment TRL's loss uses them."""

    def _compute_loss(self, model, inputs):
        if bool((inputs["hdr_row"] < 0).any()):
            ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1)
            attn = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1)
            with torch.no_grad():
                ref_now = GRPOTrainer._get_per_token_logps_and_entropies(self, self.ref_model, ids, attn,
                                                                         inputs["completion_ids"].shape[1])[0]
            self.ref_now = getattr(self, "ref_now", []) + [ref_now.cpu()]
        return super()._compute_loss(model, inputs)


def test_replay_rows_use_the_current_reference_model_after_a_sync(model_dir, tmp_path):
    model, tok = tiny_model(model_dir)
    tr = RefProbe(model=model, reward_funcs=reward_digit, train_dataset=prompts(), processing_class=tok,
                  args=make_args(tmp_path / "o", max_steps=4, beta=0.5, sync_ref_model=True, ref_model_sync_steps=1,
                                 ref_model_mixup_alpha=0.6, replay_k_rep=2))
    tr.train()
    replay = [r for r in tr.records if r["is_replay"].any()]
    assert len(replay) == len(tr.ref_now) > 0
    spg, moved = tr.args.steps_per_generation, 0.0
    for r, now in zip(replay, tr.ref_now):
        m = r["mask"].bool()
        assert torch.allclose(r["ref"][m], now[m], atol=1e-5, rtol=0)  # the current reference, not the stored one
        sel = tr.selections[r["micro"] // spg]
        stored = torch.cat([ref[mk] for ref, mk in zip(sel["stored_ref"], sel["stored_mask"])])
        used = torch.cat([row[mm] for x in replay if x["micro"] // spg == r["micro"] // spg
                          for row, mm in zip(x["ref"], x["mask"].bool())])
        moved = max(moved, float((used - stored).abs().max()))
    assert moved > 1e-3  # the stored birth-time values were stale
    logs = [h for h in tr.state.log_history if "loss" in h]
    assert sum(h.get("replay/ref_refreshed", 0) for h in logs) > 0


@pytest.mark.parametrize("arch", ["qwen2", "gpt2"])
def test_prompt_shared_rescoring_equals_the_full_forward(model_dir, tmp_path, arch):
    model, tok = tiny_model(model_dir, arch=arch)
    tr = RecordingTrainer(model=model, reward_funcs=reward_digit, train_dataset=prompts(), processing_class=tok,
                          args=make_args(tmp_path / "o", max_steps=2, disable_dropout=True))
    tr.train()
    groups = tr.replay.buffer.get(tr.replay.buffer.insertion_ids().tolist())
    assert len({g.prompt_ids.numel() for g in groups}) > 1
    pg = pad_groups(groups, pad_token_id=tok.pad_token_id)
    full = tr._logps(torch.cat([pg.prompt_ids, pg.completion_ids], 1), torch.cat([pg.prompt_mask, pg.completion_mask],
                     1), pg.completion_ids.shape[1])
    for max_rows in (4, 64):
        shared = shared_prompt_logps(tr.accelerator.unwrap_model(tr.model), groups, pad_token_id=tok.pad_token_id,
                                     device="cpu", max_rows=max_rows, autocast=tr.accelerator.autocast)
        m = pg.completion_mask.bool()
        assert torch.allclose(shared[m], full[m].float(), atol=2e-5, rtol=0), (shared - full).abs().max()
    shared_tokens, full_tokens = rescore_token_counts(groups)
    P, C, R = pg.prompt_ids.shape[1], pg.completion_ids.shape[1], pg.num_rows
    assert (shared_tokens, full_tokens) == (len(groups) * (P - 1) + R * (C + 1), R * (P + C))
