"""The packaged Hydra config, start-time validation, the task runner and the entry point (no Ray)."""

import math
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.verl
pytest.importorskip("verl", minversion="0.9.1")

from hydra import compose, initialize_config_module  # noqa: E402

from hdreplay.errors import ReplayConfigError  # noqa: E402
from hdreplay.integrations.verl import (  # noqa: E402
    HDRRayPPOTrainer,
    HDRSettings,
    validate_verl_config,
    verl_truncate_multiple,  # noqa: E402
)
from hdreplay.integrations.verl.schema import register_hdr_schema  # noqa: E402
from verl_helpers import compose_config, make_trainer  # noqa: E402

ACTOR = "actor_rollout_ref.actor"


def test_packaged_yaml_composes_verls_ppo_trainer_with_the_hdr_section():
    cfg = compose_config()
    assert cfg.trainer.use_v1 is False and cfg.algorithm.adv_estimator == "grpo"
    assert cfg.actor_rollout_ref.actor.shuffle is False and cfg.actor_rollout_ref.actor.ppo_epochs == 1
    assert cfg.actor_rollout_ref.actor.clip_ratio == 0.2  # verl's own defaults are there
    assert set(cfg.hdr) >= {"selector", "k_rep", "tau", "capacity", "drift_norm", "headroom_weighting", "ingress"}
    s = validate_verl_config(cfg)
    rc = s.replay_config
    assert (rc.selector, rc.k_rep, rc.tau, rc.capacity, rc.group_size) == ("headroom_drift", 4, 1e-3, 16, 4)
    assert s.unit == 2 and rc.truncate_multiple == 2  # u = ppo_mini_batch_size in groups


def test_packaged_default_is_the_v1_recipe_with_a_one_group_unit():
    register_hdr_schema()
    with initialize_config_module("hdreplay.integrations.verl.config", version_base=None):
        cfg = compose(config_name="hdr_trainer", overrides=[f"{ACTOR}.ppo_mini_batch_size=64",
                                                            "actor_rollout_ref.rollout.n=16"])
    assert cfg.trainer.use_v1 is True and cfg.trainer.v1.trainer_mode == "sync"
    s = validate_verl_config(cfg)
    assert s.v1 and s.unit == 1 and s.replay_config.truncate_multiple == 1  # v0 would cut to 64 groups
    # the packaged diagnostics_dir interpolates verl's checkpoint dir (resolved against the whole config)
    assert s.diagnostics_dir == "checkpoints/verl_examples/gsm8k/hdreplay_diagnostics"


@pytest.mark.parametrize("v1,u", [(False, 64), (True, 1)])
def test_paper_math_configuration_resolves(v1, u):
    cfg = compose_config("data.train_batch_size=256", "actor_rollout_ref.rollout.n=16",
                         f"{ACTOR}.ppo_mini_batch_size=64", "trainer.n_gpus_per_node=8", "hdr.k_rep=128",
                         "hdr.tau=1e-3", "hdr.capacity=512", v1=v1)
    rc = validate_verl_config(cfg).replay_config
    assert (rc.k_rep, rc.tau, rc.capacity, rc.truncate_multiple, rc.group_size) == (128, 1e-3, 512, u, 16)


def test_search_r1_configuration_resolves():
    cfg = compose_config("data.train_batch_size=128", "actor_rollout_ref.rollout.n=5",
                         f"{ACTOR}.ppo_mini_batch_size=32", "trainer.n_gpus_per_node=8", f"{ACTOR}.use_kl_loss=true",
                         "actor_rollout_ref.rollout.multi_turn.enable=true",
                         "actor_rollout_ref.rollout.agent.default_agent_loop=tool_agent",
                         "hdr.k_rep=64", "hdr.tau=1e-2", "hdr.capacity=512")
    rc = validate_verl_config(cfg).replay_config
    assert (rc.k_rep, rc.tau, rc.capacity, rc.truncate_multiple, rc.group_size) == (64, 1e-2, 512, 32, 5)


