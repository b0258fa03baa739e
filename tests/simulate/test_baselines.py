"""Each baseline policy on a small hand-made cluster where the right answer is known.

Pods go through the real PlacementCore (parse, observe, best_node, commit), exactly as a
replay drives it."""

from __future__ import annotations

from services.allocator.core import PlacementCore, PodRef
from services.simulate.replay import build_core, manifest
from services.simulate.trace import TraceNode, TracePod


def node(name: str, gpus: int = 1, cpu: int = 64000) -> TraceNode:
    return TraceNode(name, cpu_milli=cpu, memory_mib=262144, gpus=gpus, model="T4",
                     gpu_memory_mib=15109)  # fmt: skip


def pod(milli: int = 1000, gpus: int = 1, cpu: int = 1000, name: str = "p") -> TracePod:
    return TracePod(name, cpu_milli=cpu, memory_mib=1024, num_gpu=gpus, gpu_milli=milli)


class Cluster:
    def __init__(self, policy: str, nodes: list[TraceNode], seed: int = 0) -> None:
        self.core: PlacementCore = build_core(nodes, policy, seed)
        self.count = 0

    def put(self, trace_pod: TracePod, node_name: str) -> list[int]:
        """Commit a pod to a given node (to set the scene); its GPU indices."""
        self.count += 1
        request = self.core.parse(manifest(trace_pod, f"set{self.count}"))
        self.core.observe(request)
        allocation = self.core.commit(PodRef("t", trace_pod.name, f"set{self.count}"),
                                      node_name, request)  # fmt: skip
        return [s.index for c in allocation.containers.values() for s in c.slices]

    def place(self, trace_pod: TracePod) -> tuple[str | None, list[int]]:
        """Where the policy puts the pod: node and GPU indices."""
        self.count += 1
        request = self.core.parse(manifest(trace_pod, f"u{self.count}"))
        self.core.observe(request)
        chosen = self.core.best_node(request)
        if chosen is None:
            return None, []
        allocation = self.core.commit(PodRef("t", trace_pod.name, f"u{self.count}"),
                                      chosen, request)  # fmt: skip
        return chosen, [s.index for c in allocation.containers.values() for s in c.slices]


def test_firstfit_takes_the_first_node_and_lowest_gpus() -> None:
    cluster = Cluster("firstfit", [node("c", 2), node("a", 2), node("b", 2)])
    cluster.put(pod(500), "a")  # a's GPU 0 half used: firstfit still starts at a
    assert cluster.place(pod(500)) == ("a", [0])
    assert cluster.place(pod(1000)) == ("a", [1])
    assert cluster.place(pod(1000)) == ("b", [0])


def test_bestfit_takes_the_node_with_least_left_after() -> None:
    # a: 2 GPUs, one half used -> 1.0 GPU left after a half; b: 1 idle GPU -> 0.5 left.
    cluster = Cluster("bestfit", [node("a", 2), node("b", 1)])
    cluster.put(pod(500), "a")
    assert cluster.place(pod(500)) == ("b", [0])
    assert cluster.place(pod(400)) == ("b", [0])  # b: 0.1 left after, a: 1.1
    # b is too full now; inside a it takes the fullest GPU that fits.
    assert cluster.place(pod(500)) == ("a", [0])


def test_dotprod_prefers_the_node_whose_free_vector_is_least_aligned() -> None:
    # Same GPUs; a has half its CPU taken, so its free (CPU, GPU) vector has the smaller
    # dot product with a CPU-heavy request.
    cluster = Cluster("dotprod", [node("a", 1), node("b", 1)])
    cluster.put(pod(100, cpu=32000), "a")
    assert cluster.place(pod(300, cpu=16000))[0] == "a"
    # An idle GPU and a shared one on the same node: the one with less free share.
    cluster = Cluster("dotprod", [node("a", 2)])
    cluster.put(pod(1000), "a")  # GPU 0 full
    cluster.put(pod(300), "a")  # GPU 1 at 0.3
    assert cluster.place(pod(300)) == ("a", [1])


def test_gpupacking_shared_gpus_then_used_nodes_then_the_smallest_idle_node() -> None:
    cluster = Cluster("gpupacking", [node("a", 2), node("b", 1), node("c", 4), node("d", 2)])
    cluster.put(pod(500), "a")  # a: GPU 0 shared (0.5 free), GPU 1 idle
    assert cluster.place(pod(300)) == ("a", [0])  # the shared GPU, not b's idle one
    assert cluster.place(pod(600)) == ("a", [1])  # an idle GPU on a used node
    assert cluster.place(pod(1000)) == ("b", [0])  # idle nodes: the smallest first


def test_gpuclustering_groups_pods_of_the_same_request_type() -> None:
    cluster = Cluster("gpuclustering", [node("a", 2), node("b", 2), node("c", 2)])
    cluster.put(pod(300), "a")
    cluster.put(pod(500), "b")
    assert cluster.place(pod(500))[0] == "b"
    assert cluster.place(pod(300))[0] == "a"
    assert cluster.place(pod(700))[0] == "c"  # a new type goes to an idle node first


def test_random_is_seeded_and_spreads_over_seeds() -> None:
    nodes = [node(f"n{i}") for i in range(8)]
    chosen = {Cluster("random", nodes, seed).place(pod(1000))[0] for seed in range(12)}
    assert len(chosen) > 2  # firstfit-like policies would always answer n0
    assert Cluster("random", nodes, 5).place(pod(1000)) == Cluster("random", nodes, 5).place(
        pod(1000)
    )


