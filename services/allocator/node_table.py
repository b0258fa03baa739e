"""Every node's placement figures as columns (numpy arrays), for whole-cluster scans.

Choosing a node for a pod reads the same few figures of every node (freshness, free CPU,
memory and pod slots, the most free compute a slice could get): one Python loop over
thousands of nodes per pod costs milliseconds, the same test on arrays a few microseconds.
ClusterState says which nodes changed since the last scan (``take_changes``); only their
rows are read again, so a scan after one bind refreshes one row.

``ResultColumns`` keeps one pod shape's cached fit and score per node beside them, valid
while the row's version is the one it was computed at: the same rule as ``NodeState.cache``,
which stays the source of truth (the columns only mirror what ``PlacementCore._evaluate``
returned).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from .cluster import ClusterState, NodeState


SIGNATURES_LIMIT = 200_000  # distinct node signatures numbered before numbering afresh
_SIGNATURE_KEY = ("node-table", "signature")


class NodeTable:
    """The cluster's nodes in name order (as ``ClusterState.nodes``), one row each."""

    def __init__(self, cluster: ClusterState) -> None:
        self._cluster = cluster
        self.layout = -1  # ClusterState.layout_version the rows were laid out at
        self.sync()

    def sync(self) -> None:
        """Read again the rows of nodes that changed (every row when nodes were added)."""
        layout, changed = self._cluster.take_changes()
        if layout != self.layout:
            self._lay_out()
            self.layout = layout
            return
        for name in changed:
            row = self.index.get(name)
            if row is not None:
                self._read(row, self._cluster.node(name))

    def _lay_out(self) -> None:
        nodes = sorted(self._cluster.states(), key=lambda n: n.name)
        count = len(nodes)
        self.names = [n.name for n in nodes]
        self.index = {name: row for row, name in enumerate(self.names)}
        self.nodes: list[NodeState] = list(nodes)
        self.width = max((len(n.gpus) for n in nodes), default=0)
        ints = {"dtype": np.int64}
        self.version = np.zeros(count, **ints)
        self.received_at = np.zeros(count)
        self.cpu_milli = np.zeros(count, **ints)
        self.used_cpu_milli = np.zeros(count, **ints)
        self.host_memory_mib = np.zeros(count, **ints)
        self.used_memory_mib = np.zeros(count, **ints)
        self.pods_full = np.zeros(count, dtype=bool)
        self.gpu_count = np.zeros(count, **ints)
        # room[row, k]: the (k+1)-th largest free compute among GPUs that could take one
        # more slice (NodeState.free_cores), -1 where the node has fewer such GPUs.
        self.room = np.full((count, max(1, self.width)), -1, **ints)
        self.model_names: list[str] = []
        self._model_codes: dict[str, int] = {}
        self.model = np.full(count, -1, **ints)  # the node's only GPU model; -1: several/none
        self._derived: dict[object, tuple[np.ndarray, np.ndarray]] = {}
        self._signatures: dict[tuple[object, ...], int] = {}
        for row, node in enumerate(nodes):
            self._read(row, node)

    def _read(self, row: int, node: NodeState | None) -> None:
        if node is None:
            return
        self.nodes[row] = node
        self.version[row] = node.version
        self.received_at[row] = node.received_at
        self.cpu_milli[row] = node.cpu_milli
        self.used_cpu_milli[row] = node.used_cpu_milli
        self.host_memory_mib[row] = node.host_memory_mib
        self.used_memory_mib[row] = node.used_memory_mib
        self.pods_full[row] = bool(node.max_pods and node.used_pods >= node.max_pods)
        self.gpu_count[row] = len(node.gpus)
        room = node.free_cores()
        if len(room) > self.room.shape[1]:  # a node gained GPUs: widen
            wider = np.full((len(self.names), len(room)), -1, dtype=np.int64)
            wider[:, : self.room.shape[1]] = self.room
            self.room = wider
        self.room[row, :] = -1
        self.room[row, : len(room)] = room
        models = node.models
        self.model[row] = self._model_code(models[0]) if len(models) == 1 else -1

    def derived(self, key: object, compute: Callable[[NodeState], float]) -> np.ndarray:
        """A figure of each node that changes only with its version (GPU state), as a
        column: `compute` runs again only for nodes whose version moved."""
        memo = self._derived.get(key)
        if memo is None:
            count = len(self.names)
            memo = self._derived[key] = (np.full(count, -1, dtype=np.int64), np.zeros(count))
        versions, values = memo
        for row in np.flatnonzero(versions != self.version).tolist():
            values[row] = compute(self.nodes[row])
            versions[row] = self.version[row]
        return values

    def signature_ids(self) -> np.ndarray:
        """Each node's NodeState.signature() as a number: equal numbers, equal signatures."""
        if len(self._signatures) > SIGNATURES_LIMIT:  # old states pile up: start afresh
            self._signatures.clear()
            self._derived.pop(_SIGNATURE_KEY, None)
        return self.derived(_SIGNATURE_KEY, self._signature_id)

    def _signature_id(self, node: NodeState) -> float:
        return self._signatures.setdefault(node.signature(), len(self._signatures))

    def _model_code(self, model: str) -> int:
        code = self._model_codes.get(model)
        if code is None:
            code = self._model_codes[model] = len(self.model_names)
            self.model_names.append(model)
        return code

    def model_in(self, rows: np.ndarray, models: Iterable[str]) -> np.ndarray:
        """Whether each row's node has exactly one GPU model and it is among `models`."""
        codes = [self._model_codes[m] for m in models if m in self._model_codes]
        if not codes:
            return np.zeros(len(rows), dtype=bool)
        return np.isin(self.model[rows], codes)

    def allows_models(self, allows: Callable[[str], bool]) -> np.ndarray:
        """False for the rows whose only GPU model `allows` refuses."""
        refused = [code for code, model in enumerate(self.model_names) if not allows(model)]
        return ~np.isin(self.model, refused) if refused else np.ones(len(self.names), bool)

    def may_take(
        self, fresh_since: float, gpus: int, cores: int, cpu_milli: int, memory_mib: int
    ) -> np.ndarray:
        """Rows that are fresh, have room for the pod's CPU, memory and one more pod, and,
        when `gpus` > 0, `gpus` GPUs that could each take a slice of `cores` compute (a
        bound, not the fit: PlacementCore._results' early tests, on every row at once)."""
        ok = (self.received_at >= fresh_since) & ~self.pods_full
        if gpus:
            if gpus > self.room.shape[1]:
                return np.zeros(len(self.names), dtype=bool)
            ok &= self.room[:, gpus - 1] >= cores
        if cpu_milli:
            ok &= (self.cpu_milli == 0) | (self.cpu_milli - self.used_cpu_milli >= cpu_milli)
        if memory_mib:
            free = self.host_memory_mib - self.used_memory_mib
            ok &= (self.host_memory_mib == 0) | (free >= memory_mib)
        return ok


