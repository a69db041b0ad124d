"""Hypothesis programs of select / stage / commit / save / load (and refused calls) against a FIFO oracle.

The oracle keeps the live group ids (oldest first), the staged ids, each group's replay count and the
last committed step; after every rule the controller must agree with it, and a refused call must leave
the controller's state hash unchanged."""

import copy
import shutil
import tempfile
from pathlib import Path

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from hdreplay import ReplayConfig, ReplayController, ReplayError
from hdreplay_lab.synthetic import make_group
from protocol import policy_at, state_hash

C = 5


class Oracle:
    def __init__(self):
        self.live, self.staged, self.uses, self.last_step = [], [], {}, None

    def commit(self, step, accepted):
        for g in accepted:
            self.uses[g] += 1
        for g in self.staged:
            self.uses[g] = 0
        self.live = (self.live + self.staged)[-C:]
        self.uses = {g: self.uses[g] for g in self.live}
        self.staged, self.last_step = [], step


class ProtocolMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.cfg = ReplayConfig(k_rep=2, tau=5e-3, capacity=C, group_size=4)
        self.ctrl = ReplayController(self.cfg)
        self.oracle = Oracle()
        self.step, self.open, self.selected, self.serial = 0, False, False, 0
        self.dir = Path(tempfile.mkdtemp())
        self.saved = None  # (oracle, state hash) of the last save

    def teardown(self):
        shutil.rmtree(self.dir, ignore_errors=True)

    def _group(self, mixed, birth=None):
        self.serial += 1
        rewards = None if mixed else [1.0, 1.0, 1.0, 1.0]
        step = self.step if birth is None else birth
        return make_group(f"g{self.serial}", policy=policy_at(min(step, 12)), step=step, seed=self.serial,
                          rewards=rewards, n=4)

    @precondition(lambda self: not self.selected)
    @rule()
    def select(self):
        before = list(self.oracle.live)
        sel = self.ctrl.select(step=self.step, scorer=policy_at(min(self.step, 12)).scorer)
        ids = [g.group_id for g in sel.groups]
        assert set(ids) <= set(before) and len(ids) <= self.cfg.k_rep
        assert all(g.birth_step < self.step for g in sel.groups)
        h = state_hash(self.ctrl)
        for g in sel.groups:  # what was handed out is a copy
            g.advantages.mul_(-3.0)
            g.logprobs.zero_()
        assert state_hash(self.ctrl) == h
        self.accepted, self.selected, self.open = ids, True, True

    @rule(mixed=st.lists(st.booleans(), max_size=3))
    def stage(self, mixed):
        groups = [self._group(m) for m in mixed]
        admitted = self.ctrl.stage(groups, step=self.step)
        assert admitted == mixed  # MixedOutcome: all-equal rewards are not admitted
        self.oracle.staged += [g.group_id for g, ok in zip(groups, admitted) if ok]
        h = state_hash(self.ctrl)
        for g in groups:  # editing a staged group afterwards changes nothing held
            g.advantages.mul_(5.0)
        assert state_hash(self.ctrl) == h
        self.open = True

    @precondition(lambda self: self.open)
    @rule(gap=st.integers(1, 3))
    def commit(self, gap):
        self.ctrl.commit()
        self.oracle.commit(self.step, self.accepted if self.selected else [])
        self.step += gap
        self.open = self.selected = False

    @precondition(lambda self: not self.open)
    @rule()
    def save(self):
        self.ctrl.save(self.dir / "ck")
        self.saved = (copy.deepcopy(self.oracle), state_hash(self.ctrl))

    @precondition(lambda self: not self.open and self.saved is not None)
    @rule(fresh=st.booleans())
    def load(self, fresh):
        target = ReplayController(self.cfg) if fresh else self.ctrl
        target.load(self.dir / "ck")
        self.ctrl, self.oracle = target, copy.deepcopy(self.saved[0])
        assert state_hash(self.ctrl) == self.saved[1]
        self.step = (self.oracle.last_step if self.oracle.last_step is not None else -1) + 1

    @rule(kind=st.sampled_from(["late_step", "huge_step", "wrong_birth", "duplicate", "bad_fresh_count",
                                "second_select", "float_step", "bad_scorer"]))
    def refused(self, kind):
        before = state_hash(self.ctrl)
        calls = {
            "late_step": lambda: self.ctrl.stage([], step=self.oracle.last_step if self.oracle.last_step is not None
                                                 else -1),
            "huge_step": lambda: self.ctrl.select(step=2**53, scorer=None),
            "wrong_birth": lambda: self.ctrl.stage([self._group(True, birth=self.step + 1)], step=self.step),
            "duplicate": lambda: self.ctrl.stage([self._group(True)] * 2, step=self.step),
            "bad_fresh_count": lambda: self.ctrl.commit(num_fresh_groups=-1),
            "second_select": lambda: self.ctrl.select(step=self.step + (0 if self.selected else 10**6), scorer=None)
            if self.selected else self.ctrl.select(step=-1),
            "float_step": lambda: self.ctrl.select(step=float(self.step), scorer=None),
            "bad_scorer": lambda: self.ctrl.select(step=self.step,
                                                   scorer=lambda gs: [g.logprobs.abs() + 0.5 for g in gs])
            if self.oracle.live and not self.selected else self.ctrl.select(step=self.step, scorer=3),
        }
        with pytest.raises(ReplayError):
            calls[kind]()
        assert state_hash(self.ctrl) == before

    @invariant()
    def agrees_with_the_oracle(self):
        buf = self.ctrl.buffer
        ids = buf.insertion_ids()
        assert [buf.group_id(int(i)) for i in ids] == self.oracle.live
        assert buf.slot_values("replay_count", ids).tolist() == [self.oracle.uses[g] for g in self.oracle.live]
        assert self.ctrl.last_step == self.oracle.last_step
        assert [g.group_id for g in self.ctrl._staged] == self.oracle.staged


TestProtocolMachine = ProtocolMachine.TestCase
TestProtocolMachine.settings = settings(max_examples=25, stateful_step_count=30, deadline=None, derandomize=True)