@pytest.mark.parametrize("mbs,n,dp,u", [(64, 16, 8, 64), (2, 4, 2, 2), (3, 2, 4, 6), (1, 3, 2, 2), (5, 1, 1, 5)])
def test_truncation_unit_fills_whole_minibatches_on_every_rank(mbs, n, dp, u):
    assert verl_truncate_multiple(ppo_mini_batch_size=mbs, n=n, dp=dp) == u
    need = math.lcm(mbs * n, dp)  # rows that fill whole mini-batches and split over dp ranks
    assert (u * n) % need == 0 and all((v * n) % need for v in range(1, u))  # and u is the smallest


def test_user_truncate_multiple_is_folded_with_the_minibatch_unit():
    cfg = compose_config("hdr.truncate_multiple=3", "hdr.k_rep=12")
    assert HDRSettings.from_config(cfg).replay_config.truncate_multiple == 6


@pytest.mark.parametrize("override,match", [
    (f"{ACTOR}.shuffle=true", f"{ACTOR}.shuffle"),
    (f"{ACTOR}.ppo_epochs=2", f"{ACTOR}.ppo_epochs"),
    ("algorithm.filter_groups.enable=true", "algorithm.filter_groups.enable=true with trainer.use_v1=false"),
    ("algorithm.adv_estimator=gae", "algorithm.adv_estimator=gae"),
    ("critic.enable=true", "critic.enable"),
    ("algorithm.rollout_correction.bypass_mode=true", "algorithm.rollout_correction.bypass_mode=true"),
    (f"{ACTOR}.use_prefix_grouper=true", "use_prefix_grouper"),
    ("distillation.enabled=true", "distillation.enabled"),
    ("actor_rollout_ref.rollout.n=1", "rollout.n"),
    ("data.train_batch_size=5", "data.train_batch_size"),
    ("hdr.k_rep=1", "hdr.k_rep"),
    ("hdr.tau=-1", "hdr.tau"),
    ("hdr.selector=bogus", "hdr.selector"),
    ("hdr.drift_norm=l3", "hdr.drift_norm"),
    ("hdr.ingress=answer", "hdr.answer_threshold"),
    ("hdr.adaptive_tau.tau_min=0.5", "hdr.adaptive_tau"),
])
def test_incompatible_configuration_is_rejected_naming_the_key(override, match):
    with pytest.raises(ReplayConfigError, match=match.replace(".", r"\.").replace("=", "=")):
        validate_verl_config(compose_config(override))


@pytest.mark.parametrize("override,match", [
    # rollout_is is supported (decoupled mode, below); bypass_mode is supported on v1 (tests/verl/test_verl_v1_async.py:
    # accepted, and refused with a loss that never reads old_log_probs or without rollout log-probs)
    ("trainer.v1.trainer_mode=bogus", "trainer.v1.trainer_mode=bogus"),
    (f"{ACTOR}.shuffle=true", f"{ACTOR}.shuffle"),
    ("critic.enable=true", "critic.enable"),
])
def test_v1_recipe_refuses_what_replay_rows_cannot_honour(override, match):
    with pytest.raises(ReplayConfigError, match=match.replace(".", r"\.")):
        validate_verl_config(compose_config(override, v1=True))


def test_v1_recipe_keeps_verls_own_sampling_staleness_and_rejection_settings():
    """DAPO filtering, the staleness bound and rollout rejection sampling act on fresh rows before the seam;
    k_rep below the mini-batch is fine on v1 (unit 1 group) but refused on v0."""
    keep = ("algorithm.filter_groups.enable=true", "trainer.v1.sampler.max_off_policy_threshold=2",
            "trainer.v1.sampler.max_off_policy_strategy=wait", "algorithm.rollout_correction.rollout_rs=token_k1",
            "hdr.k_rep=1")
    s = validate_verl_config(compose_config(*keep, v1=True))
    assert s.active and s.replay_config.k_rep == 1 and s.replay_config.truncate_multiple == 1
    with pytest.raises(ReplayConfigError) as e:
        validate_verl_config(compose_config(*keep, v1=False))
    assert "filter_groups" in str(e.value) and "hdr.k_rep=1" in str(e.value)
    assert "rollout_correction" not in str(e.value)  # rejection sampling acts before the seam on v0 too


RC = "algorithm.rollout_correction"


