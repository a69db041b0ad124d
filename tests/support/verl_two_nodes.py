"""Both verl recipes on a two-node Ray cluster on this machine, all bound to 127.0.0.1
(tests/verl/test_verl_two_nodes.py).

Run as a script in its own process, so the test session's one-node ``ray.init`` (tests/verl/conftest.py) is never
touched: ``python tests/support/verl_two_nodes.py <tiny model dir> <out dir>`` writes ``<out>/results.pt``.

* The cluster (:func:`two_node_cluster`): ``ray.cluster_utils.Cluster``, a head and a second raylet, each declaring
  one logical GPU (there are none: a Ray resource, as ``num_gpus`` is on a GPU node) so that verl's own
  ``ResourcePoolManager({"global_pool": [1, 1]})`` -- what verl's task runner builds for ``trainer.nnodes=2
  trainer.n_gpus_per_node=1`` -- places its dp = 2 workers one per node, as the GPUs do on a GPU cluster.  On CPU a
  bundle is ``{"CPU": ...}`` only and nothing else would keep both workers off one node.  The workers are the CPU
  test workers (``verl_cpu_worker``, gloo across the two raylets), each reporting its node from inside.
* The trainer runs in a :class:`Driver` actor pinned to a chosen node: the process verl's ``TaskRunner`` is, which
  writes ``data.pt``, the marker and ``hdreplay/`` while the workers write ``actor/`` on theirs.
* Phase 1, driver on the head node: v0 (``HDRRayPPOTrainer``) and v1 (``HDRPPOTrainerSync``) train 4 steps each,
  checkpoints at steps 2 and 4.  The cluster is then shut down (every process of both nodes gone).
* Phase 2, a fresh two-node cluster, driver on the *second* node: a resume from a step folder as a node-local disk
  would show it to that driver (verl's ``actor/`` there, no ``hdreplay/``), or from a folder absent on its node,
  is refused; then both recipes resume from ``global_step_2`` and train steps 3-4.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import time
from contextlib import contextmanager

# Ray resolves 127.0.0.1 to the machine's address unless told this is a one-machine cluster (read at import)
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")

import ray  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
STEPS, LR = 4, 0.1
TAU = 0.08  # splits the scanned groups' Drift at lr 0.1 (tests/verl/test_verl_v1_trainer.py)
RUN = ("trainer.nnodes=2", "trainer.n_gpus_per_node=1", "hdr.k_rep=4", f"hdr.tau={TAU}",
       "actor_rollout_ref.actor.use_kl_loss=false", "actor_rollout_ref.rollout.temperature=0.7")
FIRST = (*RUN, "trainer.save_freq=2")
RESUMED = (*RUN, "trainer.resume_mode=resume_path")


@contextmanager
def two_node_cluster(cpus_per_node: int = 6):
    """A head and a second raylet on 127.0.0.1, one logical GPU each; yields ``(cluster, [head id, second id])`` and
    shuts both nodes down on exit.  Logical CPUs: a verl bundle (3) + the driver + TransferQueue's two actors."""
    from ray.cluster_utils import Cluster

    node = {"num_cpus": cpus_per_node, "num_gpus": 1, "node_ip_address": "127.0.0.1"}
    cluster = Cluster(initialize_head=True, head_node_args={**node, "include_dashboard": False})
    second = cluster.add_node(**node)
    cluster.wait_for_nodes()
    env = {"PYTHONPATH": os.pathsep.join(p for p in (HERE, os.environ.get("PYTHONPATH", "")) if p),
           "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    ray.init(address=cluster.address, log_to_driver=False, runtime_env={"env_vars": env})
    try:
        yield cluster, [cluster.head_node.node_id, second.node_id]
    finally:
        ray.shutdown()
        cluster.shutdown()


def on_node(node_id: str):
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    return NodeAffinitySchedulingStrategy(node_id=node_id, soft=False)


def _plain(x):
    """The metrics that must match across runs, as floats (v0's ``actor/pg_loss``: one per mini-batch)."""
    num = lambda v: [float(e) for e in v] if isinstance(v, (list, tuple)) else float(v)  # noqa: E731
    return {k: num(v) for k, v in x.items() if k.startswith("replay/") or k == "actor/pg_loss"}


def _content(value, key):
    """``value`` with every group id replaced by its (birth step, prompt token ids): uids are fresh per run."""
    if isinstance(value, str):
        return key.get(value, value)
    if isinstance(value, dict):
        return {k: _content(v, key) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_content(v, key) for v in value]
    return value


def summarize(trainer, steps, metrics, records) -> dict:
    """What a run did, by content: per step the scanned groups, gate outcomes, Drifts, replayed groups and batch
    lengths; the step metrics; per update and rank what each mini-batch trained and its losses; the replay state."""
    buf = trainer.replay.buffer
    key = {str(g.group_id): (int(g.birth_step), tuple(g.prompt_ids.tolist()))
           for g in buf.get(buf.insertion_ids().tolist())}  # capacity 16 > 12 groups: every group of the run
    out_steps = []
    for s in steps:
        sel = s["selection"]
        out_steps.append({"step": int(s["step"]), "scanned": _content([str(i) for i in sel.scanned_group_ids], key),
                          "passed": sel.scanned_pass.tolist(), "drift": sel.scanned_drift.tolist(),
                          "replayed": _content([str(g.group_id) for g in sel.groups], key),
                          "lengths": list(s["lengths"]), "replay_rows": int(s["num_replay_rows"])})
    trained = [[[{"responses": mb["responses"], "old_lp_sum": mb["old_lp_sum"], "adv_first": mb["adv_first"],
                  "loss": [m["loss"] for m in mb.get("micro", [])]} for mb in update]
                for update in rank["history"]] for rank in records]  # [rank][update][mini-batch]
    tensors, meta = trainer.replay.state_dict()
    return {"steps": out_steps, "metrics": [_plain(m) for m in metrics], "trained": trained,
            "state": ({k: v.clone() for k, v in tensors.items()}, _content(meta, key))}


@ray.remote(num_cpus=1)
class Driver:
    """The trainer's process (verl's ``TaskRunner``): builds the worker group through verl's resource pool and runs
    the recipes on it.  Placed on a node by the caller."""

    def __init__(self, model_dir: str):
        from verl.single_controller.ray import RayClassWithInitArgs, RayWorkerGroup
        from verl.single_controller.ray.base import ResourcePoolManager
        from verl.trainer.ppo.utils import Role

        import verl_cpu_worker
        import verl_helpers

        self.model_dir = model_dir
        cfg = verl_helpers.compose_config()
        # verl's task runner: resource_pool_spec = {global_pool: [n_gpus_per_node] * nnodes}, its default colocation
        rpm = ResourcePoolManager(resource_pool_spec={"global_pool": [1, 1]},
                                  mapping={Role.ActorRollout: "global_pool"})
        rpm.create_resource_pool()
        cls = RayClassWithInitArgs(cls=ray.remote(verl_cpu_worker.CPUActorWorker), model_dir=model_dir,
                                   actor_config=cfg.actor_rollout_ref.actor,
                                   infer_micro_batch=cfg.actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu)
        self.wg = RayWorkerGroup(resource_pool=rpm.get_resource_pool(Role.ActorRollout), ray_cls_with_init=cls,
                                 device_name="cpu")
        self.wg.init_model()
        self.tq = None

    def placement(self) -> dict:
        return {"driver": ray.get_runtime_context().get_node_id(), "workers": self.wg.node_id()}

    def _transfer_queue(self):
        if self.tq is None:  # as verl's v1 task runner does, in this process
            import transfer_queue as tq

            from verl_v1_harness import compose_v1_config

            tq.init(compose_v1_config(ckpt_dir="/tmp/unused", model_dir=self.model_dir).transfer_queue)
            self.tq = tq
        return self.tq

    def close(self):
        if self.tq is not None:
            self.tq.close()

    # ------------------------------------------------------------------ the recipes
    def run_v0(self, ckpt: str, *overrides: str) -> dict:
        from hdreplay.integrations.verl import HDRRayPPOTrainer
        from verl_helpers import compose_config, make_trainer

        class Recording(HDRRayPPOTrainer):
            def __init__(self, *a, **k):
                super().__init__(*a, **k)
                self.steps, self.step_metrics = [], []

            def _update_actor(self, batch):
                out = super()._update_actor(batch)
                self.steps.append(self.last_replay)
                self.step_metrics.append(dict(out.meta_info["metrics"]))
                return out

            def _load_checkpoint(self):
                out = super()._load_checkpoint()
                self.async_rollout_manager.calls = self.global_steps  # the stub rollout draws by step
                return out

        cfg = compose_config(*overrides, f"trainer.total_training_steps={STEPS}", ckpt_dir=ckpt)
        self.wg.reset(lr=LR, actor_config=cfg.actor_rollout_ref.actor)
        trainer = make_trainer(Recording, cfg, self.wg)
        trainer.fit()
        return {**summarize(trainer, trainer.steps, trainer.step_metrics, self.wg.get_records()),
                "weights": self.wg.state_dict()}

    def run_v1(self, ckpt: str, *overrides: str) -> dict:
        from hdreplay.integrations.verl import HDRPPOTrainerSync
        from hdreplay_lab.sandbox.model import build_tokenizer
        from verl_v1_harness import run_v1

        self._transfer_queue()
        run = run_v1(HDRPPOTrainerSync, self.wg, build_tokenizer(), self.model_dir, ckpt, *overrides, lr=LR,
                     steps=STEPS)
        return {**summarize(run.trainer, run.trainer.steps, run.trainer.logged, run.records),
                "resumed_at": run.trainer.resumed_at, "weights": self.wg.state_dict()}

    # ------------------------------------------------------------------ a driver without the replay state
    def refuse(self, recipe: str, folder: str) -> dict:
        """Resume ``recipe`` ("v0" / "v1") from ``folder`` (resume_path); what was raised and what changed: the
        workers' weights (reset to the initial model first), the trainer's step, the files under ``folder``."""
        from hdreplay.integrations.verl import HDRPPOTrainerSync, HDRRayPPOTrainer
        from hdreplay_lab.sandbox.model import build_tokenizer
        from verl_helpers import compose_config, make_trainer
        from verl_v1_harness import compose_v1_config, make_v1_trainer

        overrides = (*RESUMED, f"trainer.resume_from_path={folder}")
        ckpt = os.path.dirname(folder)
        cfg = compose_config(*overrides, ckpt_dir=ckpt) if recipe == "v0" else \
            compose_v1_config(*overrides, ckpt_dir=ckpt, model_dir=self.model_dir)
        self.wg.reset(lr=LR, actor_config=cfg.actor_rollout_ref.actor)
        before, files = self.wg.state_dict(), _files(ckpt)
        trainer, error = None, None
        try:
            if recipe == "v0":
                trainer = make_trainer(HDRRayPPOTrainer, cfg, self.wg)
                trainer.global_steps = 0  # what fit() does, then loads the checkpoint
                trainer._load_checkpoint()
            else:
                self._transfer_queue()
                make_v1_trainer(HDRPPOTrainerSync, cfg, self.wg, build_tokenizer())  # _load_checkpoint() inside
        except Exception as e:  # noqa: BLE001 - returned to the test, which names what it expects
            error = (type(e).__name__, str(e))
        after = self.wg.state_dict()
        return {"error": error, "files_unchanged": _files(ckpt) == files,
                "weights_unchanged": all(all(bool((a[k] == b[k]).all()) for k in a) for a, b in zip(before, after)),
                "global_steps": None if trainer is None else int(trainer.global_steps),
                "buffer": None if trainer is None else len(trainer.replay.buffer)}


def _files(root: str) -> dict:
    out = {}
    for d, _, names in os.walk(root):
        for n in names:
            with open(os.path.join(d, n), "rb") as f:
                out[os.path.relpath(os.path.join(d, n), root)] = f.read()
    return out


def node_local_view(ckpt: str, view: str) -> str:
    """``global_step_2`` as the second node's disk holds it with a node-local ``default_local_dir`` after a run whose
    driver ran on the head: what verl's workers wrote (``actor/``), none of the driver's files (``data.pt``, the
    marker, ``hdreplay/``, ``hdreplay_run.json``)."""
    folder = os.path.join(view, "global_step_2")
    shutil.copytree(os.path.join(ckpt, "global_step_2", "actor"), os.path.join(folder, "actor"))
    return folder


def main(model_dir: str, out: str) -> None:
    results, t0, seconds = {}, time.monotonic(), {}

    def lap(name):  # wall seconds of each part (reported, never asserted)
        seconds[name] = round(time.monotonic() - t0 - sum(seconds.values()), 1)

    ckpt = {r: os.path.join(out, f"ckpt_{r}") for r in ("v0", "v1")}
    with two_node_cluster() as (cluster, nodes):
        lap("cluster_1")
        driver = Driver.options(scheduling_strategy=on_node(nodes[0])).remote(model_dir)
        results["first"] = {"nodes": nodes, "placement": ray.get(driver.placement.remote())}
        lap("driver_and_workers_1")
        for r in ("v0", "v1"):
            results["first"][r] = ray.get(getattr(driver, f"run_{r}").remote(ckpt[r], *FIRST))
            lap(f"{r}_4_steps")
        ray.get(driver.close.remote())
        first_nodes = list(cluster.list_all_nodes())
    results["torn_down"] = not any(n.any_processes_alive() for n in first_nodes)
    lap("teardown_1")
    view = node_local_view(ckpt["v0"], os.path.join(out, "node_b_view"))
    with two_node_cluster() as (cluster, nodes):
        lap("cluster_2")
        driver = Driver.options(scheduling_strategy=on_node(nodes[1])).remote(model_dir)
        results["resumed"] = {"nodes": nodes, "placement": ray.get(driver.placement.remote())}
        lap("driver_and_workers_2")
        absent = os.path.join(out, "absent", "global_step_2")
        results["refused"] = {"v0_node_local": ray.get(driver.refuse.remote("v0", view)),
                              "v0_absent": ray.get(driver.refuse.remote("v0", absent)),
                              "v1_node_local": ray.get(driver.refuse.remote("v1", view))}
        lap("refusals")
        for r in ("v0", "v1"):
            resume = f"trainer.resume_from_path={ckpt[r]}/global_step_2"
            results["resumed"][r] = ray.get(getattr(driver, f"run_{r}").remote(ckpt[r], *RESUMED, resume))
            lap(f"{r}_resumed_2_steps")
        ray.get(driver.close.remote())
    lap("teardown_2")
    results["seconds"] = seconds
    import torch

    torch.save(results, os.path.join(out, "results.pt"))
    print("seconds:", seconds, "total", round(time.monotonic() - t0, 1), flush=True)


if __name__ == "__main__":
    model_dir, out = sys.argv[1], sys.argv[2]
    # Ray's session files (and its cluster-address file) under a private directory, short enough for its sockets
    tmp = tempfile.mkdtemp(prefix="hdr2n", dir="/tmp")
    os.environ["RAY_TMPDIR"] = tmp
    os.environ.pop("RAY_ADDRESS", None)  # never join another cluster
    try:
        main(model_dir, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
