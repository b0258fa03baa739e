"""NVIDIA's device-plugin config file (v1): an operator's file read with NVIDIA's meaning,
bad files refused with the key path and the reason, through the parser and `vgpu node-agent`."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

import pytest
import yaml
from click.testing import CliRunner
from hypothesis import HealthCheck, given
from hypothesis import settings as hypothesis_settings
from hypothesis import strategies as st

from services.cli.main import main
from services.common.config import ConfigError
from services.nodeagent.nvidia_config import (
    DEVICE_ID_STRATEGIES,
    DEVICE_LIST_STRATEGIES,
    MIG_STRATEGIES,
    NvidiaConfigError,
    load_nvidia_config,
    parse_nvidia_config,
    settings_values,
)
from services.nodeagent.settings import load_node_agent_settings

# The time-slicing example of NVIDIA's README, as operators copy it into a ConfigMap.
README_TIME_SLICING = """
version: v1
flags:
  migStrategy: none
  failOnInitError: true
  nvidiaDriverRoot: /
  plugin:
    passDeviceSpecs: false
    deviceListStrategy: envvar
    deviceIDStrategy: uuid
sharing:
  timeSlicing:
    renameByDefault: false
    failRequestsGreaterThanOne: false
    resources:
    - name: nvidia.com/gpu
      replicas: 10
