"""filter's scan of the node table answers exactly as the loop over the nodes does, byte for
byte on the wire (the same nodes passed, in the same order, the same failure reasons), and
prioritize's reuse of that scan scores exactly as the loop does.

Two identical clusters take the same random stream of events (tests/allocator/
test_placement_scan.py's: GPU pods of every openb shape, multi-container pods, model
selections, pods ending, host usage from outside, nodes joining, going silent and coming
back). For each GPU pod both are asked as kube-scheduler asks: filter over a sample of node
names (unknown names and repeats among them), then prioritize over the nodes filter passed;
one core scans columns, the other (``scan_columns = False``) walks the nodes one by one, the
reference. Sometimes the cluster changes between the two verbs (another pod's bind lands,
a node goes silent, host usage moves) or prioritize is asked about other names: the reuse
must then step aside.
"""

from __future__ import annotations

import random
from collections.abc import Callable

import msgspec
import pytest

from services.allocator import LocalClusterBackend, wire
from services.allocator.cluster import CapacityConfig, ClusterState
from services.allocator.core import PlacementCore, PodRef, Unplaceable
from services.allocator.engine import PlacementEngine
from services.allocator.ledger import Ledger
from services.allocator.policies import MAX_SCORE, POLICIES
from services.common.quantity import QuantityError
from tests.allocator.helpers import container, node_inventory, pod
from tests.allocator.test_placement_scan import TIMEOUT_S, Twin, _nodes, _trace_pod


def _filter_bytes(spec: dict, names: list[str], core: PlacementCore) -> tuple[bytes, list[str]]:
    outcome = core.filter(core.parse(spec), names)
    args = wire.ExtenderArgs(pod=spec, node_names=names, node_list=None)
    return msgspec.json.encode(wire.filter_result(args, outcome)), outcome.passed


def _prioritize_bytes(spec: dict, names: list[str], core: PlacementCore) -> bytes:
    scores = core.prioritize(core.parse(spec), names)
    return msgspec.json.encode(wire.host_priority_list(scores))


def _replay(policy: str, seed: int, events: int = 300) -> tuple[int, int]:
    """(pods filtered, prioritize answers that reused filter's scan)."""
    rng = random.Random(seed)
    now = [0.0]
    nodes = _nodes(rng, 80)
    scan, loop = (Twin(policy, seed, nodes, lambda: now[0]) for _ in range(2))
    loop.core.scan_columns = False
    twins = (scan, loop)
    placed: list[str] = []
    filtered = 0

    def commit(spec: dict, node: str, number: int) -> None:
        """Both commit the pod to `node`, or both refuse it (the cluster moved meanwhile)."""
        ref = PodRef("t", spec["metadata"]["name"], f"u{number}")
        outcomes = []
        for twin in twins:
            try:
                outcomes.append(twin.core.commit(ref, node, twin.core.parse(spec)).containers)
            except Unplaceable as exc:
                outcomes.append(str(exc))
        assert outcomes[0] == outcomes[1]
        if not isinstance(outcomes[0], str):
            placed.append(ref.uid)

    def change(roll: float, number: int) -> None:
        """Something happens to the cluster (the same to both)."""
        if roll < 0.3 and placed:  # a pod ends
            uid = placed.pop(rng.randrange(len(placed)))
            for twin in twins:
                twin.core.ledger.release(uid)
        elif roll < 0.5:  # time passes: most nodes report, a few stay silent for a while
            now[0] += TIMEOUT_S * 0.6
            for inventory in nodes:
                if rng.random() < 0.9:
                    for twin in twins:
                        twin.core.cluster.update(inventory)
        elif roll < 0.6:  # a node joins
            new = _nodes(rng, 1, prefix=f"j{number}-")
            nodes.extend(new)
            for twin in twins:
                twin.core.cluster.update(new[0])
        else:  # a pod vgpu did not place takes host CPU, memory and a pod slot
            name, cpu = rng.choice(nodes).node, rng.choice((2000, 8000, 32000))
            for twin in twins:
                twin.core.cluster.charge_host(name, cpu, 4096, 1)

    for number in range(events):
        if rng.random() < 0.15:
            change(rng.random(), number)
            continue
        spec, _ = _trace_pod(rng, number)
        requests = [twin.core.parse(spec) for twin in twins]
        if not requests[0].containers:
            continue
        for twin, request in zip(twins, requests, strict=True):
            twin.core.observe(request)
        known = [i.node for i in nodes]
        names = rng.sample(known, rng.randint(1, len(known)))
        names += [*rng.sample(names, min(3, len(names))), "unknown-node"]  # repeats, unknown
        rng.shuffle(names)
        (answer, passed), (expected, _) = (_filter_bytes(spec, names, t.core) for t in twins)
        assert answer == expected, f"filter, event {number}: {spec['metadata']['name']}"
        filtered += 1
        if not passed:
            continue
        roll = rng.random()
        if roll < 0.2:  # the cluster moves between filter and prioritize
            change(rng.random(), number)
        asked = passed
        if 0.2 <= roll < 0.3:  # prioritize asked about other names than filter passed
            asked = rng.sample(known, min(len(known), len(passed) + 1))
        elif 0.3 <= roll < 0.35:
            asked = list(reversed(passed))
        elif 0.35 <= roll < 0.45:  # another pod enters the workload mix meanwhile
            other = _trace_pod(rng, number + 100_000)[0]
            for twin in twins:
                twin.core.observe(twin.core.parse(other))
        answer, expected = (_prioritize_bytes(spec, asked, t.core) for t in twins)
        assert answer == expected, f"prioritize, event {number}: {spec['metadata']['name']}"
        scores = msgspec.json.decode(answer)
        best = min(scores, key=lambda s: (-s["Score"], s["Host"]))["Host"]
        if best in passed:
            commit(spec, best, number)
    assert scan.core.filter_rescans == 0  # the scan always explained what it did not pass
    return filtered, scan.core.scans_reused