def test_fgd_fills_the_sliver_that_whole_gpu_pods_could_not_use() -> None:
    cluster = Cluster("fgd", [node("a", 1), node("b", 1)])
    for _ in range(20):  # the mix: mostly whole-GPU pods
        cluster.core.observe(cluster.core.parse(manifest(pod(1000), "mix")))
    cluster.put(pod(600), "a")  # a: 0.4 free, useless to whole-GPU pods
    assert cluster.place(pod(400)) == ("a", [0])


def test_baselines_never_overbook_a_gpu() -> None:
    for policy in ("random", "firstfit", "bestfit", "dotprod", "gpupacking", "gpuclustering"):
        cluster = Cluster(policy, [node("a", 2), node("b", 1)])
        placed = [cluster.place(pod(600))[0] for _ in range(4)]
        assert sorted(filter(None, placed)) == ["a", "a", "b"], policy
        assert placed[-1] is None


def test_hostpack_keeps_cpu_poor_nodes_for_cpu_light_pods() -> None:
    # poor: 2 GPUs, 16 cores (8 per GPU); rich: 2 GPUs, 104 cores. Binpack ties them.
    nodes = [node("poor", 2, cpu=16000), node("rich", 2, cpu=104000)]
    cluster = Cluster("hostpack", nodes)
    # A CPU-heavy whole-GPU pod on "poor" would leave its other GPU 4.7 cores: starved.
    assert cluster.place(pod(1000, cpu=11300))[0] == "rich"
    # A CPU-light one fits "poor" without starving the GPU left there.
    assert cluster.place(pod(1000, cpu=3000))[0] == "poor"
    # Plain binpack takes the first of the tied nodes for the heavy pod.
    assert Cluster("binpack", nodes).place(pod(1000, cpu=11300))[0] == "poor"


def test_hostpack_is_binpack_without_cpu_hints() -> None:
    nodes = [node("a", 2, cpu=0), node("b", 2, cpu=0)]
    for policy in ("hostpack", "binpack"):
        cluster = Cluster(policy, nodes)
        cluster.put(pod(500), "b")
        assert cluster.place(pod(300)) == ("b", [0]), policy


def test_hostpack_keeps_idle_nodes_while_whole_node_pods_are_in_demand() -> None:
    # "idle" has too little CPU for its 2 GPUs (20 cores): feeding it a CPU-light slice
    # unstrands some of them, which hostpack rewards, unless whole-node pods need the node.
    nodes = [node("idle", 2, cpu=20000), node("used", 2, cpu=64000)]
    light = pod(300, cpu=2000)
    for whole_node_pods_seen, expected in ((0, "idle"), (5, "used")):
        cluster = Cluster("hostpack", nodes)
        for _ in range(whole_node_pods_seen):  # the recent mix: pods asking for 2 GPUs
            cluster.core.observe(cluster.core.parse(manifest(pod(1000, gpus=2), "seen")))
        cluster.put(pod(500), "used")
        assert cluster.core.cluster.idle_nodes == {2: 1}
        assert cluster.place(light)[0] == expected, whole_node_pods_seen


def test_hostpack_keeps_idle_nodes_only_for_the_pods_that_need_their_size() -> None:
    # "idle": 4 GPUs, 32 cores (too little CPU for 4 GPUs: a CPU-light slice unstrands some).
    # Pods asking 8 GPUs cannot use it and pods asking 2 fit half of an 8-GPU node, so only
    # pods asking 3 or 4 GPUs keep it idle (on openb's multigpu files 8-GPU pods kept the
    # 4-GPU V100 nodes idle until the cluster was full, then CPU-heavy pods stranded them).
    nodes = [node("idle", 4, cpu=32000), node("used", 4, cpu=64000),
             node("big", 8, cpu=256000)]  # fmt: skip
    light = pod(300, cpu=2000)
    for seen_gpus, expected in ((8, "idle"), (2, "idle"), (4, "used"), (3, "used")):
        cluster = Cluster("hostpack", nodes)
        for _ in range(5):  # the recent mix: pods asking for `seen_gpus` GPUs
            cluster.core.observe(cluster.core.parse(manifest(pod(1000, gpus=seen_gpus), "s")))
        cluster.put(pod(500), "used")
        assert cluster.core.cluster.idle_nodes == {4: 1, 8: 1}
        assert cluster.place(light)[0] == expected, seen_gpus


def test_hostpack_keeps_a_scarce_model_for_the_pods_that_accept_only_it() -> None:
    t4 = node("t4", 2)
    g2 = TraceNode("g2", cpu_milli=64000, memory_mib=262144, gpus=2, model="G2",
                   gpu_memory_mib=20000)  # fmt: skip
    only_t4 = TracePod("t4-only", cpu_milli=1000, memory_mib=1024, num_gpu=1, gpu_milli=1000,
                       gpu_models=("T4",))  # fmt: skip
    for t4_only_pods_seen, expected in ((0, "t4"), (5, "g2")):
        cluster = Cluster("hostpack", [t4, g2])
        for _ in range(t4_only_pods_seen):  # the recent mix: pods that accept only T4
            cluster.core.observe(cluster.core.parse(manifest(only_t4, "seen")))
        cluster.put(pod(500), "t4")  # binpack alone would fill t4 first
        assert cluster.place(pod(300))[0] == expected, t4_only_pods_seen
        assert cluster.place(only_t4)[0] == "t4"  # the pods it is kept for still get it
