"""The replay arithmetic of one TRL configuration, checked before anything is built.

TRL trains ``per_device_train_batch_size`` (pd) rows per micro-step on each of W processes, GA
micro-steps per optimizer update, and generates a batch of ``pd * spg * W`` rows (``spg`` =
steps_per_generation) every ``spg * num_iterations`` micro-steps.  A *replay step* is one optimizer
update: groups are selected at the first generation of an update and committed into the buffer
when the update has been applied, so a group is replayed only after at least one weight update
since its birth, whatever GA, spg and num_iterations are.

=========================  ====================================================================
fresh groups per step F    groups generated per replay step: ``pd*spg*W/n`` when a generation
                           spans >= 1 update (spg*num_iterations >= GA), else that times the
                           generations per update (``GA // (spg*num_iterations)``; it varies
                           when that division is not exact)
truncation unit u          replay rows are split evenly over the W processes, so the number of
                           replayed groups is cut to a multiple of ``W / gcd(n, W)``
K_rep (default)            ``F // 2`` cut to a multiple of u: the paper's b + b/2
alpha                      ``F / (F + K_rep)``: the fresh groups' share of an update (Prop. 1)
=========================  ====================================================================

Settings under which replay would silently do nothing, or something else than asked, are refused
(:class:`~hdreplay.errors.ReplayConfigError` naming the field) or warned about, with the numbers.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, field

from ...errors import ReplayConfigError
from ...selectors import SELECTORS

#: replay:fresh ratio the paper uses (b + b/2)
PAPER_RATIO = 0.5


class ReplaySettingWarning(UserWarning):
    """A TRL + replay setting that runs, but not the way its numbers suggest (see the message)."""


@dataclass(frozen=True)
class ReplayPlan:
    """Replay arithmetic of one configuration (all counts in groups unless named rows).

    Attributes:
        world: W processes.  per_device: pd rows per micro-step.  ga, spg, iterations: TRL's settings.
        n: responses per group.  generation_groups: groups per generation batch (all processes).
        generations_per_step: generations per replay step (>= 1; a minimum when ``uneven``).
        fresh_groups: F, fresh groups per replay step.  unit: u.  k_rep: K_rep after the cut to u.
        k_rep_requested: K_rep as set (None = default).  capacity: C.
        warnings: the warning texts (also emitted by :meth:`warn`).
    """

    world: int
    per_device: int
    ga: int
    spg: int
    iterations: int
    n: int
    generation_groups: int
    generations_per_step: int
    uneven: bool
    fresh_groups: int
    unit: int
    k_rep: int
    k_rep_requested: int | None
    capacity: int
    notes: tuple[str, ...] = field(default=())

    @property
    def ratio(self) -> float:
        """Replayed : fresh groups per step."""
        return self.k_rep / self.fresh_groups if self.fresh_groups else math.inf

    @property
    def alpha(self) -> float:
        """Fresh share of a step's groups, |G_on| / |A_t| (paper, Proposition 1)."""
        return self.fresh_groups / (self.fresh_groups + self.k_rep)

    @property
    def replay_rows_per_process(self) -> int:
        return self.k_rep * self.n // self.world

    @property
    def grow_factor(self) -> float:
        """(fresh + replay rows) / fresh rows of one micro-step under ``replay_micro_step="grow"``."""
        fresh = self.per_device * self.spg
        return (fresh + self.replay_rows_per_process) / fresh

    def warn(self) -> None:
        for text in self.notes:
            warnings.warn(text, ReplaySettingWarning, stacklevel=3)


