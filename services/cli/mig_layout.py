"""The MIG layout `vgpu up --mig` gives each simulated node: half of its MIG-capable GPUs
partitioned statically (advertised under NVIDIA's mixed names), half left to dynamic MIG."""

from __future__ import annotations

from dataclasses import dataclass

from services.common import mig
from services.nodeagent.gpus.simulated import parse_spec


@dataclass(frozen=True)
class MigLayout:
    geometry: str  # setting simulate_mig
    dynamic: str  # setting mig_dynamic
    strategy: str = "mixed"


def balanced(model: str) -> list[str]:
    """mig-parted's `all-balanced` idea: one 3g, one 2g and two 1g instances."""
    names = [p.name for p in mig.serving_profiles(model)]
    by_slices = {p.name: p.slices for p in mig.profiles_for(model)}
    three = next(n for n in names if by_slices[n] == 3)
    two = next(n for n in names if by_slices[n] == 2)
    one = names[0]
    return [three, two, one, one]


def mig_layout(simulate: str) -> MigLayout:
    """Even-numbered MIG-capable GPUs partitioned statically, odd-numbered ones dynamic (a
    node with one MIG GPU gets it static). ValueError when no GPU of the spec has MIG."""
    capable = [i for i, model in enumerate(parse_spec(simulate)) if mig.mig_capable(model.name)]
    if not capable:
        raise ValueError(
            f"--mig needs MIG-capable simulated GPUs ({', '.join(mig.PROFILES)}), got {simulate!r}"
        )
    models = parse_spec(simulate)
    static = capable[::2]
    dynamic = capable[1::2]
    geometry = ";".join(f"{i}:{','.join(balanced(models[i].name))}" for i in static)
    return MigLayout(geometry=geometry, dynamic=",".join(map(str, dynamic)))