@pytest.mark.parametrize("v1", [False, True])
@pytest.mark.parametrize("overrides", [
    (f"{RC}.rollout_is=token",), (f"{RC}.rollout_is=sequence", f"{RC}.rollout_is_threshold=5.0"),
    (f"{RC}.rollout_is=token", f"{RC}.rollout_is_threshold=0.5_2.0"),  # IcePop bounds
    (f"{RC}.rollout_is=sequence", f"{RC}.rollout_rs=seq_mean_k3", f"{RC}.rollout_rs_threshold=0.01"),
])
def test_rollout_importance_sampling_in_decoupled_mode_is_accepted(overrides, v1):
    """Replayed rows carry their birth rollout_is_weights (test_verl_rollout_is.py), so rollout_is runs with replay."""
    assert validate_verl_config(compose_config(*overrides, v1=v1)).active


@pytest.mark.parametrize("v1", [False, True])
@pytest.mark.parametrize("overrides,needles", [
    ((f"{RC}.rollout_is=token", "actor_rollout_ref.rollout.calculate_log_probs=false"),
     ("calculate_log_probs=false", "calculate_log_probs=true", f"{RC}.rollout_is=null")),
    ((f"{RC}.rollout_is=sequence", f"{RC}.rollout_is_batch_normalize=true"),
     (f"{RC}.rollout_is_batch_normalize=true", f"{RC}.rollout_is_batch_normalize=false")),
])
def test_rollout_correction_without_a_birth_time_meaning_is_refused_naming_setting_and_fix(overrides, needles, v1):
    with pytest.raises(ReplayConfigError) as e:
        validate_verl_config(compose_config(*overrides, v1=v1))
    assert all(x in str(e.value) for x in needles), str(e.value)
    # without replay verl's own settings are not the recipe's business
    assert not validate_verl_config(compose_config(*overrides, "hdr.selector=none", v1=v1)).active


def test_bypass_mode_is_refused_on_v0_naming_setting_and_fix():
    """v0 has no asynchronous path: bypass mode would measure Drift against the engine's log-probs (v1 accepts it,
    tests/verl/test_verl_v1_async.py)."""
    with pytest.raises(ReplayConfigError) as e:
        validate_verl_config(compose_config(f"{RC}.bypass_mode=true", v1=False))
    assert f"{RC}.bypass_mode=true" in str(e.value) and f"{RC}.bypass_mode=false" in str(e.value), str(e.value)


@pytest.mark.parametrize("override,needle", [("hdr.typo_key=1", "typo_key"), ("hdr.k_rep=many", "many"),
                                             ("hdr.adaptive_tau.taumin=1", "taumin")])
def test_unknown_keys_and_wrong_types_are_refused_by_the_schema_at_compose_time(override, needle):
    from hydra.errors import ConfigCompositionException

    with pytest.raises(ConfigCompositionException, match=needle):  # Hydra itself, before anything runs
        compose_config(override)


@pytest.mark.parametrize("override", ["hdr.counterfactual=maybe", "hdr.diagnose_ungated=2", "hdr.counterfactual=0",
                                      "hdr.resume_without_state=yes", "hdr.adaptive_tau.enabled=1"])
def test_a_boolean_knob_takes_true_or_false_only(override):
    """OmegaConf reads 2 (and 0, 'yes', ...) as a bool; the recipe refuses them naming the key."""
    key, value = override.split("=")
    with pytest.raises(ReplayConfigError, match=rf"{key}: must be true or false, got '?{value}'?"):
        validate_verl_config(compose_config(override))
    assert validate_verl_config(compose_config(f"{key}=true")) is not None


def _hand_built(**edits):
    from omegaconf import OmegaConf

    raw = OmegaConf.to_container(compose_config(), resolve=False)
    for dotted, v in edits.items():
        *path, last = dotted.split("__")
        cur = raw
        for p in path:
            cur = cur[p]
        cur[last] = v
    return OmegaConf.create(raw)


