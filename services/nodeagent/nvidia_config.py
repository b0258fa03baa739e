"""NVIDIA's device-plugin config file (version v1), read with NVIDIA's meaning.

An operator's existing file (the ConfigMap NVIDIA's Helm chart mounts) works unchanged: its
`flags` and `sharing` keys become node-agent settings (`settings_values`); vgpu's own settings
stay in vgpu's YAML beside it. Keys NVIDIA knows but vgpu has no use for (GFD, IMEX, GDS,
...) are accepted and ignored. Anything else is refused with its key path and the reason,
as NVIDIA's plugin refuses a bad file at start. The file is YAML or JSON (JSON is YAML).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

log = logging.getLogger("vgpu.nodeagent")

VERSION = "v1"
RESOURCE_PREFIX = "nvidia.com/"
MAX_RESOURCE_NAME = 63
MIG_STRATEGIES = ("none", "single", "mixed")
DEVICE_LIST_STRATEGIES = ("envvar", "volume-mounts", "cdi-annotations", "cdi-cri")
DEVICE_ID_STRATEGIES = ("uuid", "index")
TIME_SLICING = "time-slicing"
MPS = "mps"

# Keys NVIDIA's v1 schema has that do not change what vgpu does (GPU feature discovery,
# IMEX channels, GDS/MOFED/GDRCOPY, CDI details): accepted, ignored.
_IGNORED_FLAGS = frozenset(
    {
        "nvidiaDevRoot",
        "gdrcopyEnabled",
        "gdsEnabled",
        "mofedEnabled",
        "deviceDiscoveryStrategy",
        "useNodeFeatureAPI",
        "gfd",
    }
)
_IGNORED_PLUGIN = frozenset(
    {"cdiAnnotationPrefix", "nvidiaCTKPath", "containerDriverRoot", "sharedDevicesAllocationPolicy"}
)
_DNS_LABEL = r"[a-z0-9]([-a-z0-9]*[a-z0-9])?"
_DNS_SUBDOMAIN = re.compile(rf"^{_DNS_LABEL}(\.{_DNS_LABEL})*$")
_GPU_UUID = re.compile(r"^(GPU|MIG)-[0-9A-Za-z./-]+$")
_INDEX = re.compile(r"^\d+(:\d+)?$")


class NvidiaConfigError(ValueError):
    """The file is refused; the message names the key path and the reason."""

    def __init__(self, path: str, reason: str) -> None:
        super().__init__(f"{path}: {reason}" if path else reason)
        self.path = path
        self.reason = reason


@dataclass(frozen=True)
class ReplicatedResource:
    """One `sharing.*.resources[]` entry: `name` advertised `replicas` times per GPU, under
    `rename` when given."""

    name: str
    replicas: int
    rename: str = ""

    @property
    def advertised(self) -> str:
        return self.rename or self.name


@dataclass(frozen=True)
class Sharing:
    strategy: str  # time-slicing | mps
    resources: tuple[ReplicatedResource, ...]
    fail_requests_greater_than_one: bool


@dataclass(frozen=True)
class NvidiaConfig:
    """What the file states; None = not stated (the node agent's default stands)."""

    mig_strategy: str | None = None
    fail_on_init_error: bool | None = None
    nvidia_driver_root: str | None = None
    mps_root: str | None = None
    pass_device_specs: bool | None = None
    device_list_strategy: tuple[str, ...] | None = None
    device_id_strategy: str | None = None
    sharing: Sharing | None = None
    warnings: tuple[str, ...] = field(default=(), compare=False)


def _mapping(value: Any, path: str) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise NvidiaConfigError(path, f"expected a mapping, got {_kind(value)}")
    for key in value:
        if not isinstance(key, str):
            raise NvidiaConfigError(path, f"keys must be strings, got {key!r}")
    return value


def _kind(value: Any) -> str:
    if value is None:
        return "nothing"
    if isinstance(value, bool):
        return f"the boolean {value}"
    if isinstance(value, int | float):
        return f"the number {value}"
    if isinstance(value, str):
        return f"the string {value!r}"
    if isinstance(value, list):
        return "a list"
    if isinstance(value, Mapping):
        return "a mapping"
    return type(value).__name__


def _unknown(section: Mapping[str, Any], path: str, known: frozenset[str]) -> None:
    for key in section:
        if key not in known:
            raise NvidiaConfigError(
                f"{path}.{key}" if path else key,
                f"unknown key (NVIDIA's v1 keys here: {', '.join(sorted(known))})",
            )


def _bool(value: Any, path: str) -> bool:
    if not isinstance(value, bool):
        raise NvidiaConfigError(path, f"expected true or false, got {_kind(value)}")
    return value


def _string(value: Any, path: str) -> str:
    if not isinstance(value, str):
        raise NvidiaConfigError(path, f"expected a string, got {_kind(value)}")
    return value


def _choice(value: Any, path: str, choices: tuple[str, ...]) -> str:
    text = _string(value, path)
    if text not in choices:
        raise NvidiaConfigError(path, f"must be one of {', '.join(choices)}, got {text!r}")
    return text


def _list_strategy(value: Any, path: str) -> tuple[str, ...]:
    """A string or a list of strings, as NVIDIA's deviceListStrategy."""
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list) or not items:
        raise NvidiaConfigError(path, f"expected a strategy or a list of them, got {_kind(value)}")
    found: list[str] = []
    for position, item in enumerate(items):
        where = path if isinstance(value, str) else f"{path}[{position}]"
        strategy = _choice(item, where, DEVICE_LIST_STRATEGIES)
        if strategy not in found:
            found.append(strategy)
    return tuple(found)


