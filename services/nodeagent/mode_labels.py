"""Sharing modes chosen by Node labels (docs/modes.md, "Choosing the mode").

`vgpu.io/mode=<mode>` sets the node's mode over the `sharing_mode` setting;
`vgpu.io/mode.<gpu index>=<mode>` sets one GPU's. Label values cannot hold `=` or `,`, so a
GPU gets its own label key. The agent reads them once at start: a mode decides the device
IDs the kubelet was given, so changing it under running containers would orphan them;
relabel, drain, then restart the agent.
"""

from __future__ import annotations

import msgspec

from services.nodeagent.modes import ModeError, check_mode, parse_gpu_modes
from services.nodeagent.settings import NodeAgentSettings

MODE_LABEL = "vgpu.io/mode"
GPU_MODE_PREFIX = MODE_LABEL + "."  # vgpu.io/mode.1=exclusive


class ModeLabelError(ValueError):
    pass


def modes_from_labels(labels: dict[str, str]) -> tuple[str, dict[str, str]]:
    """(node mode or "", {gpu index: mode}) from a node's labels; ModeLabelError naming the
    label when its key or value is not one vgpu knows."""
    node = labels.get(MODE_LABEL, "")
    try:
        if node:
            check_mode(node, f"node label {MODE_LABEL}={node}")
        per_gpu: dict[str, str] = {}
        for key, value in sorted(labels.items()):
            if not key.startswith(GPU_MODE_PREFIX):
                continue
            index = key[len(GPU_MODE_PREFIX) :]
            if not index.isdigit():
                raise ModeLabelError(
                    f"node label {key}: expected {GPU_MODE_PREFIX}<GPU index>, e.g. "
                    f"{GPU_MODE_PREFIX}0=mps"
                )
            per_gpu[str(int(index))] = check_mode(value, f"node label {key}={value}")
    except ModeError as exc:
        raise ModeLabelError(str(exc)) from exc
    return node, per_gpu


def with_label_modes(settings: NodeAgentSettings, labels: dict[str, str]) -> NodeAgentSettings:
    """The settings with the labels' modes: the node label replaces `sharing_mode`, a GPU
    label replaces the `gpu_sharing_modes` entry of its index (an entry naming a GPU by UUID,
    the most specific, still wins)."""
    node, per_gpu = modes_from_labels(labels)
    if not node and not per_gpu:
        return settings
    merged = parse_gpu_modes(settings.gpu_sharing_modes)
    merged.update(per_gpu)
    return msgspec.structs.replace(
        settings,
        sharing_mode=node or settings.sharing_mode,
        gpu_sharing_modes=",".join(f"{gpu}={mode}" for gpu, mode in merged.items()),
    )
