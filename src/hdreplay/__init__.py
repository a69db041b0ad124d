"""hdreplay: Headroom-Drift Replay for GRPO-style RL post-training -- the paper's method, and only that.

``import hdreplay`` loads the method and what every trainer needs to run it (torch and numpy only):

    GroupRecord              one prompt + n responses with immutable generation-time state
    Rows, groups_from_rows   a trainer's fresh rows -> GroupRecords, every check in one place (hdreplay.store.ingest)
    ReplayConfig             the method's settings (ReplayConfig.paper(): the paper exactly), validated once
    ReplayBuffer             FIFO store with compact ragged storage and cached Headroom
    select_replay            Algorithm 1: rank by cached Headroom, re-score, gate on Drift <= tau, stop at K_rep
    ReplayController         the select -> stage -> commit protocol trainers call; crash-safe save / load
    headroom, drift, ...     pure scores on (G, T) tensors
    StepRecord, ...          what the method decided, per step (steps.jsonl, replay/* metrics)

Around it, each imported only when asked for: the peers (``hdreplay.baselines``: ExGRPO, BAPO, RePO, POPO, FreshPER,
|A|-priority, uniform, DAPO's dynamic sampling; their selectors register when that package is imported), diagnostics
and experiments (``hdreplay.diagnostics``: the same-buffer counterfactual, the ungated diagnosis, adaptive tau, the
bf16 noise-floor table), the experimental asynchronous staleness rule (``hdreplay.staleness``), the trainers
(``hdreplay.integrations.trl``, ``hdreplay.integrations.verl``) and the lab (``hdreplay_lab``: sandbox, analyses, CLI).

Reliability contract: every public call checks all of its arguments before it changes anything (errors:
ReplayInputError / ReplayConfigError / ReplayProtocolError / CheckpointError, all ReplayError;
CheckpointLockedError when another writer holds a checkpoint directory); what the buffer hands out are copies;
``ReplayController.save`` is crash-safe and ``load`` all-or-nothing (:mod:`hdreplay.checkpoint.files`).
"""

from .config import ReplayConfig
from .controller import ReplayController
from .errors import (
    CheckpointError,
    CheckpointLockedError,
    CheckpointMismatchError,
    IngestError,
    ReplayConfigError,
    ReplayCostWarning,
    ReplayError,
    ReplayInputError,
    ReplayProtocolError,
    ReplayResumeWarning,
    ReplayStarvedWarning,
)
from .ingress import AnswerBased, MixedOutcome, make_ingress_rule
from .records import METRIC_KEYS, STEP_FIELDS, DiagnosticsWriter, StepRecord, metrics_from_record
from .scores import drift, group_scores, headroom, reference_headroom, replay_kl, replay_kl_per_group
from .selection import Scorer, select_replay
from .selectors import SELECTORS, Selection
from .store.buffer import ReplayBuffer
from .store.ingest import Ingest, Rows, groups_from_rows
from .store.padding import PaddedGroups, pad_groups
from .store.record import GroupRecord

__version__ = "0.2.0.dev0"

__all__ = ["AnswerBased", "CheckpointError", "CheckpointLockedError", "CheckpointMismatchError", "DiagnosticsWriter",
           "drift", "group_scores", "GroupRecord", "groups_from_rows", "headroom", "Ingest", "IngestError",
           "make_ingress_rule", "METRIC_KEYS", "metrics_from_record", "MixedOutcome", "pad_groups", "PaddedGroups",
           "reference_headroom", "replay_kl", "replay_kl_per_group", "ReplayBuffer", "ReplayConfig",
           "ReplayConfigError", "ReplayController", "ReplayCostWarning", "ReplayError", "ReplayInputError",
           "ReplayProtocolError", "ReplayResumeWarning", "ReplayStarvedWarning", "Rows", "Scorer", "select_replay",
           "Selection", "SELECTORS", "STEP_FIELDS", "StepRecord", "__version__"]
