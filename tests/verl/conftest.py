"""Fixtures of the verl recipe tests, shared by the v0 and v1 tests: one local Ray, one TransferQueue
(v1), and one CPU worker group (dp=2) per session (starting them takes ~1 min on 2 cores)."""

import logging
import os
import warnings

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("RAY_DEDUP_LOGS", "0")
# Ray's servers on 127.0.0.1: a local ray.init() otherwise listens on every interface at the machine's address (Ray
# reads this when it is imported, i.e. before the test modules import verl)
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")

#: warnings verl 0.9.1 / ray / torchdata emit on every import or trainer construction (not ours)
FRAMEWORK_WARNINGS = (
    r"ignore:.* engine is not available:UserWarning",
    r"ignore:.*RayPPOTrainer' is deprecated:FutureWarning",
    r"ignore:Disabled critic as algorithm.adv_estimator:UserWarning",
    r"ignore:'set_vital' is deprecated:UserWarning",
    r"ignore:Ray state API is no longer experimental:DeprecationWarning",
)
DP = 2
HERE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "support")


def pytest_configure(config):
    for line in FRAMEWORK_WARNINGS:
        config.addinivalue_line("filterwarnings", line)
    # TransferQueue warns on every client call that it uses 2 threads on this 2-core machine
    logging.getLogger("transfer_queue").setLevel(logging.ERROR)


_CATEGORIES = {"UserWarning": UserWarning, "FutureWarning": FutureWarning, "DeprecationWarning": DeprecationWarning}
for _line in FRAMEWORK_WARNINGS:  # the same, for warnings raised while test modules import verl (collection)
    _, _msg, _cat = _line.split(":", 2)
    warnings.filterwarnings("ignore", message=_msg, category=_CATEGORIES[_cat])


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """A tiny random Qwen2 + char tokenizer saved with save_pretrained (workers load it with from_pretrained)."""
    from hdreplay_lab.sandbox.model import build_tiny_model

    return str(build_tiny_model(tmp_path_factory.mktemp("tiny_qwen2"), hidden=32, layers=2, seed=0))


@pytest.fixture(scope="session")
def ray_cluster():
    ray = pytest.importorskip("ray")
    env = {k: os.environ[k] for k in ("HF_HUB_OFFLINE", "TOKENIZERS_PARALLELISM")}
    # Ray workers unpickle the test Worker class by module name: put tests/support on their path
    env["PYTHONPATH"] = os.pathsep.join(p for p in (HERE, os.environ.get("PYTHONPATH", "")) if p)
    env["OMP_NUM_THREADS"] = "1"
    # logical CPUs: DP workers + TransferQueue's controller and storage actors (1 CPU each) + the task runner
    ray.init(num_cpus=DP + 3, include_dashboard=False, log_to_driver=False, runtime_env={"env_vars": env})
    yield ray
    ray.shutdown()


@pytest.fixture(scope="session")
def transfer_queue(ray_cluster, tiny_model_dir):
    """TransferQueue (controller + one SimpleStorage unit) as verl's v1 TaskRunner starts it."""
    tq = pytest.importorskip("transfer_queue")
    from verl_v1_harness import compose_v1_config

    tq.init(compose_v1_config(ckpt_dir="/tmp/unused", model_dir=tiny_model_dir).transfer_queue)
    yield tq
    tq.close()


@pytest.fixture(scope="session")
def tokenizer():
    from hdreplay_lab.sandbox.model import build_tokenizer

    return build_tokenizer()


@pytest.fixture(scope="session")
def worker_group(ray_cluster, tiny_model_dir):
    """RayWorkerGroup(use_gpu=False) of DP CPUActorWorkers sharing one gloo process group."""
    from verl.single_controller.ray import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup

    import verl_cpu_worker
    import verl_helpers

    cfg = verl_helpers.compose_config()
    pool = RayResourcePool([DP], use_gpu=False, max_colocate_count=1)
    cls = RayClassWithInitArgs(cls=ray_cluster.remote(verl_cpu_worker.CPUActorWorker), model_dir=tiny_model_dir,
                               actor_config=cfg.actor_rollout_ref.actor,
                               infer_micro_batch=cfg.actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu)
    wg = RayWorkerGroup(resource_pool=pool, ray_cls_with_init=cls, device_name="cpu")
    wg.init_model()
    yield wg
    for w in wg.workers:
        ray_cluster.kill(w)
    for pg in pool.pgs or []:
        ray_cluster.util.remove_placement_group(pg)
