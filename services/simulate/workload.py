"""The arrival sequence of the paper's method: shuffle, then draw until demand is reached."""

from __future__ import annotations

import random
from collections.abc import Sequence

from services.simulate.trace import TraceNode, TracePod


def gpu_capacity(nodes: Sequence[TraceNode]) -> int:
    return sum(node.gpus for node in nodes)


def arrivals(
    pods: Sequence[TracePod], capacity_gpus: float, demand: float, seed: int
) -> list[TracePod]:
    """Pods in arrival order until their GPU demand reaches `demand` x capacity.

    The file's pods are shuffled with `seed`; if they are not enough, more are drawn at random
    (with replacement) from the same file. CPU-only pods arrive too: they take CPU and memory.
    """
    if demand <= 0:
        raise ValueError(f"demand must be positive, got {demand}")
    if not any(pod.gpu_demand > 0 for pod in pods):
        raise ValueError("the pod list asks for no GPUs: demand can never be reached")
    rng = random.Random(seed)
    order = list(pods)
    rng.shuffle(order)
    target = demand * capacity_gpus
    sequence: list[TracePod] = []
    asked = 0.0
    for pod in order:
        if asked >= target:
            return sequence
        sequence.append(pod)
        asked += pod.gpu_demand
    while asked < target:
        pod = rng.choice(pods)
        sequence.append(pod)
        asked += pod.gpu_demand
    return sequence
