"""Readers for cluster traces: Alibaba's openb CSV format and vgpu's own YAML format.

openb (cluster-trace-gpu-v2023, Weng et al., USENIX ATC'23) has no GPU-memory column; a GPU
share is turned into memory with the per-model table its simulator uses (COLUMNS.md).
"""

from __future__ import annotations

import csv
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

# MiB per GPU model, as the paper's simulator counts them.
OPENB_MODEL_MEMORY_MIB: dict[str, int] = {
    "T4": 15109,
    "V100M16": 16160,
    "P100": 16280,
    "A10": 22731,
    "V100M32": 32510,
    "G2": 20000,
    "G3": 30000,
}


class TraceError(ValueError):
    """A trace file is unreadable or malformed; the message names the file and row."""


@dataclass(frozen=True)
class TraceNode:
    name: str
    cpu_milli: int
    memory_mib: int
    gpus: int
    model: str  # "" for a node without GPUs
    gpu_memory_mib: int  # per GPU


@dataclass(frozen=True)
class TracePod:
    name: str
    cpu_milli: int
    memory_mib: int
    num_gpu: int
    gpu_milli: int  # for num_gpu == 1: thousandths of one GPU; whole GPUs otherwise
    gpu_models: tuple[str, ...] = ()  # accepted models; empty = any

    @property
    def gpu_demand(self) -> float:
        """GPUs this pod asks for, as the paper counts demand."""
        if self.num_gpu == 1:
            return self.gpu_milli / 1000
        return float(self.num_gpu)


def _rows(path: Path, required: Iterable[str]) -> Iterable[tuple[int, dict[str, str]]]:
    try:
        handle = path.open(newline="")
    except OSError as exc:
        raise TraceError(f"cannot read {path}: {exc.strerror}") from exc
    with handle:
        reader = csv.DictReader(handle)
        missing = sorted(set(required) - set(reader.fieldnames or ()))
        if missing:
            raise TraceError(f"{path}: missing column(s) {', '.join(missing)}")
        yield from enumerate(reader, start=2)  # row 1 is the header


def _int(row: Mapping[str, str], column: str, where: str) -> int:
    value = (row.get(column) or "").strip()
    try:
        number = int(value)
    except ValueError:
        raise TraceError(f"{where}: column {column} is not a whole number: {value!r}") from None
    if number < 0:
        raise TraceError(f"{where}: column {column} is negative: {number}")
    return number


def read_openb_nodes(path: Path) -> list[TraceNode]:
    nodes = []
    for number, row in _rows(path, ("sn", "cpu_milli", "memory_mib", "gpu", "model")):
        where = f"{path}:{number}"
        gpus = _int(row, "gpu", where)
        model = (row.get("model") or "").strip()
        if gpus and model not in OPENB_MODEL_MEMORY_MIB:
            raise TraceError(f"{where}: unknown GPU model {model!r}")
        nodes.append(
            TraceNode(
                name=row["sn"].strip(),
                cpu_milli=_int(row, "cpu_milli", where),
                memory_mib=_int(row, "memory_mib", where),
                gpus=gpus,
                model=model if gpus else "",
                gpu_memory_mib=OPENB_MODEL_MEMORY_MIB.get(model, 0) if gpus else 0,
            )
        )
    return nodes


def read_openb_pods(path: Path) -> list[TracePod]:
    pods = []
    for number, row in _rows(path, ("name", "cpu_milli", "memory_mib", "num_gpu", "gpu_milli")):
        where = f"{path}:{number}"
        num_gpu = _int(row, "num_gpu", where)
        gpu_milli = _int(row, "gpu_milli", where)
        if num_gpu == 1 and not 0 < gpu_milli <= 1000:
            raise TraceError(f"{where}: gpu_milli must be 1-1000 for one GPU, got {gpu_milli}")
        models = tuple(m for m in (row.get("gpu_spec") or "").split("|") if m)
        unknown = [m for m in models if m not in OPENB_MODEL_MEMORY_MIB]
        if unknown:
            raise TraceError(f"{where}: unknown GPU model(s) in gpu_spec: {', '.join(unknown)}")
        pods.append(
            TracePod(
                name=row["name"].strip(),
                cpu_milli=_int(row, "cpu_milli", where),
                memory_mib=_int(row, "memory_mib", where),
                num_gpu=num_gpu,
                gpu_milli=gpu_milli if num_gpu == 1 else 1000 * num_gpu,
                gpu_models=models,
            )
        )
    return pods


