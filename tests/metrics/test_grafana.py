"""The Grafana dashboard only queries families the metrics service really exports."""

from __future__ import annotations

import json
import re
from pathlib import Path

from services.common.bus import Bus
from services.metrics.service import MetricsService
from tests.metrics.helpers import feed, scrape

DASHBOARD = Path(__file__).resolve().parents[2] / "deploy" / "grafana" / "vgpu-dashboard.json"


def queried_families(node: object) -> set[str]:
    found: set[str] = set()
    if isinstance(node, dict):
        for key, value in node.items():
            if key in ("expr", "query", "definition") and isinstance(value, str):
                found.update(re.findall(r"\bvgpu_[a-z_]+", value))
            else:
                found |= queried_families(value)
    elif isinstance(node, list):
        for item in node:
            found |= queried_families(item)
    return found


async def test_every_queried_family_is_exported(metrics: MetricsService, bus: Bus) -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    assert dashboard["uid"] and dashboard["panels"]
    wanted = queried_families(dashboard)
    assert "vgpu_container_throttled_seconds_total" in wanted
    await feed(bus, metrics)
    exported = set(await scrape(metrics))
    assert wanted <= exported, sorted(wanted - exported)
