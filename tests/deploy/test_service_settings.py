"""Containers run real `vgpu` commands, and every VGPU_* variable they set is a real setting.

The manifests and the compose file configure the services through VGPU_<FIELD> variables
(services/common/config.py). A misspelt name would be ignored silently by the service, so
here each container's environment is loaded into its command's settings Struct exactly as
the service loads it: the names must be fields and the values must convert.
"""

from __future__ import annotations

from typing import Any

import click
import pytest

from services.allocator.settings import AllocatorSettings
from services.cli.main import main as vgpu
from services.common.config import ENV_PREFIX, load_settings
from services.metrics.settings import MetricsSettings
from services.nodeagent.settings import NodeAgentSettings, check_settings
from services.simulators.kubelet import KubeletSimSettings
from tests.deploy.manifests import OVERLAYS, containers, env_of, pod_objects, render
from tests.deploy.test_compose import compose_config

SETTINGS: dict[str, tuple[type[Any], str]] = {
    "allocator": (AllocatorSettings, "allocator"),
    "node-agent": (NodeAgentSettings, "nodeagent"),
    "metrics": (MetricsSettings, "metrics"),
    "kubelet-sim": (KubeletSimSettings, "kubeletsim"),
}
# What Kubernetes fills in at run time (valueFrom), as the service would see it.
FROM_CLUSTER = {
    "VGPU_NATS_URL": "nats://user:password@vgpu-nats:4222",
    "VGPU_NODE_NAME": "gpu-node-1",
    "VGPU_REPLICA_ID": "vgpu-allocator-5d9c7-x2x4q",
}


def _check(command: list[str], env: dict[str, Any], where: str) -> None:
    cli = vgpu.get_command(click.Context(vgpu), command[0])
    assert cli is not None, f"{where}: `vgpu {command[0]}` does not exist"
    options = {opt for param in cli.params for opt in getattr(param, "opts", [])}
    for arg in command[1:]:
        if arg.startswith("-"):
            assert arg.split("=", 1)[0] in options, f"{where}: vgpu {command[0]} has no {arg}"
    try:  # the values must parse as the command reads them
        cli.make_context(command[0], list(command[1:]))
    except click.ClickException as exc:
        raise AssertionError(f"{where}: vgpu {' '.join(command)}: {exc.format_message()}") from exc
    settings_type, section = SETTINGS[command[0]]
    variables = {k: v for k, v in env.items() if k.startswith(ENV_PREFIX)}
    fields = set(settings_type.__struct_fields__)
    unknown = sorted(k for k in variables if k.removeprefix(ENV_PREFIX).lower() not in fields)
    assert not unknown, f"{where}: {unknown} are not {settings_type.__name__} fields"
    environ = {k: FROM_CLUSTER[k] if isinstance(v, dict) else str(v) for k, v in variables.items()}
    settings = load_settings(settings_type, section=section, environ=environ)
    if settings_type is NodeAgentSettings:
        check_settings(settings)


@pytest.mark.parametrize("overlay", OVERLAYS, ids=lambda o: o or "default")
def test_manifest_containers(overlay: str) -> None:
    checked = 0
    for obj in pod_objects(render(overlay)):
        for container in containers(obj):
            command = container.get("command", [])
            if command[:1] == ["vgpu"]:
                where = f"{obj['metadata']['name']}/{container['name']}"
                args = [*command[1:], *container.get("args", [])]
                _check(args, env_of(container), where)
                checked += 1
    assert checked == 3  # allocator, node agent, metrics


def test_compose_services() -> None:
    services = compose_config()["services"]
    checked = 0
    for name, service in services.items():
        if service["image"].startswith("vgpu/services:"):
            _check([str(a) for a in service["command"]], service.get("environment") or {}, name)
            checked += 1
    assert checked == 6


def test_a_misspelt_variable_is_caught() -> None:
    with pytest.raises(AssertionError, match="VGPU_HTTP_PROT"):
        _check(["allocator"], {"VGPU_HTTP_PROT": "8080"}, "allocator")
    with pytest.raises(AssertionError, match="has no --listen"):
        _check(["metrics", "--listen=1"], {}, "metrics")