def resource_name(value: Any, path: str) -> str:
    """NVIDIA's rule: `nvidia.com/` added when there is no prefix; at most 63 characters;
    the part after `/` a DNS subdomain."""
    text = _string(value, path).strip()
    if not text:
        raise NvidiaConfigError(path, "must not be empty")
    if "/" not in text:
        text = RESOURCE_PREFIX + text
    if len(text) > MAX_RESOURCE_NAME:
        raise NvidiaConfigError(
            path, f"{text!r} is longer than {MAX_RESOURCE_NAME} characters with its prefix"
        )
    prefix, _, name = text.partition("/")
    if not _DNS_SUBDOMAIN.match(prefix) or not _DNS_SUBDOMAIN.match(name):
        raise NvidiaConfigError(
            path, f"{text!r} is not <domain>/<name> with lower-case DNS names on both sides"
        )
    return text


def _replicas(value: Any, path: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise NvidiaConfigError(path, f"expected a whole number, got {_kind(value)}")
    if value < 2:
        raise NvidiaConfigError(path, f"must be at least 2 to share a GPU, got {value}")
    return value


def _devices(value: Any, path: str, warnings: list[str]) -> None:
    """Checked as NVIDIA checks it, then reset to `all` (as NVIDIA's plugin does too)."""
    if value == "all":
        return
    if isinstance(value, bool):
        raise NvidiaConfigError(path, f'expected "all", a count or a list, got {_kind(value)}')
    if isinstance(value, int):
        if value <= 0:
            raise NvidiaConfigError(path, f"a device count must be positive, got {value}")
    elif isinstance(value, list):
        for position, item in enumerate(value):
            text = str(item) if isinstance(item, int) and not isinstance(item, bool) else item
            if not isinstance(text, str) or not (_INDEX.match(text) or _GPU_UUID.match(text)):
                raise NvidiaConfigError(
                    f"{path}[{position}]",
                    f"expected a GPU index (0), a MIG index (0:1) or a GPU/MIG UUID, "
                    f"got {_kind(item)}",
                )
    else:
        raise NvidiaConfigError(path, f'expected "all", a count or a list, got {_kind(value)}')
    warnings.append(f"{path} is ignored: every GPU is shared (as NVIDIA's plugin does)")


_RESOURCE_KEYS = frozenset({"name", "rename", "replicas", "devices"})
_SHARING_KEYS = frozenset({"renameByDefault", "failRequestsGreaterThanOne", "resources"})


def _sharing(value: Any, path: str, strategy: str, warnings: list[str]) -> Sharing:
    section = _mapping(value, path)
    _unknown(section, path, _SHARING_KEYS)
    rename_by_default = _bool(section.get("renameByDefault", False), f"{path}.renameByDefault")
    # MPS refuses more than one replica per container unless told otherwise (NVIDIA v0.20).
    fail_default = strategy == MPS
    fail = _bool(
        section.get("failRequestsGreaterThanOne", fail_default),
        f"{path}.failRequestsGreaterThanOne",
    )
    items = section.get("resources")
    if not isinstance(items, list) or not items:
        raise NvidiaConfigError(f"{path}.resources", "must list at least one resource")
    resources: list[ReplicatedResource] = []
    for position, item in enumerate(items):
        where = f"{path}.resources[{position}]"
        entry = _mapping(item, where)
        _unknown(entry, where, _RESOURCE_KEYS)
        if "name" not in entry:
            raise NvidiaConfigError(f"{where}.name", "is required")
        if "replicas" not in entry:
            raise NvidiaConfigError(f"{where}.replicas", "is required")
        name = resource_name(entry["name"], f"{where}.name")
        replicas = _replicas(entry["replicas"], f"{where}.replicas")
        rename = ""
        if entry.get("rename") not in (None, ""):
            rename = resource_name(entry["rename"], f"{where}.rename")
        elif rename_by_default:
            rename = f"{name}.shared"
        if "devices" in entry:
            _devices(entry["devices"], f"{where}.devices", warnings)
        if any(r.name == name for r in resources):
            raise NvidiaConfigError(f"{where}.name", f"{name!r} is listed twice")
        resources.append(ReplicatedResource(name=name, replicas=replicas, rename=rename))
    return Sharing(
        strategy=strategy, resources=tuple(resources), fail_requests_greater_than_one=fail
    )


_TOP_KEYS = frozenset({"version", "flags", "resources", "sharing", "imex"})
_FLAG_KEYS = frozenset(
    {"migStrategy", "failOnInitError", "nvidiaDriverRoot", "mpsRoot", "plugin", *_IGNORED_FLAGS}
)
_PLUGIN_KEYS = frozenset(
    {"passDeviceSpecs", "deviceListStrategy", "deviceIDStrategy", *_IGNORED_PLUGIN}
)


def parse_nvidia_config(document: Any) -> NvidiaConfig:
    """The config from a loaded YAML/JSON document; NvidiaConfigError naming the key."""
    if document is None:
        return NvidiaConfig()
    top = _mapping(document, "")
    _unknown(top, "", _TOP_KEYS)
    version = top.get("version", VERSION)
    if version != VERSION:
        raise NvidiaConfigError("version", f"unknown version {version!r} (only {VERSION!r})")
    warnings: list[str] = []
    values: dict[str, Any] = {}
    flags = _mapping(top.get("flags") or {}, "flags")
    _unknown(flags, "flags", _FLAG_KEYS)
    if flags.get("migStrategy") is not None:
        values["mig_strategy"] = _choice(flags["migStrategy"], "flags.migStrategy", MIG_STRATEGIES)
    if flags.get("failOnInitError") is not None:
        values["fail_on_init_error"] = _bool(flags["failOnInitError"], "flags.failOnInitError")
    for key, name in (("nvidiaDriverRoot", "nvidia_driver_root"), ("mpsRoot", "mps_root")):
        if flags.get(key) is not None:
            text = _string(flags[key], f"flags.{key}")
            if not text.startswith("/"):
                raise NvidiaConfigError(f"flags.{key}", f"must be an absolute path, got {text!r}")
            values[name] = text
    plugin = _mapping(flags.get("plugin") or {}, "flags.plugin")
    _unknown(plugin, "flags.plugin", _PLUGIN_KEYS)
    if plugin.get("passDeviceSpecs") is not None:
        values["pass_device_specs"] = _bool(
            plugin["passDeviceSpecs"], "flags.plugin.passDeviceSpecs"
        )
    if plugin.get("deviceListStrategy") is not None:
        values["device_list_strategy"] = _list_strategy(
            plugin["deviceListStrategy"], "flags.plugin.deviceListStrategy"
        )
    if plugin.get("deviceIDStrategy") is not None:
        values["device_id_strategy"] = _choice(
            plugin["deviceIDStrategy"], "flags.plugin.deviceIDStrategy", DEVICE_ID_STRATEGIES
        )
    _resources_section(top.get("resources"), warnings)
    sharing = _mapping(top.get("sharing") or {}, "sharing")
    _unknown(sharing, "sharing", frozenset({"timeSlicing", "mps"}))
    chosen: Sharing | None = None
    if sharing.get("mps") is not None:
        chosen = _sharing(sharing["mps"], "sharing.mps", MPS, warnings)
        if sharing.get("timeSlicing") is not None:
            warnings.append("sharing.timeSlicing is ignored: sharing.mps is given (as NVIDIA)")
        if values.get("mig_strategy") == "mixed":
            raise NvidiaConfigError("sharing.mps", "MPS cannot be used with migStrategy mixed")
    elif sharing.get("timeSlicing") is not None:
        chosen = _sharing(sharing["timeSlicing"], "sharing.timeSlicing", TIME_SLICING, warnings)
    return NvidiaConfig(**values, sharing=chosen, warnings=tuple(warnings))


def _resources_section(value: Any, warnings: list[str]) -> None:
    """`resources.gpus[]`/`resources.mig[]`: checked, then ignored, as NVIDIA does."""
    if value is None:
        return
    section = _mapping(value, "resources")
    _unknown(section, "resources", frozenset({"gpus", "mig"}))
    for kind, items in section.items():
        if not isinstance(items, list):
            raise NvidiaConfigError(f"resources.{kind}", f"expected a list, got {_kind(items)}")
        for position, item in enumerate(items):
            entry = _mapping(item, f"resources.{kind}[{position}]")
            for key in ("pattern", "name"):
                if not isinstance(entry.get(key), str) or not entry[key]:
                    raise NvidiaConfigError(f"resources.{kind}[{position}].{key}", "is required")
    warnings.append("resources is ignored: resource naming in the config is disabled (as NVIDIA)")


def load_nvidia_config(path: str | Path) -> NvidiaConfig:
    """Read and parse the file; NvidiaConfigError naming the file and the key."""
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise NvidiaConfigError("", f"cannot read {path}: {exc.strerror}") from exc
    try:
        document = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise NvidiaConfigError("", f"{path} is neither YAML nor JSON: {exc}") from exc
    try:
        config = parse_nvidia_config(document)
    except NvidiaConfigError as exc:
        raise NvidiaConfigError(exc.path, f"{exc.reason} (in {path})") from exc
    for warning in config.warnings:
        log.warning("NVIDIA config: " + warning, extra={"file": str(path)})
    return config


def settings_values(config: NvidiaConfig, gpu_resource: str = "nvidia.com/gpu") -> dict[str, Any]:
    """The node-agent settings the file states (NodeAgentSettings field names)."""
    values: dict[str, Any] = {}
    for name in (
        "mig_strategy",
        "fail_on_init_error",
        "nvidia_driver_root",
        "mps_root",
        "pass_device_specs",
        "device_id_strategy",
    ):
        value = getattr(config, name)
        if value is not None:
            values[name] = value
    if config.device_list_strategy is not None:
        values["device_list_strategy"] = ",".join(config.device_list_strategy)
    sharing = config.sharing
    if sharing is not None:
        for resource in sharing.resources:
            if resource.name != gpu_resource:
                # NVIDIA skips a name it does not advertise; say so instead of silence.
                log.warning(
                    "NVIDIA config: sharing resource not advertised by vgpu; ignored",
                    extra={"resource": resource.name},
                )
                continue
            values["sharing_mode"] = sharing.strategy
            values["sharing_replicas"] = resource.replicas
            values["shared_resource_name"] = resource.rename
            values["fail_requests_greater_than_one"] = sharing.fail_requests_greater_than_one
    return values