@pytest.mark.parametrize("policy", [*POLICIES, "bestfit", "random", "gpuclustering"])
def test_filter_and_prioritize_answer_as_the_loop(policy: str) -> None:
    filtered, reused = _replay(policy, seed=11)
    assert filtered > 150
    assert reused > filtered // 3  # the reuse itself was exercised, not only stepped aside


@pytest.mark.parametrize("seed", [3, 4, 5])
def test_filter_and_prioritize_answer_as_the_loop_default_policy_more_seeds(seed: int) -> None:
    filtered, reused = _replay("hostpack", seed)
    assert filtered > 150 and reused > filtered // 3


def test_a_pod_already_placed_keeps_its_node_through_filter_and_prioritize() -> None:
    """Where a pod's own record holds the room (a bind whose answer was lost), engine.filter
    passes that node too, last, and prioritize scores it highest: the same with filter's scan
    reused as node by node."""
    answers = []
    for scan in (True, False):
        cluster = ClusterState(TIMEOUT_S, CapacityConfig())
        for inventory in (node_inventory("n1", count=1), node_inventory("n2", count=2)):
            cluster.update(inventory)
        core = PlacementCore(cluster, Ledger(cluster))
        core.scan_columns = core.scan_filter = scan
        engine = PlacementEngine(core, LocalClusterBackend())
        spec = pod("lost-answer", [container("main", gpus=1)])
        metadata = spec["metadata"]
        ref = PodRef(metadata["namespace"], metadata["name"], metadata["uid"])
        core.commit(ref, "n1", core.parse(spec))  # n1's only GPU: no room left there
        outcome = engine.filter(spec, ["n1", "n2"])
        assert outcome.passed == ["n2", "n1"]
        answers.append((outcome, engine.prioritize(spec, outcome.passed)))
    assert answers[0] == answers[1]
    assert answers[0][1]["n1"] == MAX_SCORE


def test_a_request_is_read_once_per_pod_content() -> None:
    """engine.parse remembers a pod's request by the pod's whole content: filter then
    prioritize read it once; the same pod changed (an in-place resize, same uid) is read
    again; a malformed one is refused every time."""
    cluster = ClusterState(TIMEOUT_S, CapacityConfig())
    engine = PlacementEngine(PlacementCore(cluster, Ledger(cluster)), LocalClusterBackend())
    spec = pod("resized", [container("main", gpus=1, mem=1000)])
    first = engine.parse(spec)
    assert engine.parse(msgspec.json.decode(msgspec.json.encode(spec))) is first
    spec["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpumem"] = "2000"
    resized = engine.parse(spec)
    assert resized != first and resized == engine.core.parse(spec)
    spec["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpumem"] = "two"
    for _ in range(2):
        with pytest.raises(QuantityError, match="gpumem"):
            engine.parse(spec)


def test_pods_that_ask_alike_share_one_reading_and_any_part_parse_reads_tells_them_apart() -> None:
    """engine.parse is keyed by what parse_pod reads, not by the whole pod: another pod of
    the same Deployment (other name, uid, labels, node selector) reuses the reading; a pod
    that differs in anything the parse reads (an annotation, a container's name, resources
    or restartPolicy, the pod's overhead or resources) is read afresh, and its reading is
    what core.parse says."""
    cluster = ClusterState(TIMEOUT_S, CapacityConfig())
    engine = PlacementEngine(PlacementCore(cluster, Ledger(cluster)), LocalClusterBackend())
    base = pod("web-1", [container("main", gpus=1, mem=1000)])
    base["spec"]["containers"][0]["resources"]["requests"] = {"cpu": "500m"}
    base["spec"]["initContainers"] = [{"name": "proxy", "resources": {"requests": {"cpu": "1"}}}]
    first = engine.parse(base)
    twin = pod("web-2", [container("main", gpus=1, mem=1000)], uid="other")
    twin["spec"]["containers"][0]["resources"]["requests"] = {"cpu": "500m"}
    twin["spec"]["initContainers"] = [{"name": "proxy", "resources": {"requests": {"cpu": "1"}}}]
    twin["metadata"]["labels"] = {"app": "web"}
    twin["spec"]["nodeSelector"] = {"pool": "a"}
    assert engine.parse(twin) is first

    def changed(change: Callable[[dict], None]) -> dict:
        spec = msgspec.json.decode(msgspec.json.encode(base))
        change(spec)
        return spec

    variants = [
        changed(lambda p: p["metadata"].update(annotations={"nvidia.com/use-gputype": "A100"})),
        changed(lambda p: p["spec"]["containers"][0].update(name="other")),
        changed(lambda p: p["spec"]["containers"][0]["resources"]["requests"].update(cpu="2")),
        changed(lambda p: p["spec"]["initContainers"][0].update(restartPolicy="Always")),
        changed(lambda p: p["spec"].update(overhead={"cpu": "250m"})),
        changed(lambda p: p["spec"].update(resources={"requests": {"memory": "1Gi"}})),
    ]
    readings = [engine.parse(variant) for variant in variants]
    for variant, reading in zip(variants, readings, strict=True):
        assert reading is not first and reading == engine.core.parse(variant)
    assert len({id(r) for r in readings}) == len(readings)
    # Each of them changes the request itself: a key that missed one would answer wrongly.
    assert [reading != first for reading in readings] == [True] * len(readings), readings
