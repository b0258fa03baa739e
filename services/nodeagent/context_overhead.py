"""What a CUDA context costs on each GPU model, for the hook to charge (`context_overhead_mib`).

A context's own device memory (kernels, the runtime's heaps) shows in no allocation call, so
the hook can only charge a configured figure per context. It depends on the model and the
driver, so operators give it per model: "A100=420,T4=300,*=350", a model substring (matched
case-insensitively, first match wins) or `*` for any other; a bare number applies to all.
A container on several GPUs is charged the largest figure among its GPUs' models.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

MAX_OVERHEAD_MIB = 16384  # a context never takes 16 GiB: a larger figure is a typo


def parse_overheads(spec: str) -> list[tuple[str, int]]:
    """(model substring or "*", MiB) in the given order; ValueError names the bad part."""
    rules: list[tuple[str, int]] = []
    for part in (p.strip() for p in spec.split(",")):
        if not part:
            continue
        pattern, sep, value = part.rpartition("=") if "=" in part else ("*", "=", part)
        pattern = pattern.strip()
        if not sep or not pattern:
            raise ValueError(f"context_overhead: {part!r} is not MODEL=MiB or MiB")
        try:
            mib = int(value)
        except ValueError:
            raise ValueError(
                f"context_overhead: {part!r}: {value.strip()!r} is not a whole number of MiB"
            ) from None
        if not 0 <= mib <= MAX_OVERHEAD_MIB:
            raise ValueError(
                f"context_overhead: {part!r}: {mib} MiB is outside 0..{MAX_OVERHEAD_MIB}"
            )
        rules.append((pattern.lower(), mib))
    return rules


def overhead_for(rules: Sequence[tuple[str, int]], model: str) -> int:
    lowered = model.lower()
    for pattern, mib in rules:
        if pattern == "*" or pattern in lowered:
            return mib
    return 0


def container_overhead(
    rules: Sequence[tuple[str, int]], models: Mapping[str, str], gpu_uuids: Sequence[str]
) -> int:
    """The charge per context for a container on `gpu_uuids` (models: uuid -> model)."""
    return max((overhead_for(rules, models.get(u, "")) for u in gpu_uuids), default=0)
