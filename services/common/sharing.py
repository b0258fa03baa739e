"""The sharing modes a GPU can be in (docs/modes.md): one vocabulary for the node agent, which
sets them, and the allocator, which places by them."""

from __future__ import annotations

VGPU = "vgpu"  # slices held by the hook (memory, compute share): the default
TIME_SLICING = "time-slicing"  # replicas of the whole GPU, no limits (NVIDIA's timeSlicing)
MPS = "mps"  # an MPS control daemon holds each client to its thread and memory share
EXCLUSIVE = "exclusive"  # whole GPUs only
MODES = (VGPU, TIME_SLICING, MPS, EXCLUSIVE)
