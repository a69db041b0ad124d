"""What the writer-lock tests save and load: one small configuration, the controller after ``steps`` steps, and the
state a directory loads (its hash, or None where it does not load)."""

from hdreplay import CheckpointError, ReplayConfig, ReplayController
from protocol import run_steps, state_hash

CFG = ReplayConfig(k_rep=3, tau=5e-3, capacity=12, group_size=4)


def controller(steps):
    return run_steps(ReplayController(CFG), range(steps), k=4)


def loaded_hash(path):
    ctrl = ReplayController(CFG)
    try:
        ctrl.load(path)
    except CheckpointError:
        return None
    return state_hash(ctrl)
