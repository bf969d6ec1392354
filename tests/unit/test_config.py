"""TokenflowConfig: nested sections, one name per setting, unknown keys refused by name."""

from __future__ import annotations

import copy
import dataclasses
import os
from pathlib import Path
from typing import Any

import pytest
import yaml
from pydantic import ValidationError

from cluster.batch_config import BatchConfig
from cluster.config import TokenflowConfig, check_env, nest
from cluster.ingress import build_app
from controller.flow import FlowConfig
from controller.options import ClusterConfig, WorkerConfig
from controller.scheduler import SchedulerConfig

SERVE_YAML = Path(__file__).resolve().parents[2] / "deploy" / "serve.yaml"


def serve_args() -> dict[str, Any]:
    return yaml.safe_load(SERVE_YAML.read_text())["applications"][0]["args"]


@pytest.mark.parametrize(("edit", "name"), [
    (lambda a: a["scheduler"].update(max_num_batched_tokns=4096), "max_num_batched_tokns"),
    (lambda a: a.update(schedular={"max_num_seqs": 8}), "schedular"),
    (lambda a: a.update(max_num_seqs=8), "max_num_seqs"),  # the old flat name
    # Batch settings moved to their own section: the old name is refused, not ignored.
    (lambda a: a["cluster"].update(batch_max_in_flight=64), r"cluster\.batch_max_in_flight"),
], ids=["field", "section", "flat", "old-batch-name"])
def test_misspelled_serve_arg_fails_at_start_naming_it(edit: Any, name: str) -> None:
    args = copy.deepcopy(serve_args())
    build_app(copy.deepcopy(args))  # the shipped file is accepted
    edit(args)
    with pytest.raises(ValidationError, match=name):
        build_app(args)


def test_misspelled_keyword_fails_naming_it() -> None:
    with pytest.raises(ValidationError, match=r"flow\.cache_entr"):
        TokenflowConfig(flow={"cache_entr": 0.5})
    with pytest.raises(ValidationError, match="num_kv_blocks"):
        TokenflowConfig(num_kv_blocks=64)


@pytest.mark.parametrize("name", [
    "TOKENFLOW_MAX_NUM_SEQS",  # the old flat name
    "TOKENFLOW_SCHEDULER__MAX_NUM_SEQ",
    "TOKENFLOW_SCHEDULR__MAX_NUM_SEQS",
    "TOKENFLOW_CLUSTER__PORT__X",
])
def test_misspelled_env_variable_fails_naming_it(monkeypatch: pytest.MonkeyPatch,
                                                  name: str) -> None:
    monkeypatch.setenv(name, "8")
    with pytest.raises(ValueError, match=name):
        TokenflowConfig()


def test_env_variables_that_are_not_settings_pass() -> None:
    check_env({"TOKENFLOW_CACHE_DIR": "/tmp/x", "TOKENFLOW_BENCH_THREADS": "2",
               "PATH": "/bin", "TOKENFLOW_WORKER": '{"seed": 3}'})


