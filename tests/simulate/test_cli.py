"""`vgpu simulate` end to end on a tiny YAML cluster (the real command, in process)."""

from __future__ import annotations

import json
from pathlib import Path

from click.testing import CliRunner

from services.cli.main import main

NODES = """
nodes:
- {name: a, gpus: 2, model: T4, cpu_milli: 32000, memory_mib: 65536}
- {name: b, gpus: 4, model: A100, gpu_memory_mib: 40960, cpu_milli: 64000, memory_mib: 262144}
"""
PODS = """
pods:
- {name: half, gpus: 1, gpu_milli: 500, cpu_milli: 4000, memory_mib: 8192}
- {name: third, gpus: 1, gpu_milli: 300, cpu_milli: 2000, memory_mib: 4096, models: [A100]}
- {name: whole, gpus: 1, gpu_milli: 1000, cpu_milli: 8000, memory_mib: 16384}
- {name: pair, gpus: 2, cpu_milli: 16000, memory_mib: 32768}
- {name: cpu, gpus: 0, cpu_milli: 4000, memory_mib: 4096}
"""
KEYS = [
    "policy", "method", "seed", "alloc_at_100", "alloc_at_110", "alloc_at_120", "alloc_at_130",
    "failed_pods", "decision_ms_p50", "decision_ms_p99",
]  # fmt: skip


def files(tmp_path: Path) -> list[str]:
    (tmp_path / "nodes.yaml").write_text(NODES)
    (tmp_path / "pods.yaml").write_text(PODS)
    return ["--nodes", str(tmp_path / "nodes.yaml"), "--pods", str(tmp_path / "pods.yaml")]


def test_json_one_object_per_policy(tmp_path: Path) -> None:
    args = ["simulate", *files(tmp_path), "--policy", "hostpack", "--policy", "fgd",
            "--policy", "random", "--seed", "4", "--json"]  # fmt: skip
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    rows = [json.loads(line) for line in result.output.splitlines()]
    assert [r["policy"] for r in rows] == ["hostpack", "fgd", "random"]
    for row in rows:
        assert list(row) == KEYS
        assert row["seed"] == 4
        assert 0 < row["alloc_at_100"] <= row["alloc_at_130"] <= 100
        assert row["failed_pods"] >= 1  # 130% of 6 GPUs cannot all fit
        assert 0 <= row["decision_ms_p50"] <= row["decision_ms_p99"]
    # Same seed, same answer.
    again = CliRunner().invoke(main, args)
    strip = [{k: v for k, v in json.loads(line).items() if "ms" not in k}
             for line in again.output.splitlines()]  # fmt: skip
    assert strip == [{k: v for k, v in r.items() if "ms" not in k} for r in rows]


def test_table_every_policy_and_plot(tmp_path: Path) -> None:
    plot = tmp_path / "out.png"
    result = CliRunner().invoke(main, ["simulate", *files(tmp_path), "--plot", str(plot)])
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert lines[0].startswith("# method vgpu:")  # the table says which method made it
    assert "@130%" in lines[1]
    policies = {line.split()[0] for line in lines[2:-1]}
    assert {"hostpack", "fgd", "binpack", "random", "firstfit", "bestfit", "dotprod",
            "gpupacking", "gpuclustering"} <= policies  # fmt: skip
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_demand_option_and_two_workers(tmp_path: Path) -> None:
    args = ["simulate", *files(tmp_path), "--policy", "binpack", "--policy", "bestfit",
            "--demand", "0.5", "--jobs", "2", "--json"]  # fmt: skip
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    rows = [json.loads(line) for line in result.output.splitlines()]
    assert [r["policy"] for r in rows] == ["binpack", "bestfit"]
    # Demand stops at 3 of 6 GPUs (+ at most one 2-GPU pod): 100% is never reached.
    assert all(r["alloc_at_100"] is None and r["failed_pods"] == 0 for r in rows)


def test_bad_input_gets_a_clear_error(tmp_path: Path) -> None:
    args = files(tmp_path)
    unknown = CliRunner().invoke(main, ["simulate", *args, "--policy", "tetris"])
    assert unknown.exit_code == 2 and "unknown policy tetris" in unknown.output
    assert "gpupacking" in unknown.output  # the known ones are listed
    demand = CliRunner().invoke(main, ["simulate", *args, "--demand", "0"])
    assert demand.exit_code == 2 and "must be positive" in demand.output
    (tmp_path / "bad.yaml").write_text("pods:\n- {name: x, gpus: 1, gpu_milli: 5000}\n")
    bad = CliRunner().invoke(main, ["simulate", args[0], args[1], "--pods",
                                    str(tmp_path / "bad.yaml")])  # fmt: skip
    assert bad.exit_code == 1 and "pods[0]: gpu_milli must be 1-1000" in bad.output
    (tmp_path / "cpu.yaml").write_text("pods:\n- {name: x, gpus: 0, cpu_milli: 5}\n")
    none = CliRunner().invoke(main, ["simulate", args[0], args[1], "--pods",
                                     str(tmp_path / "cpu.yaml")])  # fmt: skip
    assert none.exit_code == 1 and "no pod asks for GPUs" in none.output


def test_method_paper_replays_the_papers_baselines(tmp_path: Path) -> None:
    result = CliRunner().invoke(main, ["simulate", *files(tmp_path), "--method", "paper"])
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert lines[0].startswith("# method paper:")
    assert [line.split()[0] for line in lines[2:]] == ["random", "bestfit", "fgd"]
    refused = CliRunner().invoke(
        main, ["simulate", *files(tmp_path), "--method", "paper", "--policy", "hostpack"]
    )
    assert refused.exit_code != 0 and "for --method paper" in refused.output


def test_through_scheduler_prints_the_same_row_for_the_real_path(tmp_path: Path) -> None:
    args = ["simulate", *files(tmp_path), "--through-scheduler", "--seed", "2", "--json"]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    (row,) = [json.loads(line) for line in result.output.splitlines()]
    assert list(row) == KEYS
    assert (row["policy"], row["method"]) == ("hostpack", "through-scheduler")
    assert 0 < row["alloc_at_100"] <= 100
    mixed = CliRunner().invoke(main, [*args, "--method", "paper"])
    assert mixed.exit_code != 0 and "cannot be combined" in mixed.output
    alone = CliRunner().invoke(main, ["simulate", *files(tmp_path), "--scheduler-config",
                                      str(tmp_path / "nodes.yaml")])  # fmt: skip
    assert alone.exit_code != 0 and "only with --through-scheduler" in alone.output
