"""Under `vgpu up` the read APIs hold as on a cluster: the local API server answers
TokenReview and SubjectAccessReview from the users file, the admin token is in the state
file, two tenants each see only their own pods, and `vgpu inspect` / `kubectl vgpu inspect`
send the state file's, the flag's or the kubeconfig's token."""

from __future__ import annotations

import asyncio
import json
import stat
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from click.testing import CliRunner

from services.cli import inspect_gpushare
from services.cli.inspect import inspect_command, kubectl_main
from services.cli.local_cluster import LocalCluster, LocalClusterSpec
from services.cli.state import UpState, write_state
from services.cli.submit import load_pod, submit
from services.simulators.kube_users import UserRights, write_users

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
READ = ["get", "list", "watch"]


@pytest.fixture
async def cluster(tmp_path: Path) -> AsyncIterator[LocalCluster]:
    spec = LocalClusterSpec(allocator_port=0, metrics_port=0, heartbeat_s=1.0,
                            users_file=str(tmp_path / "users.json"))  # fmt: skip
    local = LocalCluster(spec)
    await local.start()
    try:
        yield local
    finally:
        await local.stop()


def add_tenants(cluster: LocalCluster) -> None:
    """Edit the users file while it runs, as an operator would (read again on change)."""
    assert cluster.users is not None
    users = cluster.users.current()
    users.users += [
        UserRights(name="alice", token="alice-token", namespaces={"team-a": READ}),
        UserRights(name="bob", token="bob-token", namespaces={"team-b": READ}),
    ]
    write_users(users, cluster.users.path)


async def submit_in(cluster: LocalCluster, namespace: str) -> None:
    pod = load_pod(EXAMPLES / "half-gpu.yaml")
    pod["metadata"]["namespace"] = namespace
    outcome = await submit(pod, cluster.state())
    assert outcome.node and not outcome.reason, outcome


async def get(url: str, token: str | None) -> tuple[int, Any]:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    async with aiohttp.ClientSession() as session, session.get(url, headers=headers) as resp:
        return resp.status, await resp.json()


async def test_two_tenants_under_vgpu_up(cluster: LocalCluster, tmp_path: Path) -> None:
    state = cluster.state()
    users_file = Path(state.users_file)
    assert state.admin_token and users_file == tmp_path / "users.json"
    assert stat.S_IMODE(users_file.stat().st_mode) == 0o600
    add_tenants(cluster)
    await submit_in(cluster, "team-a")
    await submit_in(cluster, "team-b")

    allocations = f"{state.allocator_url}/allocations"
    assert (await get(allocations, None))[0] == 401
    assert (await get(allocations, "forged"))[0] == 401
    status, everything = await get(allocations, state.admin_token)
    assert status == 200 and sorted(a["namespace"] for a in everything) == ["team-a", "team-b"]
    for token, mine in (("alice-token", "team-a"), ("bob-token", "team-b")):
        status, seen = await get(allocations, token)
        assert status == 200 and [a["namespace"] for a in seen] == [mine]

    picture = f"{state.metrics_url}/api/v1/picture"
    for _ in range(100):  # the metrics service hears the bindings over NATS
        status, view = await get(picture, state.admin_token)
        if len(view["pods"]) == 2:
            break
        await asyncio.sleep(0.05)
    assert sorted(p["namespace"] for p in view["pods"]) == ["team-a", "team-b"]
    status, view = await get(picture, "alice-token")
    assert status == 200 and [p["namespace"] for p in view["pods"]] == ["team-a"]
    assert (await get(f"{state.metrics_url}/api/v1/pods/team-b/half-gpu", "alice-token"))[0] == 403
    assert (await get(f"{state.metrics_url}/healthz", None))[0] == 200

    # vgpu inspect: the state file's admin token, --token, or the kubeconfig's.
    state_file = tmp_path / "up.json"
    write_state(state, state_file)
    assert json.loads(state_file.read_text())["admin_token"] == state.admin_token
    await assert_inspect_sees(state, state_file, tmp_path)


async def assert_inspect_sees(state: UpState, state_file: Path, tmp_path: Path) -> None:
    def run(*args: str) -> Any:
        return CliRunner().invoke(inspect_command, [*args, "-o", "json"], env={"KUBECONFIG": ""})

    def namespaces(result: Any) -> list[str]:
        assert result.exit_code == 0, result.output
        return sorted(p["namespace"] for p in json.loads(result.output)["pods"])

    assert namespaces(await asyncio.to_thread(run, "--state-file", str(state_file))) == [
        "team-a", "team-b"]  # fmt: skip
    alice = await asyncio.to_thread(run, "--state-file", str(state_file), "--token", "alice-token")
    assert namespaces(alice) == ["team-a"]
    forged = await asyncio.to_thread(run, "--state-file", str(state_file), "--token", "forged")
    assert forged.exit_code != 0 and "answered 401" in forged.output and "--token" in forged.output

    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(json.dumps({
        "apiVersion": "v1", "kind": "Config", "current-context": "bob",
        "clusters": [{"name": "local", "cluster": {"server": state.api_url}}],
        "users": [{"name": "bob", "user": {"token": "bob-token"}}],
        "contexts": [{"name": "bob", "context": {"cluster": "local", "user": "bob"}}],
    }))  # fmt: skip
    args = ["inspect", "--metrics-url", state.metrics_url, "--kubeconfig", str(kubeconfig)]
    bob = await asyncio.to_thread(CliRunner().invoke, kubectl_main, [*args, "-o", "json"])
    assert namespaces(bob) == ["team-b"]
    nobody = await asyncio.to_thread(run, "--metrics-url", state.metrics_url)
    assert nobody.exit_code != 0 and "answered 401" in nobody.output

    # kubectl-inspect-gpushare reads the same picture with the same token.
    def gpushare(*args: str) -> Any:
        return CliRunner().invoke(inspect_gpushare.main, [*args, "--state-file", str(state_file)],
                                  env={"KUBECONFIG": ""})  # fmt: skip

    shown = await asyncio.to_thread(gpushare)
    assert shown.exit_code == 0 and "node-" in shown.output, shown.output
    forged = await asyncio.to_thread(gpushare, "--token", "forged")
    assert forged.exit_code != 0 and "answered 401" in forged.output


async def test_the_users_file_and_its_tokens_survive_a_restart(tmp_path: Path) -> None:
    spec = LocalClusterSpec(allocator_port=0, metrics_port=0,
                            users_file=str(tmp_path / "users.json"))  # fmt: skip
    tokens = []
    for _ in range(2):
        local = LocalCluster(spec)
        await local.start()
        try:
            tokens.append(local.admin_token)
            assert (await get(f"{local.state().metrics_url}/api/v1/picture",
                              local.admin_token))[0] == 200  # fmt: skip
        finally:
            await local.stop()
    assert tokens[0] == tokens[1] and (tmp_path / "users.json").exists()


async def test_a_broken_users_file_stops_vgpu_up_with_its_path(tmp_path: Path) -> None:
    broken = tmp_path / "users.json"
    broken.write_text('{"users": [{"name": "x"}]}')
    local = LocalCluster(LocalClusterSpec(allocator_port=0, metrics_port=0,
                                          users_file=str(broken)))  # fmt: skip
    with pytest.raises(ValueError, match=str(broken)):
        await local.start()
