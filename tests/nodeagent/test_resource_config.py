"""The GPU-sharing fork's resourceConfig string and the sharing settings: parsed with the
fork's meaning, and every malformed value stops the agent at start quoting the bad part."""

from __future__ import annotations

import pytest
from click.testing import CliRunner
from hypothesis import given
from hypothesis import strategies as st

from services.cli.main import main
from services.common.config import ConfigError
from services.nodeagent.resource_config import (
    ResourceConfigError,
    ResourceRule,
    gpu_rule,
    parse_resource_config,
)
from services.nodeagent.settings import (
    NodeAgentSettings,
    advertised_resource,
    load_node_agent_settings,
    mode_plan,
    node_mode,
)


def settings_with(**flags: object) -> NodeAgentSettings:
    return load_node_agent_settings(flags={"node_name": "n", **flags}, environ={})


def test_the_forks_examples() -> None:
    rules = parse_resource_config("gpu:sharedgpu:4, mig-3g.20gb:small:2,mig-1g.5gb:gpu:1")
    assert rules == [
        ResourceRule("gpu", "sharedgpu", 4),
        ResourceRule("mig-3g.20gb", "small", 2),
        ResourceRule("mig-1g.5gb", "gpu", 1),
    ]
    assert gpu_rule(rules) == rules[0] and rules[1].is_mig
    shared = settings_with(resource_config="gpu:sharedgpu:4")
    assert advertised_resource(shared) == "nvidia.com/sharedgpu"  # and no nvidia.com/gpu
    assert node_mode(shared) == "time-slicing" and mode_plan(shared).replicas == 4
    whole = settings_with(resource_config="gpu:whole:1")
    assert node_mode(whole) == "exclusive" and advertised_resource(whole) == "nvidia.com/whole"
    # MIG rules leave the whole GPUs' resource as it is (they rename MIG profiles).
    assert advertised_resource(settings_with(resource_config="mig-3g.20gb:gpu:1")) == (
        "nvidia.com/gpu"
    )


@pytest.mark.parametrize(
    ("text", "quoted", "why"),
    [
        ("gpu:sharedgpu", "'gpu:sharedgpu'", "expected FROM:TO:REPLICAS"),
        ("gpu:sharedgpu:4:1", "'gpu:sharedgpu:4:1'", "expected FROM:TO:REPLICAS"),
        ("gpu:sharedgpu:four", "'gpu:sharedgpu:four'", "REPLICAS 'four'"),
        ("gpu:sharedgpu:0", "'gpu:sharedgpu:0'", "from 1 to"),
        ("tpu:shared:2", "'tpu:shared:2'", "FROM 'tpu' must be gpu or mig-<profile>"),
        ("mig-3g:small:2", "'mig-3g:small:2'", "FROM 'mig-3g'"),
        ("gpu:Shared_GPU:2", "'gpu:Shared_GPU:2'", "lower-case DNS name"),
        ("gpu:a:2,,gpu:b:2", "'gpu:a:2,,gpu:b:2'", "empty entry"),
        ("gpu:a:2,gpu:b:3", "'gpu:b:3'", "gpu is given twice"),
    ],
)
def test_malformed_strings_quote_the_bad_part(text: str, quoted: str, why: str) -> None:
    with pytest.raises(ResourceConfigError) as caught:
        parse_resource_config(text)
    assert quoted in str(caught.value) and why in str(caught.value)
    # The agent stops at start with the same message.
    result = CliRunner().invoke(
        main, ["node-agent", "--node-name", "n", "--resource-config", text], env={}
    )
    assert result.exit_code == 1 and quoted in result.output


@given(
    st.lists(
        st.tuples(
            st.sampled_from(["gpu", "mig-1g.5gb", "mig-3g.20gb", "mig-7g.80gb", "mig-1g.10gb+me"]),
            st.sampled_from(["sharedgpu", "small", "gpu", "a.b-c"]),
            st.integers(1, 64),
        ),
        min_size=1,
        max_size=4,
        unique_by=lambda rule: rule[0],
    )
)
def test_every_well_formed_string_round_trips(rules: list[tuple[str, str, int]]) -> None:
    text = ",".join(f"{source}:{target}:{count}" for source, target, count in rules)
    assert parse_resource_config(text) == [ResourceRule(*rule) for rule in rules]


@pytest.mark.parametrize(
    ("flags", "why"),
    [
        ({"sharing_mode": "slices"}, "sharing_mode: unknown sharing mode 'slices'"),
        ({"gpu_sharing_modes": "0:mps"}, "'0:mps' is not <gpu index or uuid>=<mode>"),
        ({"gpu_sharing_modes": "0=mps,0=exclusive"}, "GPU '0' is named twice"),
        ({"gpu_sharing_modes": "1=whole"}, "unknown sharing mode 'whole'"),
        ({"sharing_replicas": 1}, "sharing_replicas must be 0"),
        ({"sharing_mode": "mps", "sharing_replicas": 64}, "at most 48 clients"),
        ({"sharing_mode": "mps", "mig_strategy": "mixed"}, "mps cannot be used with"),
        ({"shared_resource_name": "gpu-shared"}, "shared_resource_name must be"),
        ({"resource_config": "gpu:s:2", "sharing_replicas": 4}, "leave shared_resource_name"),
        ({"device_list_strategy": "envvar,cdi"}, "got 'cdi'"),
        ({"device_id_strategy": "serial"}, "device_id_strategy must be one of uuid, index"),
        ({"mig_strategy": "some"}, "mig_strategy must be one of none, single, mixed"),
    ],
)
def test_bad_sharing_settings_are_refused_by_name(flags: dict[str, object], why: str) -> None:
    with pytest.raises(ConfigError) as caught:
        settings_with(**flags)
    assert why in str(caught.value)
