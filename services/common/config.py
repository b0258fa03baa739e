"""Settings from a YAML file, then the environment, then command-line flags (last wins).

Each service declares its settings as a msgspec Struct. The YAML file may hold them at the
top level or under a section named after the service; environment variables are
``VGPU_<FIELD>`` in upper case. Values are converted and validated against the Struct, and a
bad one is reported by name.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, TypeVar

import msgspec
import yaml

S = TypeVar("S", bound=msgspec.Struct)

ENV_PREFIX = "VGPU_"


class ConfigError(ValueError):
    pass


def _from_file(path: str | os.PathLike[str], section: str) -> dict[str, Any]:
    try:
        loaded = yaml.safe_load(Path(path).read_text())
    except OSError as exc:
        raise ConfigError(f"cannot read config file {path}: {exc.strerror}") from exc
    except yaml.YAMLError as exc:
        raise ConfigError(f"config file {path} is not valid YAML: {exc}") from exc
    if loaded is None:
        return {}
    if not isinstance(loaded, Mapping):
        raise ConfigError(f"config file {path}: expected a mapping at the top level")
    scoped = loaded.get(section)
    if isinstance(scoped, Mapping):
        return dict(scoped)
    return {k: v for k, v in loaded.items() if not isinstance(v, Mapping)}


def _from_env(
    fields: tuple[str, ...], environ: Mapping[str, str], list_fields: frozenset[str] = frozenset()
) -> dict[str, Any]:
    found: dict[str, Any] = {}
    for field in fields:
        value = environ.get(ENV_PREFIX + field.upper())
        if value is not None:
            # A list from one variable: comma-separated (VGPU_ADOPT_SCHEDULERS=a,b; "" = none).
            found[field] = (
                [v.strip() for v in value.split(",") if v.strip()]
                if field in list_fields
                else value
            )
    return found


def _list_fields(settings_type: type[msgspec.Struct]) -> frozenset[str]:
    return frozenset(
        f.name
        for f in msgspec.structs.fields(settings_type)
        if getattr(f.type, "__origin__", None) is list
    )


def load_settings(
    settings_type: type[S],
    *,
    section: str,
    file: str | os.PathLike[str] | None = None,
    overrides: Mapping[str, Any] | None = None,
    environ: Mapping[str, str] | None = None,
    defaults: Mapping[str, Any] | None = None,
) -> S:
    """`defaults` (e.g. what a peer system's config file states) are overridden by the file,
    which the environment overrides, which `overrides` (flags) override."""
    fields = settings_type.__struct_fields__
    merged: dict[str, Any] = dict(defaults or {})
    if file:
        merged.update(_from_file(file, section))
    env = os.environ if environ is None else environ
    merged.update(_from_env(fields, env, _list_fields(settings_type)))
    merged.update({k: v for k, v in (overrides or {}).items() if v is not None})
    unknown = sorted(set(merged) - set(fields))
    if unknown:
        raise ConfigError(f"unknown {section} setting(s): {', '.join(unknown)}")
    try:
        return msgspec.convert(merged, settings_type, strict=False)
    except msgspec.ValidationError as exc:
        raise ConfigError(f"invalid {section} setting: {exc}") from exc
