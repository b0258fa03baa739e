"""A replay through the real PlacementCore: conversion, checkpoints, CPU, models, JSON."""

from __future__ import annotations

import io
import json

import pytest

from services.allocator.core import PodRef
from services.simulate.replay import (
    ReplayResult,
    build_core,
    from_record,
    manifest,
    mean_results,
    policy_names,
    replay,
    to_record,
)
from services.simulate.runner import ProgressBar
from services.simulate.trace import TraceNode, TracePod
from services.simulate.workload import arrivals, gpu_capacity

JSON_KEYS = [
    "policy", "method", "seed", "alloc_at_100", "alloc_at_110", "alloc_at_120", "alloc_at_130",
    "failed_pods", "decision_ms_p50", "decision_ms_p99",
]  # fmt: skip


def node(name: str, gpus: int = 1, model: str = "T4", memory: int = 15109,
         cpu: int = 64000) -> TraceNode:  # fmt: skip
    return TraceNode(name, cpu_milli=cpu, memory_mib=65536, gpus=gpus, model=model,
                     gpu_memory_mib=memory)  # fmt: skip


def pod(milli: int = 1000, gpus: int = 1, cpu: int = 1000, models: tuple[str, ...] = (),
        name: str = "p") -> TracePod:  # fmt: skip
    return TracePod(name, cpu_milli=cpu, memory_mib=1024, num_gpu=gpus,
                    gpu_milli=milli if gpus == 1 else 1000 * gpus, gpu_models=models)  # fmt: skip


def test_a_share_becomes_memory_and_compute_of_the_model() -> None:
    core = build_core([node("a", model="V100M32", memory=32510)], "binpack", 0)
    request = core.parse(manifest(pod(470, models=("V100M32",)), "u1"))
    (container,) = request.containers
    assert (container.gpus, container.memory_percent, container.cores) == (1, 47, 47)
    assert request.selection.use_types == ("v100m32",)
    assert (request.cpu_milli, request.memory_mib) == (1000, 1024)
    assert core.best_node(request) == "a"
    placed = core.commit(PodRef("t", "p", "u1"), "a", request)
    (piece,) = placed.containers["main"].slices
    assert (piece.memory_mib, piece.cores) == (32510 * 47 // 100, 47)  # MiB from the model table
    whole = core.parse(manifest(pod(gpus=2), "u2")).containers[0]
    assert (whole.gpus, whole.cores, whole.memory_percent, whole.memory_mib) == (2, 100, 0, 0)


def test_allocation_ratio_at_each_demand_level_and_failed_pods() -> None:
    nodes = [node("a"), node("b")]  # capacity: 2 GPUs
    sequence = [pod(1000), pod(500), pod(500), pod(600)]  # demand 0.5, 0.75, 1.0, 1.3
    result = replay(nodes, sequence, "binpack", 0)
    assert result.to_json()["alloc_at_100"] == 100.0
    assert result.alloc_at == {1.0: 1.0, 1.1: 1.0, 1.2: 1.0, 1.3: 1.0}
    assert result.failed_pods == 1  # the 0.6 finds no room
    assert len(result.decision_ms) == 4 and all(ms >= 0 for ms in result.decision_ms)
    assert result.curve[-1][0] == pytest.approx(1.3)


def test_levels_not_reached_are_null_in_json() -> None:
    result = replay([node("a"), node("b")], [pod(1000)], "binpack", 0)
    row = result.to_json()
    assert list(row) == JSON_KEYS
    assert row["alloc_at_100"] is None and row["failed_pods"] == 0


def test_cpu_and_host_memory_count_for_gpu_and_cpu_only_pods() -> None:
    nodes = [node("a", cpu=4000)]
    # The GPU has room for both halves; the node's CPU only for one.
    result = replay(nodes, [pod(500, cpu=3000), pod(500, cpu=3000)], "binpack", 0)
    assert result.failed_pods == 1
    # A CPU-only pod takes the CPU a GPU pod needed.
    cpu_only = TracePod("c", cpu_milli=3000, memory_mib=1024, num_gpu=0, gpu_milli=0)
    result = replay(nodes, [cpu_only, pod(500, cpu=3000)], "binpack", 0)
    assert result.failed_pods == 1
    assert result.to_json()["alloc_at_100"] is None  # 0.5 of 1 GPU asked, none placed
    assert result.curve[-1] == (0.5, 0.0)


def test_model_constraints_are_honoured() -> None:
    nodes = [node("t4"), node("v100", model="V100M32", memory=32510)]
    result = replay(nodes, [pod(1000, models=("V100M32",)), pod(1000, models=("V100M32",))],
                    "firstfit", 0)  # fmt: skip
    assert result.failed_pods == 1  # firstfit would take t4 first if it could


def test_demand_is_inflated_by_drawing_more_pods_from_the_file() -> None:
    nodes = [node(f"n{i}", gpus=2) for i in range(5)]  # 10 GPUs
    file = [pod(500, name=f"p{i}") for i in range(6)]  # 3 GPUs asked by the whole file
    sequence = arrivals(file, gpu_capacity(nodes), 1.3, seed=3)
    assert sum(p.gpu_demand for p in sequence) == pytest.approx(13.0)
    result = replay(nodes, sequence, "hostpack", 3)
    assert result.pods == 26 and result.failed_pods == 6  # 20 halves fill 10 GPUs
    assert result.alloc_at[1.3] == 1.0


def test_every_policy_replays_and_mean_results_average_seeds() -> None:
    nodes = [node("a", gpus=2), node("b", gpus=4, model="V100M32", memory=32510)]
    file = [pod(300), pod(700), pod(1000), pod(gpus=2), pod(500, models=("T4",))]
    results = []
    for policy in policy_names():
        for seed in (0, 1):
            sequence = arrivals(file, gpu_capacity(nodes), 1.3, seed)
            result = replay(nodes, sequence, policy, seed)
            assert 0 < result.alloc_at[1.3] <= 1.0, policy
            results.append(result)
    merged = mean_results([r for r in results if r.policy == "fgd"])
    assert merged["seed"] == [0, 1] and list(merged)[3:] == JSON_KEYS[3:]


def test_a_record_gives_back_the_same_json_curve_and_plot_data() -> None:
    nodes = [node("a", gpus=2), node("b", gpus=2)]
    file = [pod(300), pod(700), pod(1000, cpu=30000)]
    result = replay(nodes, arrivals(file, gpu_capacity(nodes), 1.3, 2), "hostpack", 2)
    record = json.loads(json.dumps(to_record(result)))  # as the table's raw file holds it
    again = from_record(record)
    assert again.to_json() == result.to_json()
    assert again.curve == result.curve and again.seconds == round(result.seconds, 2)
    assert mean_results([again]) == mean_results([result])


def test_percentiles() -> None:
    result = ReplayResult("x", 0, 1, decision_ms=[float(i) for i in range(1, 101)])
    assert (result.percentile_ms(0.5), result.percentile_ms(0.99)) == (51.0, 100.0)


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_bar_only_on_a_terminal() -> None:
    tty, pipe = _Tty(), io.StringIO()
    for stream in (tty, pipe):
        bar = ProgressBar("fgd", stream)
        for done in range(1, 201):
            bar(done, 200)
    assert "[" in tty.getvalue() and "200/200" in tty.getvalue()
    assert pipe.getvalue() == ""
