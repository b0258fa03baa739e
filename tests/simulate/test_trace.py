"""Trace readers (openb CSV and our YAML) and the paper's arrival sequence."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.simulate.trace import (
    TraceError,
    TracePod,
    read_nodes,
    read_pods,
)
from services.simulate.workload import arrivals, gpu_capacity

OPENB = Path("/work/shared/traces/openb")

NODES_CSV = """sn,cpu_milli,memory_mib,gpu,model
n0,64000,262144,2,P100
n1,96000,393216,8,V100M32
cpu0,32000,131072,0,
"""
PODS_CSV = """name,cpu_milli,memory_mib,num_gpu,gpu_milli,gpu_spec,qos,pod_phase,\
creation_time,deletion_time,scheduled_time
p0,12000,16384,1,1000,,LS,Running,0,1,0
p1,6000,12288,1,460,V100M32|T4,LS,Running,0,1,0
p2,8000,8192,4,0,,BE,Running,0,1,0
p3,2000,4096,0,0,,BE,Running,0,1,0
"""


def write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def test_openb_nodes_get_gpu_memory_from_the_model_table(tmp_path: Path) -> None:
    nodes = read_nodes(write(tmp_path, "nodes.csv", NODES_CSV))
    assert [(n.name, n.gpus, n.model, n.gpu_memory_mib) for n in nodes] == [
        ("n0", 2, "P100", 16280), ("n1", 8, "V100M32", 32510), ("cpu0", 0, "", 0),
    ]  # fmt: skip
    assert gpu_capacity(nodes) == 10


def test_openb_pods_keep_shares_models_and_whole_gpus(tmp_path: Path) -> None:
    pods = read_pods(write(tmp_path, "pods.csv", PODS_CSV))
    assert [(p.num_gpu, p.gpu_milli, p.gpu_models, p.gpu_demand) for p in pods] == [
        (1, 1000, (), 1.0), (1, 460, ("V100M32", "T4"), 0.46), (4, 4000, (), 4.0), (0, 0, (), 0.0),
    ]  # fmt: skip


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("name,cpu_milli\np,1\n", "missing column"),
        (PODS_CSV.replace("p1,6000", "p1,lots"), r"pods.csv:3: column cpu_milli is not a whole"),
        (PODS_CSV.replace(",460,", ",1460,"), "gpu_milli must be 1-1000"),
        (PODS_CSV.replace("V100M32|T4", "H100"), "unknown GPU model"),
    ],
)
def test_bad_pod_files_name_file_row_and_column(tmp_path: Path, text: str, message: str) -> None:
    with pytest.raises(TraceError, match=message):
        read_pods(write(tmp_path, "pods.csv", text))


def test_yaml_format(tmp_path: Path) -> None:
    nodes = read_nodes(write(tmp_path, "c.yaml", """
nodes:
- {name: a, gpus: 4, model: A100-40GB, gpu_memory_mib: 40960, cpu_milli: 64000, memory_mib: 262144}
- {name: b, gpus: 2, model: T4, cpu_milli: 32000, memory_mib: 65536}
"""))  # fmt: skip
    assert [(n.gpus, n.gpu_memory_mib) for n in nodes] == [(4, 40960), (2, 15109)]
    pods = read_pods(write(tmp_path, "p.yaml", """
pods:
- {name: half, gpus: 1, gpu_milli: 500, models: [T4]}
- {name: two, gpus: 2, cpu_milli: 4000}
"""))  # fmt: skip
    shapes = [(p.gpu_milli, p.gpu_models, p.cpu_milli) for p in pods]
    assert shapes == [(500, ("T4",), 0), (2000, (), 4000)]
    with pytest.raises(TraceError, match="gpu_memory_mib must be given"):
        read_nodes(write(tmp_path, "bad.yaml", "nodes:\n- {name: a, gpus: 1, model: H100}\n"))


def test_arrivals_shuffle_then_draw_until_demand() -> None:
    pods = [TracePod(name=f"p{i}", cpu_milli=0, memory_mib=0, num_gpu=1, gpu_milli=500)
            for i in range(10)]  # fmt: skip
    first = arrivals(pods, capacity_gpus=4, demand=1.3, seed=7)
    assert sum(p.gpu_demand for p in first) == pytest.approx(5.5)  # first sum >= 5.2
    assert len({p.name for p in first[:10]}) == 10  # every pod of the file before any repeat
    assert first == arrivals(pods, capacity_gpus=4, demand=1.3, seed=7)
    assert first != arrivals(pods, capacity_gpus=4, demand=1.3, seed=8)
    short = arrivals(pods, capacity_gpus=4, demand=0.5, seed=7)
    assert [p.name for p in short] == [p.name for p in first[:4]]
    with pytest.raises(ValueError, match="asks for no GPUs"):
        arrivals([TracePod("c", 1, 1, 0, 0)], capacity_gpus=4, demand=1.0, seed=1)


@pytest.mark.skipif(not OPENB.exists(), reason="the openb trace is not on this machine")
def test_every_openb_file_reads_and_the_default_matches_its_published_totals() -> None:
    nodes = read_nodes(OPENB / "openb_node_list_gpu_node.csv")
    assert (len(nodes), gpu_capacity(nodes)) == (1213, 6212)
    pods = read_pods(OPENB / "openb_pod_list_default.csv")
    assert len(pods) == 8152
    assert sum(p.gpu_demand for p in pods) == pytest.approx(6086.8)
    assert sum(1 for p in pods if p.num_gpu == 0) == 1088
    for path in OPENB.glob("openb_pod_list_*.csv"):
        assert read_pods(path), path