def test_nested_env_override_merges_with_keywords(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TOKENFLOW_SCHEDULER__MAX_NUM_BATCHED_TOKENS", "4096")
    monkeypatch.setenv("TOKENFLOW_CALIBRATION__CONTEXTS", "[0, 512]")
    monkeypatch.setenv("tokenflow_cluster__port", "8123")  # case does not matter
    config = TokenflowConfig(scheduler={"max_num_seqs": 8})
    assert config.scheduler.max_num_batched_tokens == 4096
    assert config.scheduler.max_num_seqs == 8
    assert config.calibration.contexts == (0, 512)
    assert config.cluster.port == 8123
    options = config.controller_options()
    assert options.scheduler.max_num_batched_tokens == 4096


def test_model_dump_round_trips() -> None:
    # The ingress ships the config to its replicas as a dict.
    config = TokenflowConfig(
        worker={"model": "builtin:tiny", "served_model_name": "tiny", "seed": 7},
        scheduler={"tenant_weights": {"a": 2.0}, "scheduling_policy": "prefill-first",
                   "max_chunk_tokens": 64},
        flow={"throttle_chunks": 3}, degraded={"chunk_tokens": 32},
        calibration={"budget_file": "budget.json", "contexts": [0, 64]},
        cluster={"namespace": "x", "detached_controller": True})
    dump = config.model_dump()
    again = TokenflowConfig(**dump)
    assert again == config
    assert again.model_dump() == dump
    assert again.calibration.budget_file == Path("budget.json")
    assert isinstance(again.scheduler, SchedulerConfig)


def test_bounds_are_checked_by_pydantic_and_by_the_dataclass() -> None:
    with pytest.raises(ValidationError, match=r"scheduler\.max_num_seqs"):
        TokenflowConfig(scheduler={"max_num_seqs": 0})
    with pytest.raises(ValueError, match=r"SchedulerConfig\.max_num_seqs must be >= 1"):
        SchedulerConfig(max_num_seqs=0)
    with pytest.raises(ValueError, match=r"cache_exit must be below"):
        TokenflowConfig(flow={"cache_exit": 0.9})
    with pytest.raises(ValueError, match="max_chunk_tokens must not exceed"):
        SchedulerConfig(max_num_batched_tokens=64, max_chunk_tokens=128)


def test_every_setting_is_documented() -> None:
    schema = TokenflowConfig.model_json_schema()
    sections = schema["$defs"]
    assert set(schema["properties"]) == {"worker", "cache", "scheduler", "flow", "protections",
                                         "degraded", "calibration", "cluster", "recovery",
                                         "metrics", "journal", "edge", "batch", "slo",
                                         "scaling"}
    for name, section in sections.items():
        for field, spec in section["properties"].items():
            assert spec.get("description"), f"{name}.{field} has no description"
    # One name per setting: each component's config is the section itself.
    assert {f.name for f in dataclasses.fields(FlowConfig)} == \
        set(sections["FlowConfig"]["properties"])


def test_batch_settings_are_their_own_section(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TOKENFLOW_BATCH__MAX_IN_FLIGHT", "7")
    config = TokenflowConfig(batch={"rows_per_shard": 5})
    assert config.batch == BatchConfig(max_in_flight=7, rows_per_shard=5)
    assert not [f.name for f in dataclasses.fields(ClusterConfig) if "batch" in f.name]
    with pytest.raises(ValidationError, match=r"batch\.start_timeout_s"):
        TokenflowConfig(batch={"start_timeout_s": 0})
    # The old name of the setting (renamed, docs/architecture.md) fails at start, naming
    # the new one.
    with pytest.raises(ValidationError, match=r"batch\.ready_wait_s is now batch\.start_timeout_s"):
        TokenflowConfig(batch={"ready_wait_s": 600})


def test_slos_are_one_section_read_by_the_controller_and_the_edge() -> None:
    from cluster.metrics import MetricsConfig
    from controller.budget import AutoBudget
    from controller.calibration import CalibrationConfig
    from controller.protections import ProtectionConfig
    from controller.slo import SloConfig

    config = TokenflowConfig(slo={"itl_ms": 40.0, "ttft_s": 1.0, "max_headroom": 1.1},
                             calibration={"auto": True})
    assert config.slo == SloConfig(itl_ms=40.0, ttft_s=1.0, max_headroom=1.1)
    assert config.controller_options().slo is config.slo  # the controller takes it whole
    assert config.auto_budget() == AutoBudget(config.calibration.quick(), 40.0)
    assert TokenflowConfig().slo == SloConfig()  # the defaults the three homes had
    assert (SloConfig().itl_ms, SloConfig().ttft_s, SloConfig().max_headroom) == (None, 2.0, 1.3)
    assert (SloConfig().headroom_window, SloConfig().headroom_quantile) == (64, 1.0)
    # No SLO is left in the sections they came from.
    for cls in (ProtectionConfig, MetricsConfig, CalibrationConfig):
        assert not [f.name for f in dataclasses.fields(cls) if "slo_" in f.name]
    with pytest.raises(ValidationError, match=r"slo\.headroom_window"):
        TokenflowConfig(slo={"headroom_window": 0})


@pytest.mark.parametrize(("section", "field", "new"), [
    ("calibration", "itl_slo_ms", r"slo\.itl_ms"),
    ("metrics", "ttft_slo_s", r"slo\.ttft_s"),
    ("protections", "slo_headroom_quantile", r"slo\.headroom_quantile"),
    ("protections", "slo_headroom_window", r"slo\.headroom_window"),
    ("protections", "max_slo_headroom", r"slo\.max_headroom"),
])
def test_an_old_slo_name_fails_at_start_naming_its_new_home(
        monkeypatch: pytest.MonkeyPatch, section: str, field: str, new: str) -> None:
    with pytest.raises(ValidationError, match=rf"{section}\.{field} is now {new}"):
        TokenflowConfig(**{section: {field: 1}})
    args = copy.deepcopy(serve_args())  # serve.yaml's args, as build_app gets them
    args.setdefault(section, {})[field] = 1
    with pytest.raises(ValidationError, match=rf"{section}\.{field} is now {new}"):
        build_app(args)
    name = f"TOKENFLOW_{section.upper()}__{field.upper()}"
    monkeypatch.setenv(name, "1")
    with pytest.raises(ValueError, match=rf"{name} \({section}\.{field} is now {new}: "
                                         rf"TOKENFLOW_SLO__"):
        TokenflowConfig()
    monkeypatch.setenv("TOKENFLOW_SLO__ITL_M", "1")  # a misspelling beside it is named too
    with pytest.raises(ValueError, match=rf"is now {new}.*unknown.*TOKENFLOW_SLO__ITL_M\b"):
        TokenflowConfig()


@pytest.mark.parametrize("name", ["TOKENFLOW_CLUSTER__BATCH_MAX_IN_FLIGHT",
                                  "TOKENFLOW_BATCH__BATCH_MAX_IN_FLIGHT"])
def test_old_batch_names_are_refused_naming_them(monkeypatch: pytest.MonkeyPatch,
                                                 name: str) -> None:
    with pytest.raises(ValidationError, match=r"cluster\.batch_max_in_flight"):
        TokenflowConfig(cluster={"batch_max_in_flight": 64})
    monkeypatch.setenv(name, "64")
    with pytest.raises(ValueError, match=name):
        TokenflowConfig()


BUDGET_ENV = "TOKENFLOW_SCHEDULER__MAX_NUM_BATCHED_TOKENS"
CHUNKS_ENV = "TOKENFLOW_SCHEDULER__MAX_CONCURRENT_CHUNKS"


def test_batch_cli_sets_the_batch_section_and_the_offline_step(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from cluster.batch import config_from_args, parse_args

    monkeypatch.delenv(BUDGET_ENV, raising=False)
    monkeypatch.delenv(CHUNKS_ENV, raising=False)
    args = ["-i", "in.jsonl", "-o", "out.jsonl"]
    config = config_from_args(parse_args(args))
    # The default profile: the offline step the batch section had before it was a profile.
    assert config.scheduler.max_num_batched_tokens == 8192
    assert config.scheduler.max_concurrent_chunks == 256
    assert not config.calibration.auto
    monkeypatch.setenv("TOKENFLOW_BATCH__OVERRIDES__SCHEDULER__MAX_NUM_BATCHED_TOKENS", "4096")
    monkeypatch.setenv("TOKENFLOW_BATCH__OVERRIDES__SCHEDULER__MAX_CONCURRENT_CHUNKS", "64")
    config = config_from_args(parse_args([*args, "--max-in-flight", "3",
                                          "--rows-per-shard", "9"]))
    assert (config.batch.max_in_flight, config.batch.rows_per_shard) == (3, 9)
    assert config.batch.engine_in_task  # the default; the flag turns it off
    assert not config_from_args(parse_args([*args, "--no-engine-in-task"])).batch.engine_in_task
    # One key set in the env is merged over the default profile, not in place of it.
    assert config.batch.overrides["worker"] == {"num_threads": -1}
    # The offline step comes from the batch profile unless the scheduler's is set.
    assert config.scheduler.max_num_batched_tokens == 4096
    assert config.scheduler.max_concurrent_chunks == 64
    assert not config.calibration.auto
    monkeypatch.setenv(BUDGET_ENV, "1024")
    monkeypatch.setenv(CHUNKS_ENV, "8")
    config = config_from_args(parse_args(args))
    assert config.scheduler.max_num_batched_tokens == 1024
    assert config.scheduler.max_concurrent_chunks == 8
    monkeypatch.delenv(BUDGET_ENV)
    # A flag gives the budget too, even at the serving default's value.
    config = config_from_args(parse_args([*args, "--max-num-batched-tokens", "2048"]))
    assert config.scheduler.max_num_batched_tokens == 2048


def test_the_batch_profile_yields_to_given_settings_and_a_budget_file(
        tmp_path: Path) -> None:
    from cluster.batch import offline_config

    profile = {"scheduler": {"max_num_seqs": 8, "max_num_batched_tokens": 4096}}
    config = TokenflowConfig(batch={"overrides": profile}, scheduler={"max_num_seqs": 4})
    job = offline_config(config)
    assert job.scheduler.max_num_seqs == 4  # given: the profile yields
    assert job.scheduler.max_num_batched_tokens == 4096
    assert config.scheduler.max_num_batched_tokens == 2048  # serving: untouched
    assert job.worker.num_threads is None  # the worker's overrides: an own controller's
    assert not job.calibration.auto
    with_file = offline_config(TokenflowConfig(
        batch={"overrides": profile}, calibration={"budget_file": tmp_path / "b.json",
                                                   "auto": True}))
    assert with_file.scheduler.max_num_batched_tokens == 2048  # the file's budget, later
    assert with_file.scheduler.max_num_seqs == 8 and with_file.calibration.auto


@pytest.mark.parametrize(("overrides", "name"), [
    ({"scheduler": {"max_num_batched_tokns": 1}},
     r"batch\.overrides\.scheduler\.max_num_batched_tokns"),
    ({"schedular": {"max_num_seqs": 1}}, r"batch\.overrides\.schedular"),
    ({"scheduler": {"max_num_seqs": 0}}, r"batch\.overrides\.scheduler.*max_num_seqs"),
    ({"worker": {"num_threads": 0}}, r"batch\.overrides\.worker.*num_threads"),
], ids=["field", "section", "bound", "thread-count"])
def test_a_bad_batch_override_fails_at_start_naming_it(overrides: dict[str, Any],
                                                      name: str) -> None:
    with pytest.raises(ValidationError, match=name):
        TokenflowConfig(batch={"overrides": overrides})


def test_an_env_override_is_validated_as_its_section_does(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TOKENFLOW_BATCH__OVERRIDES__SCHEDULER__MAX_NUM_SEQS", "8")
    assert TokenflowConfig().batch.overrides["scheduler"]["max_num_seqs"] == 8  # not "8"


@pytest.mark.parametrize(("old", "new"), [
    ("max_num_batched_tokens", "batch.overrides.scheduler.max_num_batched_tokens"),
    ("max_concurrent_chunks", "batch.overrides.scheduler.max_concurrent_chunks"),
    ("worker_num_threads", "batch.overrides.worker.num_threads"),
])
def test_an_old_batch_name_fails_at_start_naming_its_new_home(
        monkeypatch: pytest.MonkeyPatch, old: str, new: str) -> None:
    with pytest.raises(ValidationError, match=rf"batch\.{old} is now {new}"):
        TokenflowConfig(batch={old: 1})
    monkeypatch.setenv(f"TOKENFLOW_BATCH__{old.upper()}", "1")
    new_env = "TOKENFLOW_" + new.upper().replace(".", "__")
    with pytest.raises(ValueError, match=rf"batch\.{old} is now {new}: {new_env}"):
        TokenflowConfig()


def test_a_batch_jobs_own_worker_takes_every_core_unless_worker_threads_are_set(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from cluster.batch import config_from_args, parse_args
    from cluster.remote_batch import own_controller_config
    from workers.worker import resolve_num_threads

    args = parse_args(["-i", "in.jsonl", "-o", "out.jsonl"])
    assert config_from_args(args).worker.num_threads is None  # --local: torch's default
    assert own_controller_config(config_from_args(args)).worker.num_threads == -1
    cores = len(os.sched_getaffinity(0))
    assert resolve_num_threads(-1) == cores and resolve_num_threads(3) == 3
    assert resolve_num_threads(-2) == max(1, cores - 1)
    assert resolve_num_threads(-1000) == 1
    with pytest.raises(ValueError, match="0"):
        resolve_num_threads(0)
    with pytest.raises(ValueError, match="num_threads"):
        TokenflowConfig(worker={"num_threads": 0})
    monkeypatch.setenv("TOKENFLOW_WORKER__NUM_THREADS", "1")
    assert own_controller_config(config_from_args(args)).worker.num_threads == 1
    monkeypatch.delenv("TOKENFLOW_WORKER__NUM_THREADS")
    # Given, even as its default: Ray's reserved CPUs, not the profile's.
    config = TokenflowConfig(worker={"num_threads": None})
    assert own_controller_config(config).worker.num_threads is None


def test_cli_options_nest() -> None:
    assert nest({"worker.model": "m", "cache.block_size": None, "cluster.port": 1}) == \
        {"worker": {"model": "m"}, "cluster": {"port": 1}}
    config = TokenflowConfig(**nest({"worker.served_model_name": "n"}))
    assert config.worker == WorkerConfig(served_model_name="n")
    assert config.worker.model_name == "n"


def test_map_fields_take_keys_in_the_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TOKENFLOW_SCHEDULER__TENANT_WEIGHTS__GOLD", "3")
    assert TokenflowConfig().scheduler.tenant_weights == {"gold": 3.0}


def test_api_keys_parse_from_the_env_without_echoing_them() -> None:
    from cluster.config import API_KEYS_ENV, api_keys_from_env

    keys = api_keys_from_env({API_KEYS_ENV: "sk-a, sk-b:team-b, sk-c:ops:-5:10,"})
    assert [(k.key.get_secret_value(), k.tenant, k.min_priority, k.max_priority)
            for k in keys] == [("sk-a", "default", None, None), ("sk-b", "team-b", None, None),
                               ("sk-c", "ops", -5, 10)]
    assert "sk-a" not in repr(keys)
    for bad in ["sk-secret:a:b", "sk-secret:bad tenant", "sk-secret:t:1:x", "sk-secret:t:5:1"]:
        with pytest.raises(ValueError) as err:
            api_keys_from_env({API_KEYS_ENV: bad})
        assert "sk-secret" not in str(err.value) and "entry 0" in str(err.value)
    TokenflowConfig()  # TOKENFLOW_API_KEYS is no configuration field, yet no unknown variable


def test_edge_priority_range_is_checked() -> None:
    with pytest.raises(ValueError, match="min_priority"):
        TokenflowConfig(edge={"min_priority": 5, "max_priority": 1})


def test_serve_exports_api_keys_and_knows_loopback(monkeypatch: pytest.MonkeyPatch) -> None:
    from cluster.config import API_KEYS_ENV
    from cluster.serve import export_api_keys, is_loopback

    monkeypatch.setenv(API_KEYS_ENV, "sk-env")
    assert export_api_keys(["sk-cli:team"]) == 2
    assert os.environ[API_KEYS_ENV] == "sk-env,sk-cli:team"
    with pytest.raises(ValueError):
        export_api_keys(["bad key"])
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost")
    assert not is_loopback("0.0.0.0") and not is_loopback("example.com")


def test_scaling_is_off_by_default_and_its_bounds_are_checked_by_name(
        monkeypatch: pytest.MonkeyPatch) -> None:
    options = TokenflowConfig().controller_options()
    assert not options.scaling.enabled  # the pool is what started: today's behaviour
    monkeypatch.setenv("TOKENFLOW_SCALING__MAX_WORKERS", "6")
    config = TokenflowConfig(scaling={"enabled": True, "min_workers": 2})
    assert (config.scaling.min_workers, config.scaling.max_workers) == (2, 6)
    assert config.controller_options().scaling == config.scaling
    with pytest.raises(ValidationError, match="min_workers"):
        TokenflowConfig(scaling={"min_workers": 7})
    with pytest.raises(ValidationError, match=r"scaling\.drain_timeout_s"):
        TokenflowConfig(scaling={"drain_timeout_s": 0})


def test_make_serves_local_cpu_workers_share_the_cores_unless_threads_are_set(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from cluster.serve import with_local_threads

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8)))
    assert with_local_threads(TokenflowConfig(), has_gpu=False).worker.num_threads == 8
    two = TokenflowConfig(worker={"num_workers": 2})
    assert with_local_threads(two, has_gpu=False).worker.num_threads == 4
    many = TokenflowConfig(worker={"num_workers": 16})
    assert with_local_threads(many, has_gpu=False).worker.num_threads == 1
    given = TokenflowConfig(worker={"num_threads": 3})
    assert with_local_threads(given, has_gpu=False).worker.num_threads == 3
    # GPU workers keep Ray's reservation; a CPU device on a GPU machine still shares.
    assert with_local_threads(TokenflowConfig(), has_gpu=True).worker.num_threads is None
    cpu = TokenflowConfig(worker={"device": "cpu"})
    assert with_local_threads(cpu, has_gpu=True).worker.num_threads == 8
    # The rest of the config is untouched.
    assert with_local_threads(two, has_gpu=False).model_dump()["worker"]["num_workers"] == 2
