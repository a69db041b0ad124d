"""HDRGRPOConfig: GRPOConfig plus the replay settings (documented once, validated in __post_init__)."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

from trl import GRPOConfig

from ...adaptive import AdaptiveTau
from ...config import ReplayConfig
from ...errors import ReplayConfigError

#: core ReplayConfig field -> HDRGRPOConfig field
FIELD_MAP = {
    "selector": "replay_selector", "k_rep": "replay_k", "tau": "replay_tau", "capacity": "replay_capacity",
    "drift_norm": "replay_drift_norm", "headroom_weighting": "replay_headroom_weighting",
    "ingress": "replay_ingress", "answer_threshold": "replay_answer_threshold",
    "truncate_multiple": "replay_truncate_multiple", "scan_chunk": "replay_scan_chunk",
    "max_scan_chunk": "replay_max_scan_chunk", "diagnose_ungated": "replay_diagnose_ungated",
    "counterfactual": "replay_counterfactual", "adaptive_tau": "replay_adaptive_tau",
}


@dataclass
class HDRGRPOConfig(GRPOConfig):
    r"""GRPOConfig with Headroom-Drift Replay.

    Parameters (in addition to every ``GRPOConfig`` field):
        replay_selector (`str`, defaults to `"headroom_drift"`):
            `headroom_drift` (the paper), `headroom_only`, `drift_only`, `recency` ("GRPO + replay") or `none`
            (plain GRPO: the trainer then behaves exactly like `GRPOTrainer`).
        replay_k (`int` or `None`, defaults to `None`):
            Replay budget K_rep in groups per generation step. `None` = half the fresh groups of a generation
            batch (the paper's b + b/2, e.g. b128 + r64).
        replay_tau (`float`, defaults to `1e-3`):
            Drift threshold tau (paper: 1e-3 single-turn reasoning, 1e-2 agentic search, with the l2 norm).
        replay_capacity (`int`, defaults to `512`):
            FIFO buffer capacity C in groups.
        replay_drift_norm (`str`, defaults to `"l2"`): `l2` (mean squared log-prob change) or `l1`.
        replay_headroom_weighting (`str`, defaults to `"sign"`): `sign` or `advantage` (|A_i|-weighted).
        replay_ingress (`str`, defaults to `"mixed"`):
            `mixed` (rewards not all equal) or `answer` (answer-mixed groups, needs `replay_answer_threshold`).
            The reward used is the weighted sum of the reward functions, as GRPO sums them.
        replay_answer_threshold (`float` or `None`): a_i = 1[reward_i >= threshold] for `answer` ingress.
        replay_truncate_multiple (`int`, defaults to `1`):
            u; accepted groups are cut to a multiple of u. The trainer further rounds to whole rows per rank and
            micro-step (num_processes x steps_per_generation / gcd with num_generations), so no row is dropped.
        replay_scan_chunk (`int` or `None`): groups re-scored per forward call batch; `None` = sized from the
            remaining budget and the running acceptance rate.
        replay_max_scan_chunk (`int`, defaults to `1024`): cap on an automatically sized chunk.
        replay_score_batch_size (`int` or `None`): rows per forward call when re-scoring (and when recording
            generation log-probs); `None` = `per_device_train_batch_size`.
        replay_diagnostics_dir (`str` or `None`): where `steps.jsonl` / `groups.jsonl` go; `None` =
            `<output_dir>/replay`, `""` = off.
        replay_diagnose_ungated (`bool`, defaults to `False`): also re-score `recency` picks for diagnostics.
        replay_counterfactual (`bool`, defaults to `False`): also score the subset recency replay would take
            from the same buffer (the paper's same-buffer counterfactual; costs a forward over those groups).
        replay_adaptive_tau (`dict` or `None`): keyword arguments of `hdreplay.AdaptiveTau` (e.g.
            `{"tau_min": 1e-4, "tau_max": 1e-1}`) to move tau within bounds; `replay_tau` is the start.
        replay_resume_without_state (`bool`, defaults to `False`): allow resuming from a checkpoint that has no
            replay state (e.g. written by plain GRPOTrainer); the buffer then starts empty.
    """

    replay_selector: str = field(default="headroom_drift", metadata={"help": "Replay selector."})
    replay_k: int | None = field(default=None, metadata={"help": "Replay budget K_rep (groups per step)."})
    replay_tau: float = field(default=1e-3, metadata={"help": "Drift threshold tau."})
    replay_capacity: int = field(default=512, metadata={"help": "Buffer capacity C (groups)."})
    replay_drift_norm: str = field(default="l2", metadata={"help": "Drift norm: l2 or l1."})
    replay_headroom_weighting: str = field(default="sign", metadata={"help": "Headroom weighting: sign or advantage."})
    replay_ingress: str = field(default="mixed", metadata={"help": "Ingress rule: mixed or answer."})
    replay_answer_threshold: float | None = field(default=None, metadata={"help": "Answer threshold (answer ingress)."})
    replay_truncate_multiple: int = field(default=1, metadata={"help": "Truncate accepted groups to a multiple of u."})
    replay_scan_chunk: int | None = field(default=None, metadata={"help": "Groups per re-scoring chunk (None=auto)."})
    replay_max_scan_chunk: int = field(default=1024, metadata={"help": "Max automatic chunk size."})
    replay_score_batch_size: int | None = field(default=None, metadata={"help": "Rows per re-scoring forward."})
    replay_diagnostics_dir: str | None = field(default=None, metadata={"help": "Diagnostics JSONL directory."})
    replay_diagnose_ungated: bool = field(default=False, metadata={"help": "Score recency picks for diagnostics."})
    replay_counterfactual: bool = field(default=False, metadata={"help": "Score the recency counterfactual."})
    replay_adaptive_tau: dict | None = field(default=None, metadata={"help": "AdaptiveTau keyword arguments."})
    replay_resume_without_state: bool = field(default=False, metadata={"help": "Allow resume without replay state."})

    def __post_init__(self):
        super().__post_init__()
        if self.use_vllm:
            raise ValueError(
                "HDRGRPOConfig: use_vllm=True is not supported yet (vLLM importance-sampling correction needs "
                "per-row sampling log-probs for replayed rows, which hdreplay does not store). Use the transformers "
                "generation backend (use_vllm=False), or the verl recipe for vLLM rollouts."
            )
        if self.replay_score_batch_size is not None and (
            not isinstance(self.replay_score_batch_size, int) or self.replay_score_batch_size < 1
        ):
            raise ValueError(f"replay_score_batch_size must be None or an int >= 1, got {self.replay_score_batch_size!r}")
        if self.replay_k is not None and (isinstance(self.replay_k, bool) or not isinstance(self.replay_k, int)):
            raise ValueError(f"replay_k must be None or an int >= 0, got {self.replay_k!r}")
        self.to_replay_config()  # validates every replay_* field

    @property
    def fresh_groups_per_generation(self) -> int:
        return self.generation_batch_size // self.num_generations

    def to_replay_config(self, *, extra_multiple: int = 1) -> ReplayConfig:
        """The core ReplayConfig these fields describe (``extra_multiple`` is folded into the truncation)."""
        k = self.fresh_groups_per_generation // 2 if self.replay_k is None else self.replay_k
        u = math.lcm(int(self.replay_truncate_multiple), extra_multiple) if isinstance(
            self.replay_truncate_multiple, int) and self.replay_truncate_multiple >= 1 else self.replay_truncate_multiple
        try:
            adaptive = None if self.replay_adaptive_tau is None else AdaptiveTau(**self.replay_adaptive_tau)
            return ReplayConfig(
                selector=self.replay_selector, k_rep=k, tau=self.replay_tau, capacity=self.replay_capacity,
                drift_norm=self.replay_drift_norm, headroom_weighting=self.replay_headroom_weighting,
                ingress=self.replay_ingress, answer_threshold=self.replay_answer_threshold, truncate_multiple=u,
                scan_chunk=self.replay_scan_chunk, max_scan_chunk=self.replay_max_scan_chunk,
                group_size=self.num_generations, diagnose_ungated=self.replay_diagnose_ungated,
                counterfactual=self.replay_counterfactual, adaptive_tau=adaptive,
            )
        except TypeError as e:  # unknown AdaptiveTau keyword
            raise ValueError(f"HDRGRPOConfig: replay_adaptive_tau: {e}") from e
        except ReplayConfigError as e:
            msg = str(e)
            for core, ours in FIELD_MAP.items():  # name the fields the user actually sets
                msg = re.sub(rf"(?<![\w.]){core}\b", ours, msg)
            raise ValueError(f"HDRGRPOConfig: {msg}") from e
