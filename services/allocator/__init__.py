"""The allocator: places GPU slices for pods (scheduler extender) and answers node agents."""

from .backend import BackendError, ClusterBackend, LocalClusterBackend
from .core import FilterOutcome, PlacementCore, PodRef, Unplaceable
from .engine import ALLOCATION_ANNOTATION, BindError, ClaimError, PlacementEngine
from .service import Allocator
from .settings import AllocatorSettings

__all__ = [
    "ALLOCATION_ANNOTATION",
    "Allocator",
    "AllocatorSettings",
    "BackendError",
    "BindError",
    "ClaimError",
    "ClusterBackend",
    "FilterOutcome",
    "LocalClusterBackend",
    "PlacementCore",
    "PlacementEngine",
    "PodRef",
    "Unplaceable",
]
