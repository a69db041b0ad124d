"""Entry point of the verl recipe: ``python -m hdreplay.integrations.verl.main <hydra overrides>``.

Composes ``config/hdr_trainer.yaml`` (verl's ``ppo_trainer.yaml`` + the ``hdr`` section), checks the
configuration before Ray starts, and runs verl's own ``run_ppo`` with a task runner that builds the
recipe's trainer and is otherwise verl's:

* ``trainer.use_v1=true`` (default): :class:`~.v1_trainer.HDRTaskRunnerV1` = verl's ``TaskRunnerV1.run``
  (TransferQueue, ``trainer.init()``, agent loop manager, ``fit``) with ``get_trainer_cls(trainer_mode)``
  answering the recipe's trainer for that mode;
* ``trainer.use_v1=false``: :class:`HDRTaskRunner` = verl's v0 ``TaskRunner.run`` building
  :class:`~.trainer.HDRRayPPOTrainer` instead of ``RayPPOTrainer``.
"""

from __future__ import annotations

import contextlib

import hydra
import ray
import verl.trainer.main_ppo_v0 as _v0
from verl.trainer.main_ppo import run_ppo
from verl.trainer.ppo.utils import need_critic, need_reference_policy
from verl.utils.config import validate_config
from verl.utils.device import auto_set_device

from .schema import register_hdr_schema
from .settings import validate_verl_config
from .trainer import HDRRayPPOTrainer

#: the undecorated class behind verl's ``@ray.remote class TaskRunner``
_STOCK_TASK_RUNNER = _v0.TaskRunner.__ray_actor_class__


@contextlib.contextmanager
def trainer_class(cls: type):
    """Make verl's v0 ``TaskRunner.run`` build ``cls`` (it resolves the module global ``RayPPOTrainer``)."""
    saved = _v0.RayPPOTrainer
    _v0.RayPPOTrainer = cls
    try:
        yield
    finally:
        _v0.RayPPOTrainer = saved


class HDRTaskRunner(_v0.BaseTaskRunner):
    """verl's v0 TaskRunner building :class:`HDRRayPPOTrainer` (runs inside its own Ray actor process)."""

    def run(self, config):
        validate_verl_config(config)
        with trainer_class(HDRRayPPOTrainer):
            return _STOCK_TASK_RUNNER.run(self, config)


def task_runner(config) -> type:
    """The Ray task-runner class for ``config`` (what ``run_ppo`` starts)."""
    if config.trainer.use_v1:
        from .v1_trainer import HDRTaskRunnerV1

        return ray.remote(num_cpus=1)(HDRTaskRunnerV1)
    return ray.remote(num_cpus=1)(HDRTaskRunner)


@hydra.main(config_path="config", config_name="hdr_trainer", version_base=None)
def _main(config) -> None:
    auto_set_device(config)
    validate_verl_config(config)  # fail before Ray and the GPUs are touched
    if config.trainer.use_v1:  # verl's own main validates here for v1 (v0's TaskRunner validates itself)
        validate_config(config=config, use_reference_policy=need_reference_policy(config),
                        use_critic=need_critic(config))
    run_ppo(config, task_runner_class=task_runner(config))


def main() -> None:
    """Register the ``hdr`` schema with Hydra, then compose and run (Hydra parses ``sys.argv``)."""
    register_hdr_schema()
    _main()


if __name__ == "__main__":
    main()
