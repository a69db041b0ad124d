"""One replay step of :class:`~.trainer.HDRGRPOTrainer`, as one explicit object.

A replay step is one optimizer update.  Its life, top to bottom:

1. **opened** at the first generation of an update (``ReplayStep(index=state.global_step)``);
2. **generated**: every generation batch of the update adds a :class:`Generation` (this rank's rows,
   the global rewards, and the generation-time log-probs -- TRL's ``old_per_token_logps`` when it
   computed them, else captured from each fresh row's own training forward, which runs before the
   update);
3. **selected**: the first generation runs the controller's selection; this rank's share of the
   replay rows is laid out as extra chunks of the generation's micro-steps (:class:`MicroStep`);
4. **committed** once the update has been applied (``on_step_end``): the generations' rows are
   gathered from all ranks into groups, staged (the ingress rule decides) and committed.

Everything the trainer needs between those points lives here; the trainer keeps only a reference to
the open step.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ...selection import Selection


@dataclass
class Generation:
    """One generation batch of this rank, as ingress needs it at commit.

    rows:      :func:`.batch.ingress_rows` of the batch (B local rows, TRL's order).
    rewards:   (N,) total reward of every row of the batch on all ranks (N = B * W), set by TRL's
               reward computation.
    gen_logps: (B, C) generation-time log-probs when TRL computed them (``old_per_token_logps``);
               None until captured otherwise.
    captured:  (B,) which rows' log-probs were captured from their training forward (capture mode).
    """

    rows: dict[str, torch.Tensor] = field(default_factory=dict)
    rewards: torch.Tensor | None = None
    gen_logps: torch.Tensor | None = None
    captured: torch.Tensor | None = None
    _capture: torch.Tensor | None = None

    @property
    def needs_capture(self) -> bool:
        return self.captured is not None

    def start_capture(self, rows: int, width: int, device) -> None:
        self._capture = torch.zeros(rows, width, device=device)
        self.captured = torch.zeros(rows, dtype=torch.bool, device=device)

    def capture(self, row_index: torch.Tensor, logps: torch.Tensor) -> None:
        """Record the log-probs of rows ``row_index`` (local indices) from a forward under the birth weights."""
        c = min(logps.shape[1], self._capture.shape[1])
        self._capture[row_index, :c] = logps[:, :c].detach().float()
        self.captured[row_index] = True

    def logps(self) -> torch.Tensor:
        """(B, C) generation-time log-probs (raises if a row was never captured)."""
        if self.gen_logps is not None:
            return self.gen_logps.float()
        if not bool(self.captured.all()):
            raise RuntimeError("HDRGRPOTrainer: some fresh rows were never trained before the optimizer update that "
                               "closes their replay step; their generation log-probs are unknown (this is a bug in "
                               "hdreplay, please report it with your GA / steps_per_generation / num_iterations)")
        return self._capture

    def ingress_rows(self) -> dict[str, torch.Tensor]:
        rows = dict(self.rows)
        rows["gen_logps"] = lp = self.logps()
        if "sampling_logprobs" in rows:  # vLLM could not score some tokens (NaN): store the trainer's value
            s = rows["sampling_logprobs"]
            rows["sampling_logprobs"] = torch.where(torch.isnan(s), lp.to(s.dtype), s)
        return rows


@dataclass
class ReplayStep:
    """The open replay step (one optimizer update).

    index:        controller step = optimizer updates completed when the step opened (TRL's global_step);
                  every group generated in the step is born at ``index``.
    generations:  the generation batches of the update, in order.
    selection:    the controller's selection (made at the first generation).
    replay_rows:  this rank's replay rows (R / W).  replay_tokens: loss tokens of all replayed groups (every
                  rank), added to TRL's ``num_items_in_batch``.
    replay_part:  this rank's replay rows as one TRL batch dict until the trainer cuts it into chunks.
    ref_refreshed: replay rows whose reference log-probs were recomputed after a reference-model sync.
    """

    index: int
    generations: list[Generation] = field(default_factory=list)
    selection: Selection | None = None
    replay_rows: int = 0
    replay_tokens: int = 0
    replay_part: dict | None = None
    ref_refreshed: int = 0

    @property
    def current(self) -> Generation:
        return self.generations[-1]

    def open_generation(self) -> Generation:
        g = Generation()
        self.generations.append(g)
        return g
