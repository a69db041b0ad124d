"""Exceptions raised at the package's public boundaries.

All derive from :class:`ReplayError`; the input/config/checkpoint errors are also
``ValueError`` so that callers that already catch ``ValueError`` keep working.
"""


class ReplayError(Exception):
    """Base class for every hdreplay error."""


class ReplayInputError(ReplayError, ValueError):
    """A tensor, record or scorer output handed to hdreplay is malformed (shape, dtype, NaN, size)."""


class IngestError(ReplayInputError, RuntimeError):
    """A trainer's batch cannot be turned into groups at all (rows that do not form whole groups, rows of one
    group with different prompts, advantages that vary inside a response): the training step stops.  Also a
    ``RuntimeError``, what the integrations raised for these before :mod:`hdreplay.store.ingest` existed."""


class ReplayConfigError(ReplayError, ValueError):
    """A configuration value is out of range or unknown.

    ``field`` names the setting (as the raiser spells it; front ends re-label it), ``message`` is the
    text after ``"<field>: "`` (what is wrong and what to change).
    """

    def __init__(self, text: str, *, field: str | None = None) -> None:
        super().__init__(text)
        self.field = field
        prefix = f"{field}: "
        self.message = text[len(prefix):] if field and text.startswith(prefix) else text


class ReplayProtocolError(ReplayError, RuntimeError):
    """The one-step protocol (select -> stage -> commit) was called out of order."""


class CheckpointError(ReplayError, ValueError):
    """A checkpoint directory is missing, truncated, corrupted or was written by something else."""


class CheckpointLockedError(CheckpointError):
    """Another writer holds the checkpoint directory's lock (the message names its host, pid and start time)."""


class CheckpointMismatchError(CheckpointError):
    """A replay state belongs to another run or step than the checkpoint being resumed (the message names both)."""


class ReplayStarvedWarning(UserWarning):
    """The Drift gate has starved replay for several consecutive steps (see ``ReplayController``)."""


class ReplayCostWarning(UserWarning):
    """The gate's re-score has forwarded more than a stated multiple of the fresh batch's tokens for several
    consecutive steps (see ``ReplayController``; the message names the knobs that bound it)."""


class ReplayResumeWarning(UserWarning):
    """A checkpoint was loaded under a changed replay configuration (the changes are listed)."""