@pytest.mark.parametrize("edit,needle", [
    ({"hdr": [1, 2]}, "hdr: must be a mapping"), ({"hdr": "headroom_drift"}, "hdr: must be a mapping"),
    ({"actor_rollout_ref__rollout__n": "abc"}, "actor_rollout_ref.rollout.n: must be an int >= 1, got 'abc'"),
    ({"actor_rollout_ref__rollout__n": 4.5}, "actor_rollout_ref.rollout.n"),
    ({"actor_rollout_ref__actor__ppo_mini_batch_size": True}, "ppo_mini_batch_size: must be an int"),
    ({"trainer__use_v1": "maybe"}, "trainer.use_v1: must be true or false"),
    ({"actor_rollout_ref__actor__shuffle": 1}, "actor.shuffle: must be true or false"),
    ({"hdr__counterfactual": 2}, "hdr.counterfactual: must be true or false, got 2"),
    ({"hdr__k_rep": True}, "hdr.k_rep: must be an int"), ({"hdr__adaptive_tau": [1]}, "hdr.adaptive_tau: must be"),
])
def test_wrong_types_in_a_hand_built_config_are_config_errors_naming_the_key(edit, needle):
    with pytest.raises(ReplayConfigError, match=needle.replace(".", r"\.").replace("(", r"\(")):
        validate_verl_config(_hand_built(**edit))


def test_unknown_hdr_key_in_a_hand_built_config_is_refused():
    cfg = compose_config()
    from omegaconf import OmegaConf

    raw = OmegaConf.to_container(cfg, resolve=False)
    raw["hdr"]["typo_key"] = 1  # a config built by hand, not through Hydra (or with Hydra's +hdr.typo_key=1)
    with pytest.raises(ReplayConfigError, match=r"hdr\.typo_key"):
        validate_verl_config(OmegaConf.create(raw))


def test_every_replay_knob_is_settable_from_the_verl_config():
    import dataclasses

    from hdreplay import ReplayConfig

    cfg = compose_config("hdr.selector=drift_only", "hdr.k_rep=6", "hdr.tau=0.02", "hdr.capacity=20",
                         "hdr.drift_norm=l1", "hdr.headroom_weighting=advantage", "hdr.ingress=answer",
                         "hdr.answer_threshold=0.9", "hdr.truncate_multiple=3", "hdr.scan_chunk=5",
                         "hdr.scan_tokens=90000",
                         "hdr.max_scan_chunk=50", "hdr.max_scan=30", "hdr.acceptance_ema=0.25",
                         "hdr.diagnose_ungated=true",
                         "hdr.counterfactual=true", "hdr.adaptive_tau.enabled=true", "hdr.adaptive_tau.tau_min=0.001",
                         "hdr.adaptive_tau.patience=2", "hdr.seed=5", "hdr.max_age=3", "hdr.priority_alpha=0.7",
                         "hdr.diagnostics_dir=null", "hdr.resume_without_state=true", "hdr.scan_passes=2",
                         "hdr.scan_refresh=finish", "hdr.skip_rejected=3")
    s = validate_verl_config(cfg)
    rc = s.replay_config
    want = dict(selector="drift_only", k_rep=6, tau=0.02, capacity=20, drift_norm="l1",
                headroom_weighting="advantage", ingress="answer", answer_threshold=0.9, truncate_multiple=6,
                scan_chunk=5, scan_tokens=90000,
                max_scan_chunk=50, max_scan=30, acceptance_ema=0.25, group_size=4, diagnose_ungated=True,
                counterfactual=True, seed=5, max_age=3, priority_alpha=0.7, age_decay=None, is_beta=0.0,
                scan_passes=2, scan_refresh="finish", skip_rejected=3)
    for f in dataclasses.fields(ReplayConfig):
        assert getattr(rc, f.name) == want[f.name], f.name  # every field is covered by `want`
    d = s.diagnostics
    assert d.diagnose_ungated and d.counterfactual
    assert (d.adaptive_tau.tau_min, d.adaptive_tau.tau_max, d.adaptive_tau.patience) == (1e-3, 0.1, 2)
    assert s.resume_without_state is True and s.diagnostics_dir is None


def test_rollout_units_and_per_weights_are_refused_by_the_verl_recipe():
    with pytest.raises(ReplayConfigError, match=r"hdr\.selector"):
        validate_verl_config(compose_config("hdr.selector=adv_priority"))
    with pytest.raises(ReplayConfigError, match=r"hdr\.is_beta"):
        validate_verl_config(compose_config("hdr.selector=freshper", "hdr.is_beta=0.4"))


