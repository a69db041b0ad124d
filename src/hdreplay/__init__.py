"""hdreplay: Headroom-Drift Replay for GRPO-style RL post-training.

Core API (framework-agnostic; importing it never imports TRL or verl):

    GroupRecord        one prompt + n responses with immutable generation-time state
    Rows, groups_from_rows   a trainer's fresh rows -> GroupRecords, every check in one place (hdreplay.ingest)
    ReplayConfig       every knob, validated
    ReplayController   the select -> stage -> commit protocol trainers call
    ReplayBuffer       FIFO store with compact ragged storage and cached Headroom
    select_replay      the selection function (all selectors) used by the controller
    headroom, drift, replay_kl, replay_kl_per_group   pure scores on (G, T) tensors
    MixedOutcome, AnswerBased, make_ingress_rule      ingress rules
    pad_groups, PaddedGroups, group_scores            helpers for writing scorers

The peers (ExGRPO, BAPO, RePO, POPO, FreshPER, |A|-priority, uniform FIFO, DAPO's dynamic sampling) are
``hdreplay.baselines``, behind the same select -> stage -> commit protocol (``hdreplay.baselines.Strategy``); the
verl recipe's mini-batch layout is ``hdreplay.integrations.layout`` (``balanced_partition``, ``minibatch_layout``
and ``truncate_to_multiple`` still resolve here, deprecated).

Reliability contract: every public call checks all of its arguments before it changes anything
(errors: ReplayInputError / ReplayConfigError / ReplayProtocolError / CheckpointError, all
ReplayError; CheckpointLockedError when another writer holds a checkpoint directory); what the buffer hands out are copies; ``ReplayController.save`` is crash-safe and
``load`` is all-or-nothing (see ``hdreplay.checkpoint`` and ``hdreplay.checkpoint_schema``).

Asynchronous pipelines (stale groups diverted to the buffer, the Drift floor, the ledger): ``hdreplay.staleness``,
one level above the controller, so importing ``hdreplay`` does not import it.

Integrations live in ``hdreplay.integrations.trl`` and ``hdreplay.integrations.verl``.
"""

from .adaptive import AdaptiveTau, TauState, advance_tau, update_tau
from .buffer import ReplayBuffer
from .config import ReplayConfig
from .controller import ReplayController
from .diagnostics import METRIC_KEYS, STEP_FIELDS, DiagnosticsWriter, StepRecord, metrics_from_record
from .errors import (
    CheckpointError,
    CheckpointLockedError,
    IngestError,
    ReplayConfigError,
    ReplayError,
    ReplayInputError,
    ReplayProtocolError,
    ReplayResumeWarning,
    ReplayStarvedWarning,
)
from .ingest import Ingest, Rows, groups_from_rows
from .ingress import AnswerBased, MixedOutcome, make_ingress_rule
from .padding import PaddedGroups, pad_groups
from .scores import (
    GroupScores, drift, group_scores, headroom, reference_headroom, replay_kl, replay_kl_per_group, token_headroom,
)
from .selection import Scorer, select_replay
from .selectors import SELECTORS, Selection
from .record import GroupRecord

from . import baselines  # noqa: E402,F401  (above the core: registers the peers' selectors, resolves moved names)

__version__ = "0.1.0"


__all__ = [
    "AdaptiveTau", "advance_tau", "AnswerBased", "CheckpointError", "CheckpointLockedError",
    "DiagnosticsWriter",
    "drift", "group_scores", "GroupRecord", "groups_from_rows", "GroupScores", "headroom", "Ingest", "IngestError",
    "make_ingress_rule", "METRIC_KEYS", "metrics_from_record", "MixedOutcome", "pad_groups",
    "PaddedGroups", "reference_headroom", "replay_kl", "replay_kl_per_group", "ReplayBuffer", "ReplayConfig",
    "ReplayConfigError", "ReplayController", "ReplayError", "ReplayInputError", "ReplayProtocolError",
    "ReplayResumeWarning", "ReplayStarvedWarning", "Rows", "Scorer", "select_replay", "Selection", "SELECTORS",
    "STEP_FIELDS", "StepRecord", "TauState", "token_headroom", "update_tau", "__version__",
]
