"""The GPU-sharing fork's `resourceConfig`: `FROM:TO:REPLICAS[,FROM:TO:REPLICAS...]`.

`gpu:sharedgpu:4` advertises every GPU as 4 replicas of `nvidia.com/sharedgpu` (and no
`nvidia.com/gpu`); `mig-3g.20gb:small:2` shares a MIG profile under a new name;
`mig-3g.20gb:gpu:1` turns MIG devices into plain `nvidia.com/gpu`. The `gpu` rule is built on
the same replicas as NVIDIA's time-slicing (modes.py); MIG rules rename and share the
per-profile resources of the mixed MIG strategy (mig_resources.py, docs/modes.md).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

RESOURCE_PREFIX = "nvidia.com/"
_NAME = re.compile(r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$")
_MIG_PROFILE = re.compile(r"^mig-(\d+c\.)?\d+g\.\d+gb([.+-][a-z.]+)?$")
MAX_REPLICAS = 1024


class ResourceConfigError(ValueError):
    pass


@dataclass(frozen=True)
class ResourceRule:
    source: str  # "gpu" or "mig-<profile>"
    target: str  # the advertised name after nvidia.com/
    replicas: int

    @property
    def is_mig(self) -> bool:
        return self.source.startswith("mig-")

    @property
    def resource(self) -> str:
        return RESOURCE_PREFIX + self.target


def parse_resource_config(text: str) -> list[ResourceRule]:
    """The rules; ResourceConfigError quoting the bad part and saying why."""
    rules: list[ResourceRule] = []
    for part in text.split(","):
        item = part.strip()
        if not item:
            raise ResourceConfigError(
                f"resource_config {text!r}: empty entry (expected FROM:TO:REPLICAS[,...])"
            )
        pieces = item.split(":")
        if len(pieces) != 3:
            raise ResourceConfigError(
                f"resource_config entry {item!r}: expected FROM:TO:REPLICAS, e.g. gpu:sharedgpu:4"
            )
        source, target, count = (p.strip() for p in pieces)
        if source != "gpu" and not _MIG_PROFILE.match(source):
            raise ResourceConfigError(
                f"resource_config entry {item!r}: FROM {source!r} must be gpu or "
                f"mig-<profile> such as mig-3g.20gb"
            )
        if not _NAME.match(target) or len(RESOURCE_PREFIX + target) > 63:
            raise ResourceConfigError(
                f"resource_config entry {item!r}: TO {target!r} must be a lower-case DNS name "
                f"(advertised as {RESOURCE_PREFIX}<TO>, at most 63 characters)"
            )
        if not count.isdigit() or not 1 <= int(count) <= MAX_REPLICAS:
            raise ResourceConfigError(
                f"resource_config entry {item!r}: REPLICAS {count!r} must be a whole number "
                f"from 1 to {MAX_REPLICAS}"
            )
        if any(rule.source == source for rule in rules):
            raise ResourceConfigError(f"resource_config entry {item!r}: {source} is given twice")
        rules.append(ResourceRule(source, target, int(count)))
    return rules


def gpu_rule(rules: list[ResourceRule]) -> ResourceRule | None:
    return next((rule for rule in rules if rule.source == "gpu"), None)