"""


def test_readme_time_slicing_file_becomes_settings() -> None:
    config = parse_nvidia_config(yaml.safe_load(README_TIME_SLICING))
    assert settings_values(config) == {
        "mig_strategy": "none",
        "fail_on_init_error": True,
        "nvidia_driver_root": "/",
        "pass_device_specs": False,
        "device_list_strategy": "envvar",
        "device_id_strategy": "uuid",
        "sharing_mode": "time-slicing",
        "sharing_replicas": 10,
        "shared_resource_name": "",
        "fail_requests_greater_than_one": False,
    }


def test_mps_wins_over_time_slicing_and_refuses_more_than_one_by_default() -> None:
    config = parse_nvidia_config(
        {
            "sharing": {
                "timeSlicing": {"resources": [{"name": "nvidia.com/gpu", "replicas": 2}]},
                "mps": {"renameByDefault": True, "resources": [{"name": "gpu", "replicas": 4}]},
            }
        }
    )
    values = settings_values(config)
    assert values["sharing_mode"] == "mps"
    assert values["sharing_replicas"] == 4
    assert values["shared_resource_name"] == "nvidia.com/gpu.shared"  # renameByDefault
    assert values["fail_requests_greater_than_one"] is True
    assert any("timeSlicing is ignored" in w for w in config.warnings)


def test_rename_list_strategy_and_ignored_keys() -> None:
    config = parse_nvidia_config(
        {
            "flags": {
                "gfd": {"oneshot": False},
                "mpsRoot": "/run/nvidia/mps",
                "plugin": {"deviceListStrategy": ["volume-mounts", "cdi-cri", "cdi-cri"]},
            },
            "imex": {"channelIDs": []},
            "resources": {"gpus": [{"pattern": "*", "name": "gpu"}]},
            "sharing": {
                "timeSlicing": {
                    "resources": [
                        {"name": "nvidia.com/gpu", "rename": "gpu-shared", "replicas": 3,
                         "devices": [0, "1", "GPU-8e4a"]},
                    ]
                }
            },
        }
    )  # fmt: skip
    values = settings_values(config)
    assert values["device_list_strategy"] == "volume-mounts,cdi-cri"
    assert values["shared_resource_name"] == "nvidia.com/gpu-shared"
    assert values["mps_root"] == "/run/nvidia/mps"
    assert any("devices is ignored" in w for w in config.warnings)
    assert any("resources is ignored" in w for w in config.warnings)


def test_empty_file_and_json_file(tmp_path: Path) -> None:
    empty = tmp_path / "empty.yaml"
    empty.write_text("")
    assert settings_values(load_nvidia_config(empty)) == {}
    as_json = tmp_path / "config.json"
    as_json.write_text(json.dumps({"version": "v1", "flags": {"migStrategy": "single"}}))
    assert settings_values(load_nvidia_config(as_json)) == {"mig_strategy": "single"}


BAD_FILES = [
    ({"version": "v2"}, "version", "unknown version"),
    ({"flags": {"migStrategy": "half"}}, "flags.migStrategy", "must be one of none, single"),
    ({"flags": {"failOnInitError": "yes"}}, "flags.failOnInitError", "expected true or false"),
    ({"flags": {"nvidiaDriverRoot": "run/nvidia"}}, "flags.nvidiaDriverRoot", "absolute path"),
    ({"flags": {"plugin": {"deviceListStrategy": "env"}}},
     "flags.plugin.deviceListStrategy", "must be one of envvar"),
    ({"flags": {"plugin": {"deviceListStrategy": ["envvar", "cdi"]}}},
     "flags.plugin.deviceListStrategy[1]", "got 'cdi'"),
    ({"flags": {"plugin": {"deviceListStrategy": []}}},
     "flags.plugin.deviceListStrategy", "expected a strategy"),
    ({"flags": {"plugin": {"deviceIDStrategy": "serial"}}},
     "flags.plugin.deviceIDStrategy", "uuid, index"),
    ({"flags": {"plugin": {"passDeviceSpecs": 1}}},
     "flags.plugin.passDeviceSpecs", "true or false"),
    ({"flags": {"migStratgy": "none"}}, "flags.migStratgy", "unknown key"),
    ({"sharing": {"timeSlicing": {}}}, "sharing.timeSlicing.resources", "at least one"),
    ({"sharing": {"timeSlicing": {"resources": []}}}, "sharing.timeSlicing.resources", "at least"),
    ({"sharing": {"timeSlicing": {"resources": [{"replicas": 2}]}}},
     "sharing.timeSlicing.resources[0].name", "is required"),
    ({"sharing": {"timeSlicing": {"resources": [{"name": "gpu"}]}}},
     "sharing.timeSlicing.resources[0].replicas", "is required"),
    ({"sharing": {"timeSlicing": {"resources": [{"name": "gpu", "replicas": 1}]}}},
     "sharing.timeSlicing.resources[0].replicas", "at least 2"),
    ({"sharing": {"timeSlicing": {"resources": [{"name": "gpu", "replicas": "4"}]}}},
     "sharing.timeSlicing.resources[0].replicas", "whole number"),
    ({"sharing": {"mps": {"resources": [{"name": "GPU_Big", "replicas": 2}]}}},
     "sharing.mps.resources[0].name", "DNS"),
    ({"sharing": {"mps": {"resources": [{"name": "gpu", "replicas": 2, "devices": 0}]}}},
     "sharing.mps.resources[0].devices", "must be positive"),
    ({"sharing": {"mps": {"resources": [{"name": "gpu", "replicas": 2, "devices": ["x"]}]}}},
     "sharing.mps.resources[0].devices[0]", "GPU index"),
    ({"sharing": {"mps": {"resources": [{"name": "gpu", "replicas": 2, "replica": 3}]}}},
     "sharing.mps.resources[0].replica", "unknown key"),
    ({"flags": {"migStrategy": "mixed"},
      "sharing": {"mps": {"resources": [{"name": "gpu", "replicas": 2}]}}},
     "sharing.mps", "migStrategy mixed"),
    ({"sharing": {"timeSlicing": {"resources": [{"name": "gpu", "replicas": 2},
                                                {"name": "nvidia.com/gpu", "replicas": 3}]}}},
     "sharing.timeSlicing.resources[1].name", "listed twice"),
    ({"resources": {"gpus": [{"name": "gpu"}]}}, "resources.gpus[0].pattern", "is required"),
    (["version", "v1"], "", "expected a mapping"),
]  # fmt: skip


@pytest.mark.parametrize(("document", "path", "reason"), BAD_FILES)
def test_bad_files_are_refused_with_key_and_reason(
    document: Any, path: str, reason: str, tmp_path: Path
) -> None:
    with pytest.raises(NvidiaConfigError) as caught:
        parse_nvidia_config(document)
    assert caught.value.path == path
    assert reason in caught.value.reason
    # The same through the agent's loader and its command line: refused at start.
    file = tmp_path / "config.yaml"
    file.write_text(yaml.safe_dump(document))
    with pytest.raises(ConfigError, match="NVIDIA device-plugin config refused") as loaded:
        load_node_agent_settings(nvidia_config_file=str(file), flags={"node_name": "n"}, environ={})
    assert path in str(loaded.value) and str(file) in str(loaded.value)
    result = CliRunner().invoke(
        main, ["node-agent", "--node-name", "n"], env={"CONFIG_FILE": str(file)}
    )
    assert result.exit_code == 1
    assert path in result.output and reason in result.output


def test_unreadable_and_malformed_files(tmp_path: Path) -> None:
    with pytest.raises(NvidiaConfigError, match="cannot read"):
        load_nvidia_config(tmp_path / "missing.yaml")
    broken = tmp_path / "broken.yaml"
    broken.write_text("flags: [unclosed\n")
    with pytest.raises(NvidiaConfigError, match="neither YAML nor JSON"):
        load_nvidia_config(broken)


def test_precedence_file_then_vgpu_yaml_then_env_then_flags(tmp_path: Path) -> None:
    nvidia = tmp_path / "nvidia.yaml"
    nvidia.write_text(
        README_TIME_SLICING.replace("deviceIDStrategy: uuid", "deviceIDStrategy: index")
    )
    own = tmp_path / "vgpu.yaml"
    own.write_text("nodeagent:\n  sharing_replicas: 6\n  device_list_strategy: cdi-cri\n")
    settings = load_node_agent_settings(
        config_file=str(own),
        nvidia_config_file=str(nvidia),
        flags={"node_name": "n", "device_list_strategy": "envvar,volume-mounts"},
        environ={"VGPU_FAIL_REQUESTS_GREATER_THAN_ONE": "true"},
    )
    assert settings.sharing_mode == "time-slicing"  # the NVIDIA file
    assert settings.device_id_strategy == "index"  # the NVIDIA file
    assert settings.sharing_replicas == 6  # vgpu's YAML over the file
    assert settings.fail_requests_greater_than_one is True  # env over both
    assert settings.device_list_strategy == "envvar,volume-mounts"  # flag over all


# -- properties ------------------------------------------------------------------------------

names = st.builds(
    lambda head, tail: head + tail,
    st.sampled_from(["gpu", "nvidia.com/gpu", "sharedgpu", "a100", "t4-x"]),
    st.sampled_from(["", ".shared", "2", "-big"]),
)
FAST = hypothesis_settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
resources = st.fixed_dictionaries(
    {"name": names, "replicas": st.integers(2, 100)},
    optional={"rename": names},
)


def _short_name(resource: dict[str, Any]) -> str:
    return str(resource["name"]).removeprefix("nvidia.com/")


good_files = st.fixed_dictionaries(
    {},
    optional={
        "version": st.just("v1"),
        "flags": st.fixed_dictionaries(
            {},
            optional={
                "migStrategy": st.sampled_from(MIG_STRATEGIES),
                "failOnInitError": st.booleans(),
                "nvidiaDriverRoot": st.sampled_from(["/", "/run/nvidia/driver"]),
                "plugin": st.fixed_dictionaries(
                    {},
                    optional={
                        "passDeviceSpecs": st.booleans(),
                        "deviceListStrategy": st.one_of(
                            st.sampled_from(DEVICE_LIST_STRATEGIES),
                            st.lists(st.sampled_from(DEVICE_LIST_STRATEGIES), min_size=1),
                        ),
                        "deviceIDStrategy": st.sampled_from(DEVICE_ID_STRATEGIES),
                    },
                ),
            },
        ),
        "sharing": st.fixed_dictionaries(
            {},
            optional={
                "timeSlicing": st.fixed_dictionaries(
                    {"resources": st.lists(resources, min_size=1, max_size=3,
                                           unique_by=_short_name)},
                    optional={"renameByDefault": st.booleans(),
                              "failRequestsGreaterThanOne": st.booleans()},
                ),
            },
        ),
    },
)  # fmt: skip


@FAST
@given(good_files)
def test_every_valid_file_parses_and_its_settings_load(document: dict[str, Any]) -> None:
    config = parse_nvidia_config(document)
    values = settings_values(config)
    # What it states reaches the settings, with NVIDIA's meaning; nothing else is invented.
    flags = document.get("flags", {})
    if "migStrategy" in flags:
        assert values["mig_strategy"] == flags["migStrategy"]
    plugin = flags.get("plugin", {})
    if "deviceListStrategy" in plugin:
        given_list = plugin["deviceListStrategy"]
        given_list = [given_list] if isinstance(given_list, str) else given_list
        assert values["device_list_strategy"].split(",") == list(dict.fromkeys(given_list))
    shared = document.get("sharing", {}).get("timeSlicing")
    gpu = [r for r in (shared or {}).get("resources", []) if r["name"] in ("gpu", "nvidia.com/gpu")]
    if gpu:
        assert values["sharing_mode"] == "time-slicing"
        assert values["sharing_replicas"] == gpu[0]["replicas"]
        if "rename" in gpu[0]:
            rename = gpu[0]["rename"]
            expected = rename if "/" in rename else "nvidia.com/" + rename
            assert values["shared_resource_name"] == expected
    else:
        assert "sharing_mode" not in values
    with tempfile.NamedTemporaryFile("w", suffix=".yaml") as file:
        file.write(yaml.safe_dump(document))
        file.flush()
        settings = load_node_agent_settings(
            nvidia_config_file=file.name, flags={"node_name": "n"}, environ={}
        )
    for field, value in values.items():
        assert getattr(settings, field) == value


@FAST
@given(good_files, st.sampled_from(["flags", "sharing", "version"]), st.data())
def test_one_broken_value_is_refused_naming_its_path(
    document: dict[str, Any], where: str, data: st.DataObject
) -> None:
    """Break one value of a valid file: the error names exactly the key that was broken."""
    broken = json.loads(json.dumps(document))
    if where == "version":
        broken["version"] = data.draw(st.sampled_from(["v0", "v2", 1]))
        path = "version"
    elif where == "flags":
        key = data.draw(st.sampled_from(["migStrategy", "failOnInitError"]))
        broken.setdefault("flags", {})[key] = data.draw(st.sampled_from(["bogus", 7]))
        path = f"flags.{key}"
    else:
        replicas = data.draw(st.one_of(st.integers(-5, 1), st.just("2"), st.just(2.5)))
        broken["sharing"] = {"timeSlicing": {"resources": [{"name": "gpu", "replicas": replicas}]}}
        path = "sharing.timeSlicing.resources[0].replicas"
    with pytest.raises(NvidiaConfigError) as caught:
        parse_nvidia_config(broken)
    assert caught.value.path == path
