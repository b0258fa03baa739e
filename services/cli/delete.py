"""`vgpu delete POD [-n NAMESPACE]`: remove a pod from the system `vgpu up` runs, as
`kubectl delete pod` does: the local API server deletes it, its kubelet simulator stops it,
and the allocator frees its slices at once (it watches the API server's pods)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import aiohttp
import click

from services.cli.object_names import name_problem, namespace_problem
from services.cli.state import StateError, default_state_file, read_state


async def delete_pod(api_url: str, namespace: str, name: str) -> tuple[int, dict[str, Any]]:
    url = f"{api_url}/api/v1/namespaces/{namespace}/pods/{name}"
    async with (
        aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as session,
        session.delete(url) as response,
    ):
        return response.status, await response.json(content_type=None)


@click.command("delete")
@click.argument("pod")
@click.option("-n", "--namespace", default="default", show_default=True)
@click.option("--state-file", type=click.Path(path_type=Path), default=None)
def delete_command(pod: str, namespace: str, state_file: Path | None) -> None:
    """Delete a pod (and free its GPU slices) on the system `vgpu up` runs."""
    name = pod.removeprefix("pod/").removeprefix("pods/")
    problem = namespace_problem(namespace) or name_problem(name)
    if problem:
        raise click.UsageError(problem.replace("metadata.", "", 1))
    try:
        state = read_state(state_file or default_state_file())
        status, answer = asyncio.run(delete_pod(state.api_url, namespace, name))
    except StateError as exc:
        raise click.ClickException(str(exc)) from exc
    except (aiohttp.ClientError, TimeoutError) as exc:
        raise click.ClickException(f"the local API server is unreachable: {exc}") from exc
    if status != 200:
        reason = answer.get("reason") or "Failure"
        raise click.ClickException(f"Error from server ({reason}): {answer.get('message')}")
    click.echo(f'pod "{name}" deleted')