class ResultColumns:
    """One cache key's results on every row: fit or not, raw score, the host view."""

    def __init__(self, rows: int) -> None:
        self.version = np.full(rows, -1, dtype=np.int64)  # -1: not known
        self.mix = np.zeros(rows, dtype=np.int64)
        self.fit = np.zeros(rows, dtype=bool)
        self.raw = np.zeros(rows)
        self.score10 = np.zeros(rows, dtype=np.int64)  # absolute_scores of raw
        self.results: list[object] = [None] * rows
        self.views: np.ndarray | None = None  # rows x len(host view), when it is numeric

    def valid(self, table: NodeTable, mix_version: int) -> np.ndarray:
        return (self.version == table.version) & (self.mix == mix_version)

    def store(
        self,
        row: int,
        version: int,
        mix_version: int,
        result: object,
        raw: float | None,
        score10: int,
        view: object,
    ) -> None:
        """`result` is a fit when `raw` is not None."""
        self.version[row] = version
        self.mix[row] = mix_version
        self.results[row] = result
        fit = raw is not None
        self.fit[row] = fit
        self.raw[row] = raw if fit else 0.0
        self.score10[row] = score10
        if fit and isinstance(view, tuple):
            if self.views is None:
                self.views = np.zeros((len(self.version), len(view)))
            self.views[row] = view