def plan_replay(*, world: int, per_device: int, ga: int, spg: int, iterations: int, n: int,
                k_rep: int | None, capacity: int, max_scan: int | None, selector: str,
                user_unit: int = 1, tau: float | None = None) -> ReplayPlan:
    """Work out F, u and K_rep; raise :class:`ReplayConfigError` for a setting that can never replay.

    Args mirror the TRL settings (``world`` = number of processes, ``user_unit`` = replay_truncate_multiple).
    """
    gen_groups = per_device * spg * world // n
    gs = spg * iterations
    per_step = max(1, ga // gs)
    uneven = gs < ga and ga % gs != 0
    fresh = gen_groups * per_step
    unit = math.lcm(world // math.gcd(n, world), user_unit)
    active = selector != "none"
    where = (f"(n={n} responses per group, W={world} processes, per_device_train_batch_size={per_device}, "
             f"gradient_accumulation_steps={ga}, steps_per_generation={spg}, num_iterations={iterations})")
    notes: list[str] = []
    if k_rep is None:
        k = (fresh // 2) // unit * unit
        if active and k == 0:
            raise ReplayConfigError(
                f"replay_k_rep: the default (half the {fresh} fresh groups of a replay step, cut to a multiple of "
                f"the truncation unit {unit}) is 0, so nothing would ever be replayed {where}. Set replay_k_rep to "
                f"a multiple of {unit}, or replay_selector='none'.", field="replay_k_rep")
    else:
        k = k_rep // unit * unit
        if active and 0 < k_rep < unit:
            raise ReplayConfigError(
                f"replay_k_rep={k_rep} is below the truncation unit {unit}: replayed groups are cut to a multiple "
                f"of {unit} (replay_truncate_multiple={user_unit} and W/gcd(n, W)={world // math.gcd(n, world)}, so "
                f"every process gets whole rows) and {k_rep} is always cut to 0 {where}. Set replay_k_rep to a "
                f"multiple of {unit}.", field="replay_k_rep")
        if active and k != k_rep:
            notes.append(f"replay_k_rep={k_rep} is not a multiple of the truncation unit {unit}: at most {k} groups "
                         f"are replayed per step {where}.")
    if active and k > capacity:
        raise ReplayConfigError(
            f"replay_k_rep={k} exceeds replay_capacity={capacity}: the buffer can never offer K_rep groups, so "
            f"the replay budget would stay at most {capacity / k:.2f} full for the whole run. Raise replay_capacity "
            f"to at least replay_k_rep (the paper keeps C = 512 >= 8 K_rep) or lower replay_k_rep.",
            field="replay_capacity")
    if active and n < 2:
        raise ReplayConfigError(
            "num_generations=1: a group of one response never has mixed outcomes, so no group would ever enter "
            "the replay buffer. Use num_generations >= 2 or replay_selector='none'.", field="replay_selector")
    if active and k > fresh:
        notes.append(f"replay_k_rep={k} is more than the {fresh} fresh groups of one replay step {where}: every "
                     f"update replays {k / fresh:.2f}x its fresh groups (fresh share alpha = {fresh / (fresh + k):.2f};"
                     f" the paper's b + b/2 is ratio {PAPER_RATIO}, alpha 0.67). On W processes the fresh groups "
                     "grow with W while replay_k_rep does not: size replay_k_rep for the number of processes you "
                     "run.")
    if active and max_scan is not None and max_scan < k:
        notes.append(f"replay_max_scan={max_scan} is below replay_k_rep={k}: at most {max_scan} groups are re-scored "
                     "per step, so the replay budget can never fill. Raise replay_max_scan or leave it unset.")
    if active and tau == 0 and SELECTORS[selector].gate:
        notes.append(f"replay_tau=0 with replay_selector={selector!r}: the Drift gate passes only groups whose "
                     "log-probs have not changed at all, i.e. none after the first update, so nothing will be "
                     "replayed. Use a tau > 0 (`hdreplay calibrate` sweeps it) or replay_selector='recency'.")
    if active and uneven:
        notes.append(f"spg * num_iterations = {gs} does not divide gradient_accumulation_steps={ga}: optimizer "
                     f"updates hold {per_step} or {per_step + 1} generations, so the fresh groups per replay step "
                     f"vary ({fresh} or {gen_groups * (per_step + 1)}); replay rows join the first generation of each "
                     "update.")
    return ReplayPlan(world=world, per_device=per_device, ga=ga, spg=spg, iterations=iterations, n=n,
                      generation_groups=gen_groups, generations_per_step=per_step, uneven=uneven, fresh_groups=fresh,
                      unit=unit, k_rep=k, k_rep_requested=k_rep, capacity=capacity, notes=tuple(notes))
