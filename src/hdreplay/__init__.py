"""hdreplay: Headroom-Drift Replay for GRPO-style RL post-training.

Core API (framework-agnostic; importing it never imports TRL or verl):

    GroupRecord        one prompt + n responses with immutable generation-time state
    ReplayConfig       every knob, validated
    ReplayController   the select -> stage -> commit protocol trainers call
    ReplayBuffer       FIFO store with compact ragged storage and cached Headroom
    select_replay      the selection function (all selectors) used by the controller
    headroom, drift, replay_kl, replay_kl_per_group   pure scores on (G, T) tensors
    MixedOutcome, AnswerBased, make_ingress_rule      ingress rules
    pad_groups, PaddedGroups, group_scores            helpers for writing scorers
    balanced_partition, minibatch_layout, truncate_to_multiple   batch layout
    AsyncReplay, StalenessConfig   asynchronous pipelines: stale groups diverted to the buffer (hdreplay.staleness)

Reliability contract: every public call checks all of its arguments before it changes anything
(errors: ReplayInputError / ReplayConfigError / ReplayProtocolError / CheckpointError, all
ReplayError); what the buffer hands out are copies; ``ReplayController.save`` is crash-safe and
``load`` is all-or-nothing (see ``hdreplay.checkpoint`` and ``hdreplay.checkpoint_schema``).

Integrations live in ``hdreplay.integrations.trl`` and ``hdreplay.integrations.verl``.
"""

from .adaptive import AdaptiveTau, TauState, update_tau
from .buffer import ReplayBuffer
from .config import ReplayConfig
from .controller import ReplayController
from .diagnostics import METRIC_KEYS, STEP_FIELDS, DiagnosticsWriter, StepRecord, metrics_from_record
from .errors import (
    CheckpointError,
    ReplayConfigError,
    ReplayError,
    ReplayInputError,
    ReplayProtocolError,
    ReplayResumeWarning,
    ReplayStarvedWarning,
)
from .ingress import AnswerBased, MixedOutcome, make_ingress_rule
from .layout import balanced_partition, minibatch_layout, truncate_to_multiple
from .padding import PaddedGroups, pad_groups
from .scores import (
    GroupScores, drift, group_scores, headroom, reference_headroom, replay_kl, replay_kl_per_group, token_headroom,
)
from .selection import SELECTORS, Scorer, Selection, select_replay
from .staleness import AsyncReplay, StalenessConfig
from .record import GroupRecord

__version__ = "0.1.0"

__all__ = [
    "AdaptiveTau", "AsyncReplay", "StalenessConfig", "TauState", "update_tau", "AnswerBased", "CheckpointError", "DiagnosticsWriter", "GroupRecord", "GroupScores", "METRIC_KEYS", "STEP_FIELDS", "StepRecord",
    "MixedOutcome", "PaddedGroups", "ReplayBuffer", "ReplayConfig", "ReplayConfigError", "ReplayController",
    "ReplayError", "ReplayInputError", "ReplayProtocolError", "ReplayResumeWarning", "ReplayStarvedWarning", "SELECTORS", "Scorer", "Selection",
    "balanced_partition", "drift", "group_scores", "headroom", "make_ingress_rule", "metrics_from_record",
    "minibatch_layout", "pad_groups", "reference_headroom", "replay_kl", "replay_kl_per_group",
    "select_replay", "token_headroom", "truncate_to_multiple", "__version__",
]