def test_all_problems_are_reported_together():
    with pytest.raises(ReplayConfigError) as e:
        validate_verl_config(compose_config(f"{ACTOR}.shuffle=true", f"{ACTOR}.ppo_epochs=2", "hdr.tau=-1"))
    msg = str(e.value)
    assert f"{ACTOR}.shuffle" in msg and f"{ACTOR}.ppo_epochs" in msg and "hdr.tau" in msg


def test_selector_none_is_plain_verl_and_skips_recipe_checks():
    s = validate_verl_config(compose_config("hdr.selector=none", f"{ACTOR}.shuffle=true", f"{ACTOR}.ppo_epochs=2"))
    assert not s.active


def test_trainer_constructor_validates_the_config():
    class NoWorkers:
        pass

    with pytest.raises(ReplayConfigError, match="shuffle"):
        make_trainer(HDRRayPPOTrainer, compose_config(f"{ACTOR}.shuffle=true"), NoWorkers())
    trainer = make_trainer(HDRRayPPOTrainer, compose_config(), NoWorkers())
    assert trainer.replay_active and trainer.replay.config.k_rep == 4


MP = f"{ACTOR}.fsdp_config.mixed_precision"


def test_trainer_warns_at_start_when_the_bf16_drift_floor_reaches_tau_over_10():
    """verl's FSDP forward runs on bf16 parameters by default: the largest measured bf16-weights floor reaches
    tau/10 at the default tau 1e-3, so the trainer warns with the numbers; tau above 10x the floor, an fp32 forward,
    a selector without a gate or no replay: no warning."""
    import warnings

    from hdreplay.diagnostics.noise_floor import DriftFloorWarning, worst_floor
    from hdreplay.integrations.verl.settings import actor_precision

    class NoWorkers:
        pass

    floor = worst_floor("bf16_weights").l2_p99
    with pytest.warns(DriftFloorWarning) as rec:
        make_trainer(HDRRayPPOTrainer, compose_config(), NoWorkers())
    msg = str(rec[0].message)
    assert "tau=0.001" in msg and f"p99 {floor:.2g}" in msg and f"{floor / 1e-3:.2f} x tau" in msg
    assert "bf16_weights" in msg and "H200" in msg  # every measurement of the precision is quoted
    assert actor_precision(compose_config()) == "bf16_weights"
    assert actor_precision(compose_config(f"+{MP}.param_dtype=fp32")) == "fp32"
    for quiet in ((f"hdr.tau={11 * floor:g}",), (f"+{MP}.param_dtype=fp32",), ("hdr.selector=recency",),
                  ("hdr.selector=none",)):
        with warnings.catch_warnings():
            warnings.simplefilter("error", DriftFloorWarning)
            make_trainer(HDRRayPPOTrainer, compose_config(*quiet), NoWorkers())


class Built(Exception):
    """Raised by the first GPU-bound call of the trainer a task runner built; carries its class."""


def _stop(self, *a, **k):
    raise Built(type(self))


def test_v0_task_runner_builds_the_hdr_trainer_inside_verls_own_run(monkeypatch, tiny_model_dir):
    """verl's real v0 ``TaskRunner.run`` (workers mapping, validate_config, tokenizer, resource pools) runs
    until ``trainer.init_workers()`` (GPUs); the trainer it constructed there must be the recipe's."""
    import verl.trainer.main_ppo_v0 as v0

    from hdreplay.integrations.verl import main
    from verl_helpers import StubPromptDataset

    monkeypatch.setattr(v0, "create_rl_dataset", lambda *a, **k: StubPromptDataset())  # no parquet files here
    monkeypatch.setattr(HDRRayPPOTrainer, "init_workers", _stop)
    monkeypatch.setattr(v0.RayPPOTrainer, "init_workers", _stop)
    cfg = compose_config(f"actor_rollout_ref.model.path={tiny_model_dir}",
                         f"actor_rollout_ref.model.tokenizer_path={tiny_model_dir}/tokenizer")
    assert main.task_runner(cfg).__ray_actor_class__ is main.HDRTaskRunner
    with pytest.raises(Built) as e:
        main.HDRTaskRunner().run(cfg)
    assert e.value.args[0] is HDRRayPPOTrainer
    assert v0.RayPPOTrainer is not HDRRayPPOTrainer  # the swap is undone