def _yaml(path: Path) -> Any:
    try:
        return yaml.safe_load(path.read_text())
    except OSError as exc:
        raise TraceError(f"cannot read {path}: {exc.strerror}") from exc
    except yaml.YAMLError as exc:
        raise TraceError(f"{path} is not valid YAML: {exc}") from exc


def _yaml_items(path: Path, key: str) -> Iterable[tuple[str, dict[str, Any]]]:
    """(where, item) for each named mapping in the list under `key` of a YAML file."""
    loaded = _yaml(path)
    items = loaded.get(key) if isinstance(loaded, dict) else None
    if not isinstance(items, list):
        raise TraceError(f"{path}: expected a mapping with a list under {key!r}")
    for index, item in enumerate(items):
        where = f"{path}: {key}[{index}]"
        if not isinstance(item, dict) or not item.get("name"):
            raise TraceError(f"{where}: expected a mapping with a name")
        yield where, item


def read_yaml_nodes(path: Path) -> list[TraceNode]:
    """vgpu's format: ``nodes: [{name, gpus, model, gpu_memory_mib, cpu_milli, memory_mib}]``."""
    nodes = []
    for where, item in _yaml_items(path, "nodes"):
        fields = {k: str(item.get(k, 0)) for k in ("gpus", "cpu_milli", "memory_mib")}
        gpus = _int(fields, "gpus", where)
        model = str(item.get("model", ""))
        memory = item.get("gpu_memory_mib", OPENB_MODEL_MEMORY_MIB.get(model, 0))
        if gpus and not (isinstance(memory, int) and memory > 0):
            raise TraceError(f"{where}: gpu_memory_mib must be given for model {model!r}")
        nodes.append(
            TraceNode(
                name=str(item["name"]),
                cpu_milli=_int(fields, "cpu_milli", where),
                memory_mib=_int(fields, "memory_mib", where),
                gpus=gpus,
                model=model if gpus else "",
                gpu_memory_mib=memory if gpus else 0,
            )
        )
    return nodes


def read_yaml_pods(path: Path) -> list[TracePod]:
    """vgpu's format: ``pods: [{name, cpu_milli, memory_mib, gpus, gpu_milli, models}]``."""
    pods = []
    for where, item in _yaml_items(path, "pods"):
        fields = {k: str(item.get(k, 0)) for k in ("gpus", "gpu_milli", "cpu_milli", "memory_mib")}
        gpus = _int(fields, "gpus", where)
        milli = _int(fields, "gpu_milli", where) if gpus == 1 else 1000 * gpus
        if gpus == 1 and not 0 < milli <= 1000:
            raise TraceError(f"{where}: gpu_milli must be 1-1000 for one GPU, got {milli}")
        models = item.get("models") or []
        if not isinstance(models, list) or not all(isinstance(m, str) for m in models):
            raise TraceError(f"{where}: models must be a list of GPU model names")
        pods.append(
            TracePod(
                name=str(item["name"]),
                cpu_milli=_int(fields, "cpu_milli", where),
                memory_mib=_int(fields, "memory_mib", where),
                num_gpu=gpus,
                gpu_milli=milli,
                gpu_models=tuple(models),
            )
        )
    return pods


def read_nodes(path: Path) -> list[TraceNode]:
    return read_yaml_nodes(path) if path.suffix in (".yaml", ".yml") else read_openb_nodes(path)


def read_pods(path: Path) -> list[TracePod]:
    return read_yaml_pods(path) if path.suffix in (".yaml", ".yml") else read_openb_pods(path)
