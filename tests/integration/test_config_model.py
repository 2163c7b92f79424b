"""The config as models: strict loading (file, line, path), the root model, the schema, the CLI."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any, get_args

import pytest
import torch
import yaml
from pydantic import ValidationError

from monolith.device import DeviceContext
from monolith.device_config import DeviceConfig
from runtime.config.file import DEFAULT_CONFIG_PATH, SECTIONS, load_config, placements_for
from runtime.config.model import SpineConfig
from runtime.config.sections import DecisionField
from runtime.shadow.decisions import Decision
from services.common import ConfigError
from services.common.config_section import ConfigProblems
from services.registry import COMPONENTS
from spine import cli


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "spine.yaml"
    path.write_text(text)
    return path


def problems(path: Path) -> list[str]:
    with pytest.raises(ConfigProblems) as info:
        load_config(path)
    return info.value.problems


def test_a_duplicate_key_is_refused_naming_file_line_and_key(tmp_path: Path) -> None:
    path = write(tmp_path, "cache:\n  max_entries: 10\n  ttl_s: 5\n  max_entries: 20\n")
    assert problems(path) == [f"{path}:4: cache.max_entries: duplicate key"]


def test_an_unknown_key_in_a_section_names_its_path_line_and_the_known_keys(tmp_path: Path) -> None:
    path = write(tmp_path, "logs:\n  path: r.jsonl\n  bach_lines: 3\n")
    assert problems(path) == [f"{path}:3: logs.bach_lines: unknown key; known: path, batch_lines, "
                              "flush_interval_s, ring_capacity, full_wait_s, max_line_bytes, fsync"]


def test_a_nested_unknown_key_names_the_whole_path(tmp_path: Path) -> None:
    path = write(tmp_path, "auth:\n  api_keys:\n    - id: a\n      tenant: t\n      key: k-0001\n"
                           "      scope: [generate]\n")
    [line] = problems(path)
    assert line.startswith(f"{path}:6: auth.api_keys[0].scope: unknown key; known: id, tenant, key")


def test_the_split_section_is_refused_as_unknown(tmp_path: Path) -> None:
    path = write(tmp_path, "listen: 127.0.0.1:50051\nsplit:\n  share: 0.5\n")
    [line] = problems(path)
    assert line.startswith(f"{path}:2: split: unknown section; known: listen, placements")
    assert "split" not in SECTIONS


def test_every_problem_is_reported_one_line_each_in_file_order(tmp_path: Path) -> None:
    path = write(tmp_path, "\n".join([
        "split: {}",                       # 1
        "cache:",                          # 2
        "  ttl: 5",                        # 3
        "  ttl: 6",                        # 4
        "inference:",                      # 5
        "  kv_cache_max_entries: lots",    # 6
        "ratelimit:",                      # 7
        "  tenants:",                      # 8
        "    acme: {burst: 0}",            # 9
    ]) + "\n")
    found = problems(path)
    assert [line.split(": ", 2)[:2] for line in found] == [
        [f"{path}:1", "split"], [f"{path}:3", "cache.ttl"], [f"{path}:4", "cache.ttl"],
        [f"{path}:6", "inference.kv_cache_max_entries"], [f"{path}:9", "ratelimit.tenants.acme.burst"]]
    assert found[2].endswith("duplicate key")
    assert found[3].endswith("expected 'auto' or an integer >= 1, got 'lots'")


def test_yaml_that_does_not_parse_names_the_line(tmp_path: Path) -> None:
    [line] = problems(write(tmp_path, "cache:\n  max_entries: [1,\n"))
    assert ":3: not valid YAML" in line or ":2: not valid YAML" in line


def test_a_problem_from_overrides_has_a_path_but_no_file() -> None:
    with pytest.raises(ConfigProblems) as info:
        load_config(overrides={"cache": {"max_entries": 0}})
    assert info.value.problems == ["cache.max_entries: Input should be greater than or equal to 1, got 0"]


def test_a_secret_is_never_quoted_back(tmp_path: Path) -> None:
    path = write(tmp_path, "auth:\n  api_keys:\n    - {id: a, tenant: t, key: 123456789}\n"
                           "  jwt: {hs256_secret: short-secret-value}\n")
    text = "\n".join(problems(path))
    assert "auth.api_keys[0].key: Input should be a valid string, got int" in text
    assert "auth.jwt.hs256_secret: must be at least 32 bytes, got 18" in text
    assert "123456789" not in text and "short-secret-value" not in text


def test_defaults_are_unchanged() -> None:
    config = load_config()
    assert isinstance(config, SpineConfig) and config.written() == {}
    assert config.listen == "127.0.0.1:50051"
    assert (config.cache.max_entries, config.cache.ttl_s) == (4096, 300)
    assert config.inference.health_interval_s == 1.0 and config.inference.max_batch == 16
    # The model serves its smaller fallback beside it, unless a config says otherwise.
    inference = config.inference
    assert [(m.model_id, m.max_batch) for m in inference.models] == [("tiny-lm-mini", 8)]
    assert config.router.models[0].id == "tiny-lm" and config.auth.jwt is not None
    assert placements_for("mixed", config) == {"auth": "remote", "ratelimit": "remote", "router": "local",
                                                "cache": "local", "metrics": "local", "logs": "local",
                                                "inference": "local"}


def test_the_documented_default_file_spells_out_the_models_own_defaults() -> None:
    """One place for the defaults (the models); `runtime/default_config.yaml` documents them, and
    reading it changes nothing."""
    documented = yaml.safe_load(DEFAULT_CONFIG_PATH.read_text())
    defaults = SpineConfig().model_dump()
    assert load_config(DEFAULT_CONFIG_PATH).model_dump() == defaults
    assert SpineConfig.read(documented).model_dump() == defaults


def test_a_config_is_immutable_and_derived_from_what_was_written() -> None:
    config = load_config(overrides={"inference": {"max_queue": 10}})
    with pytest.raises(ValidationError):
        config.listen = "elsewhere:1"  # type: ignore[misc]
    derived = config.with_overrides({"inference": {"deterministic": True}})
    assert derived.inference.deterministic and derived.inference.models[0].deterministic  # still inherited
    assert derived.inference.max_queue == derived.inference.models[0].max_queue == 10
    assert config.inference.deterministic is False  # the first is unchanged
    assert SpineConfig.read(yaml.safe_load(derived.to_yaml())).model_dump() == derived.model_dump()
    assert derived.limits.max_inference_timeout_ms == derived.inference.max_timeout_ms


def test_the_root_model_names_every_section_and_component() -> None:
    assert set(SpineConfig.model_fields) == SECTIONS
    fields = SpineConfig.model_fields
    assert set(COMPONENTS) <= SECTIONS  # one section per component of the table
    assert tuple(fields["placements"].annotation.model_fields) == COMPONENTS  # type: ignore[union-attr]
    assert tuple(fields["remote_addresses"].annotation.model_fields) == COMPONENTS  # type: ignore[union-attr]
    assert get_args(DecisionField) == tuple(f.name for f in dataclasses.fields(Decision))


def test_the_device_budget_comes_from_the_config() -> None:
    cpu = torch.device("cpu")
    assert DeviceContext.for_section(load_config().device).budget_bytes == 256 << 20 or torch.cuda.is_available()
    from monolith.device import budget_bytes

    assert budget_bytes(cpu, DeviceConfig()) == 256 << 20
    assert budget_bytes(cpu, DeviceConfig.parse({"memory_budget_mib": 64}, "device")) == 64 << 20
    with pytest.raises(ConfigError, match=r"device\.memory_budget_mib: expected 'auto' or an integer >= 1"):
        DeviceConfig.parse({"memory_budget_mib": 0}, "device")


def test_config_schema_prints_the_json_schema(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["config", "schema"]) == 0
    schema = json.loads(capsys.readouterr().out)
    assert set(schema["properties"]) == SECTIONS
    assert schema["additionalProperties"] is False
    assert schema["$defs"]["CacheConfig"]["properties"]["max_entries"]["minimum"] == 1


def test_config_check_exits_2_with_one_line_per_problem(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = write(tmp_path, "split: {}\ncache:\n  ttl: 5\n")
    assert cli.main(["--config", str(path), "config", "check"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert [line.split(": ")[1] for line in err] == [f"{path}:1", f"{path}:3"]
    assert all(line.startswith("config error: ") for line in err)


@pytest.mark.parametrize("text", [
    "cache:\n  max_entries: 10\n  max_entries: 20\n",      # duplicate key
    "logs:\n  bach_lines: 3\n",                             # unknown key
    "split:\n  share: 0.5\n",                               # unknown section
])
def test_up_with_a_bad_config_exits_2_before_any_child_starts(
        text: str, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    spawned: list[Any] = []
    monkeypatch.setattr("runtime.placement.components.Supervisor", lambda *args: spawned.append(args))
    path, run_dir = write(tmp_path, text), tmp_path / "run"
    rc = cli.main(["--config", str(path), "up", "--layout", "layered", "--http-listen", "off",
                   "--run-dir", str(run_dir)])
    assert rc == 2
    [line] = capsys.readouterr().err.splitlines()
    assert line.startswith(f"config error: {path}:")
    assert spawned == [] and not run_dir.exists()


def test_a_stack_refuses_a_bad_config_before_creating_anything(tmp_path: Path) -> None:
    with pytest.raises(ConfigProblems, match="split: unknown section"):
        load_config(overrides={"split": {"share": 0.5}})  # a Stack takes only a config that was read


def test_up_on_a_listen_address_off_loopback_exits_2_in_one_line_before_any_child_starts(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    spawned: list[Any] = []
    monkeypatch.setattr("runtime.placement.components.Supervisor", lambda *args: spawned.append(args))
    run_dir = tmp_path / "run"
    rc = cli.main(["up", "--layout", "layered", "--listen", "0.0.0.0:50999", "--run-dir", str(run_dir)])
    assert rc == 2
    [line] = capsys.readouterr().err.splitlines()
    assert line.startswith("error: --listen '0.0.0.0:50999' is not loopback") and "--allow-external" in line
    assert spawned == [] and not run_dir.exists()
