"""`--method paper`: the FGD paper's simulator (workload tuning, typical pods, fragmentation,
the baselines placing every pod by their own rule)."""

from __future__ import annotations

import random

import pytest

from services.simulate import paper
from services.simulate.paper import (
    Fragmentation,
    PaperCluster,
    PaperNode,
    Shape,
    arrivals,
    shape,
    typical_pods,
)
from services.simulate.trace import TraceNode, TracePod


def gpu_pod(name: str, milli: int, cpu: int = 1000, gpus: int = 1) -> TracePod:
    return TracePod(name, cpu, 1024, gpus, milli if gpus == 1 else 1000 * gpus)


def cpu_pod(name: str, cpu: int) -> TracePod:
    return TracePod(name, cpu, 1024, 0, 0)


def cluster(policy: str, *nodes: PaperNode, typical: list | None = None) -> PaperCluster:
    frag = Fragmentation(typical or [(Shape(1000, 600, 1), 1.0)])
    return PaperCluster(list(nodes), policy, random.Random(0), frag)


def test_tuning_draws_up_to_the_target_without_overshooting() -> None:
    pods = [gpu_pod(f"p{i}", 500) for i in range(4)] + [cpu_pod("c", 2000)]
    sequence = arrivals(pods, capacity_gpus=10, demand=1.3, rng=random.Random(3))
    asked = sum(shape(p).total_milli for p in sequence)
    assert 12_500 <= asked <= 13_000  # the next 500-milli draw would pass 13,000
    assert sorted(p.name for p in sequence[:5]) == ["c", "p0", "p1", "p2", "p3"]  # all, shuffled
    again = arrivals(pods, 10, 1.3, random.Random(3))
    other = arrivals(pods, 10, 1.3, random.Random(4))
    assert [p.name for p in again] == [p.name for p in sequence]
    assert [p.name for p in other] != [p.name for p in sequence]


def test_tuning_drops_pods_from_a_file_above_the_target() -> None:
    pods = [gpu_pod(f"p{i}", 1000) for i in range(20)]
    sequence = arrivals(pods, capacity_gpus=10, demand=1.3, rng=random.Random(0))
    assert len(sequence) == 13


def test_typical_pods_cover_95_percent_with_cpu_only_shapes() -> None:
    pods = [gpu_pod(f"a{i}", 500) for i in range(60)] + [cpu_pod(f"c{i}", 2000) for i in range(38)]
    pods += [gpu_pod("rare1", 300), gpu_pod("rare2", 700)]
    typical = typical_pods(pods)
    assert [s for s, _ in typical] == [Shape(1000, 500, 1), Shape(2000, 0, 0)]
    assert sum(f for _, f in typical) == pytest.approx(1.0)
    assert typical[0][1] == pytest.approx(60 / 98)


def test_fragmentation_counts_gpus_too_small_for_the_typical_pods() -> None:
    frag = Fragmentation([(Shape(1000, 600, 1), 0.5), (Shape(500, 0, 0), 0.5)])
    # A 600-milli pod fits GPU 0 only: GPU 1's 400 is fragment for it; for the CPU-only
    # pod every free milli is. 0.5 x 400 + 0.5 x 1400.
    assert frag.amount("T4", 8000, [1000, 400]) == pytest.approx(900)
    # Without the CPU for it, the GPU pod sees all 1,400 as fragment.
    assert frag.amount("T4", 800, [1000, 400]) == pytest.approx(1400)
    typed = Fragmentation([(Shape(1000, 600, 1, ("V100M16",)), 1.0)])
    assert typed.amount("T4", 8000, [1000]) == pytest.approx(1000)  # it may not use a T4


def test_fgd_and_bestfit_pick_different_gpus() -> None:
    # Typical pod: 600 milli. A 300 pod on GPU 1 would leave 400 (fragment); on GPU 0 it
    # leaves 700 and 700, both still usable. FGD takes GPU 0, best fit the fuller GPU 1.
    fgd = cluster("fgd", PaperNode("a", "T4", 16_000, 10**6, [1000, 700]))
    assert fgd.place(Shape(1000, 300, 1), 1024)
    assert fgd.nodes[0].gpu_left == [700, 700]
    bestfit = cluster("bestfit", PaperNode("a", "T4", 16_000, 10**6, [1000, 700]))
    assert bestfit.place(Shape(1000, 300, 1), 1024)
    assert bestfit.nodes[0].gpu_left == [1000, 400]


def test_every_policy_places_cpu_only_pods_by_its_own_rule() -> None:
    def nodes() -> list[PaperNode]:
        return [PaperNode("roomy", "T4", 64_000, 10**6, [1000]),
                PaperNode("tight", "T4", 9_000, 10**6, [1000])]  # fmt: skip

    # Best fit: least CPU left after placing (not kube-scheduler's most left).
    bestfit = cluster("bestfit", *nodes())
    assert bestfit.place(Shape(4000, 0, 0), 1024)
    assert bestfit.nodes[1].cpu_left == 5000
    # FGD: taking 4 cores from "tight" would leave its GPU without CPU for the typical pod
    # (8 cores): it goes to "roomy".
    fgd = cluster("fgd", *nodes(), typical=[(Shape(8000, 600, 1), 1.0)])
    assert fgd.place(Shape(4000, 0, 0), 1024)
    assert fgd.nodes[0].cpu_left == 60_000
    # Random: both nodes get some over a few seeds.
    chosen = set()
    for seed in range(10):
        rnd = PaperCluster(nodes(), "random", random.Random(seed), Fragmentation([]))
        rnd.place(Shape(4000, 0, 0), 1024)
        chosen |= {
            n.name for n in rnd.nodes if n.cpu_left < (64_000 if n.name == "roomy" else 9_000)
        }
    assert chosen == {"roomy", "tight"}


def test_filters_follow_cpu_memory_model_and_whole_gpus() -> None:
    c = cluster("bestfit", PaperNode("a", "T4", 4000, 2048, [1000, 500]))
    assert not c.place(Shape(5000, 0, 0), 1024)  # CPU
    assert not c.place(Shape(1000, 0, 0), 4096)  # memory
    assert not c.place(Shape(1000, 600, 1, ("A10",)), 1024)  # model
    assert not c.place(Shape(1000, 1000, 2), 1024)  # only one idle GPU
    assert c.place(Shape(1000, 1000, 1), 1024)
    assert c.nodes[0].gpu_left == [0, 500]


def test_replay_reports_the_method_and_reaches_the_last_level() -> None:
    nodes = [TraceNode(f"n{i}", 32_000, 10**6, 4, "T4", 15109) for i in range(4)]
    pods = [gpu_pod(f"s{i}", 300 + 100 * (i % 5), cpu=2000) for i in range(20)]
    pods += [cpu_pod(f"c{i}", 4000) for i in range(5)]
    for policy in paper.POLICIES:
        result = paper.replay(nodes, pods, policy, seed=1)
        row = result.to_json()
        assert row["method"] == "paper" and row["policy"] == policy
        assert 0 < row["alloc_at_100"] <= row["alloc_at_130"] <= 100
    with pytest.raises(ValueError, match="hostpack"):
        paper.replay(nodes, pods, "hostpack", seed=1)
