"""Hypothesis strategies shared by the parser property tests: JSON values, and Kubernetes
objects that are almost right (the inputs that reach deep into a parser)."""

from __future__ import annotations

from typing import Any

from hypothesis import strategies as st

from services.common.resources import MANAGED_RESOURCES

JSON_SCALARS = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=12)
)
JSON = st.recursive(
    JSON_SCALARS,
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4)
    ),
    max_leaves=20,
)

# Quantities as users and the API server write them, and as they should not be.
QUANTITY_TEXT = st.sampled_from(
    ["1", "0", "4k", "1Ki", "0.5", "500m", "1e3", "2Gi", "-1", "", "x", "1..2", "١٢", "1e400",
     "99999999999999999999", "3.5", "10%", " 2", "0x10"]
)  # fmt: skip
QUANTITY = QUANTITY_TEXT | st.integers(min_value=-10, max_value=10**6) | JSON_SCALARS

RESOURCE_NAME = st.sampled_from([*MANAGED_RESOURCES, "cpu", "memory", "example.com/x"])


@st.composite
def containers(draw: Any) -> dict[str, Any]:
    resources: dict[str, Any] = {}
    for part in draw(st.sets(st.sampled_from(["limits", "requests"]))):
        resources[part] = draw(st.dictionaries(RESOURCE_NAME, QUANTITY, max_size=4))
    container: dict[str, Any] = {"name": draw(st.sampled_from(["a", "b", "c", ""]))}
    if resources or draw(st.booleans()):
        container["resources"] = resources if draw(st.integers(0, 9)) else draw(JSON)
    if draw(st.booleans()):
        container["env"] = draw(
            st.lists(
                st.fixed_dictionaries(
                    {"name": st.sampled_from(["NVIDIA_VISIBLE_DEVICES", "A"]), "value": JSON}
                ),
                max_size=2,
            )
        )
    return container


ANNOTATION_KEYS = st.sampled_from(
    ["nvidia.com/use-gputype", "nvidia.com/nouse-gputype", "nvidia.com/use-gpuuuid",
     "nvidia.com/nouse-gpuuuid", "hami.io/node-scheduler-policy", "hami.io/gpu-scheduler-policy",
     "gpu-fraction", "gpu-memory", "numa-bind", "other"]
)  # fmt: skip


@st.composite
def pods(draw: Any) -> dict[str, Any]:
    """A v1.Pod as JSON, usually well-formed around the GPU requests being fuzzed."""
    metadata: dict[str, Any] = {
        "name": draw(st.sampled_from(["p", "", "x" * 300])),
        "uid": draw(st.sampled_from(["u-1", ""])),
        "namespace": draw(st.sampled_from(["default", "ml"])),
    }
    if draw(st.booleans()):
        metadata["annotations"] = draw(
            st.dictionaries(ANNOTATION_KEYS, st.text(max_size=10) | JSON_SCALARS, max_size=3)
        )
    spec: dict[str, Any] = {"containers": draw(st.lists(containers(), max_size=3))}
    if draw(st.booleans()):
        spec["initContainers"] = draw(st.lists(containers(), max_size=2))
    pod: dict[str, Any] = {"metadata": metadata, "spec": spec}
    if not draw(st.integers(0, 14)):  # now and then, something that is not a pod at all
        pod[draw(st.sampled_from(["metadata", "spec"]))] = draw(JSON)
    return pod