@pytest.mark.parametrize("mode", ["sync", "colocate_async", "separate_async"])
def test_v1_task_runner_builds_the_hdr_trainer_for_each_mode_inside_verls_own_run(monkeypatch, tiny_model_dir, mode):
    """verl's real ``TaskRunnerV1.run`` resolves ``get_trainer_cls(trainer_mode)`` and constructs it; with the
    recipe's runner that is the recipe's trainer for the mode (stopped at ``trainer.init()``: GPUs)."""
    pytest.importorskip("transfer_queue")
    import transfer_queue
    import verl.trainer.ppo.v1.trainer_base as tb

    from hdreplay.integrations.verl import HDR_TRAINERS, main

    monkeypatch.setattr(transfer_queue, "init", lambda *a, **k: None)  # no TransferQueue actors without Ray
    monkeypatch.setattr(transfer_queue, "close", lambda *a, **k: None)
    monkeypatch.setattr(HDR_TRAINERS[mode], "init", _stop)
    monkeypatch.setattr(tb.TRAINER_REGISTRY[mode], "init", _stop)
    extra = ("actor_rollout_ref.hybrid_engine=false", "actor_rollout_ref.rollout.nnodes=1",
             "actor_rollout_ref.rollout.n_gpus_per_node=1", "actor_rollout_ref.rollout.checkpoint_engine.backend=nccl",
             "trainer.v1.separate_async.parameter_sync_step=2") if mode == "separate_async" else ()
    cfg = compose_config(f"trainer.v1.trainer_mode={mode}", f"actor_rollout_ref.model.path={tiny_model_dir}", *extra,
                         v1=True)
    runner_cls = main.task_runner(cfg).__ray_actor_class__
    stock = tb.TRAINER_REGISTRY[mode]
    from hdreplay.diagnostics.noise_floor import DriftFloorWarning

    with pytest.raises(Built) as e, pytest.warns(DriftFloorWarning, match="tau=0.001"):  # bf16 forward, tau 1e-3
        runner_cls().run(cfg)
    assert e.value.args[0] is HDR_TRAINERS[mode] and issubclass(HDR_TRAINERS[mode], stock)
    assert tb.TRAINER_REGISTRY[mode] is stock  # the swap is undone


def test_entry_point_composes_the_packaged_config_and_checks_it_before_ray(tmp_path):
    env = dict(os.environ, HF_HUB_OFFLINE="1", HYDRA_FULL_ERROR="0")
    proc = subprocess.run(  # cwd: Hydra writes outputs/<date>/<time>/ there
        [sys.executable, "-m", "hdreplay.integrations.verl.main", f"{ACTOR}.shuffle=true", "hdr.tau=1e-2"],
        capture_output=True, text=True, timeout=240, env=env, cwd=tmp_path,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert f"{ACTOR}.shuffle=true" in out and "set it to false" in out
    assert "Started a local Ray instance" not in out


def test_the_hdr_section_is_declared_one_to_one_with_the_replay_config():
    """hdr.<name> for every ReplayConfig field (same default and help) and every DiagnosticsConfig field, plus the
    recipe's own keys; nothing else."""
    import dataclasses

    from hdreplay import ReplayConfig
    from hdreplay.diagnostics import AdaptiveTau, DiagnosticsConfig
    from hdreplay.integrations.verl.schema import RECIPE_KEYS, AdaptiveTauSection, HDRSection

    section = {f.name: f for f in dataclasses.fields(HDRSection)}
    core = {f.name: f for f in dataclasses.fields(ReplayConfig) if not f.metadata.get("derived")}
    diag = {f.name: f for f in dataclasses.fields(DiagnosticsConfig)}
    assert set(section) == set(core) | set(diag) | set(RECIPE_KEYS)
    for name, f in core.items():
        assert section[name].default == f.default, name
        assert section[name].metadata["help"] == f.metadata["help"], name
    for name in ("diagnose_ungated", "counterfactual"):
        assert section[name].default == diag[name].default and section[name].metadata["help"] == \
            diag[name].metadata["help"]
    assert section["adaptive_tau"].metadata["help"].startswith(diag["adaptive_tau"].metadata["help"])
    at = {f.name: f.default for f in dataclasses.fields(AdaptiveTauSection)}
    assert at == {"enabled": False, **{f.name: f.default for f in dataclasses.fields(AdaptiveTau)}}
