"""`vgpu run NAMESPACE/POD[/CONTAINER] -- CMD ARGS...`: a command in a pod `vgpu up` placed.

The command runs as a container runtime would run that container: its own mount, PID, UTS
and IPC namespaces, the Allocate response's mounts (read-only where it says so) and device
nodes, its environment (Allocate envs, then the pod spec's), `/etc/ld.so.preload` when the
Allocate response mounts one, as an unprivileged user unless `--root` (root without
CAP_SYS_ADMIN and the other dangerous capabilities). Its exit status is vgpu run's.
"""

from __future__ import annotations

import hashlib
import os
import pwd
import sys
from pathlib import Path

import click

from services.cli.container.cgroup import pod_cgroup
from services.cli.container.spec import DEFAULT_PATH, BindMount, ContainerSpec, DeviceNode
from services.cli.container.supervise import (
    EXIT_RUNTIME_FAILED,
    NamespacesUnavailable,
    check_privileges,
)
from services.cli.container.supervise import run as run_container
from services.cli.run_gpu import simulated_runtime
from services.cli.run_target import ResolvedTarget, TargetError, parse_target, resolve, say_notices
from services.cli.state import StateError, UpState, default_state_file, read_state

NOBODY = 65534


def parse_user(text: str) -> tuple[int, int]:
    """`UID[:GID]` or `NAME[:GROUP]`; a user's own group when no group is given."""
    name, _, group = text.partition(":")
    try:
        uid = int(name) if name.isdigit() else pwd.getpwnam(name).pw_uid
    except KeyError as exc:
        raise click.BadParameter(f"no user {name!r} in /etc/passwd", param_hint="--user") from exc
    if group:
        if not group.isdigit():
            raise click.BadParameter(f"group {group!r} must be a number", param_hint="--user")
        return uid, int(group)
    try:
        return uid, pwd.getpwuid(uid).pw_gid
    except KeyError:
        return uid, uid


def _home(uid: int) -> str:
    try:
        return pwd.getpwuid(uid).pw_dir
    except KeyError:
        return "/"


def container_spec(
    resolved: ResolvedTarget, state: UpState, argv: list[str], uid: int, gid: int, cwd: str
) -> ContainerSpec:
    container = resolved.container
    mounts = [BindMount(m.host_path, m.container_path, m.read_only) for m in container.mounts]
    devices = [DeviceNode(d.host_path, d.container_path, d.permissions or "rw")
               for d in container.devices]  # fmt: skip
    runtime_mounts, runtime_env = simulated_runtime(container, resolved.node, state)
    env = {"PATH": DEFAULT_PATH, "HOSTNAME": resolved.pod, "HOME": _home(uid)}
    if "TERM" in os.environ and sys.stdin.isatty():
        env["TERM"] = os.environ["TERM"]
    # Allocate envs first, the pod spec's after (later wins, as the kubelet passes them).
    env.update({**container.envs, **runtime_env, **resolved.env})
    # One runtime container ID per pod container, as a runtime would have made it once.
    identity = f"{resolved.namespace}/{resolved.pod}/{resolved.uid}/{container.name}"
    container_id = hashlib.sha256(identity.encode()).hexdigest()
    return ContainerSpec(
        argv=argv, hostname=resolved.pod, env=env, cwd=cwd, uid=uid, gid=gid,
        mounts=[*mounts, *runtime_mounts], devices=devices,
        cgroup=pod_cgroup(resolved.uid, container_id),
    )  # fmt: skip


@click.command("run", context_settings={"ignore_unknown_options": False})
@click.argument("target")
@click.argument("command", nargs=-1, required=True, type=click.UNPROCESSED)
@click.option(
    "--user",
    default=None,
    metavar="UID[:GID]",
    help=f"Run as this user (default {NOBODY}, nobody).",
)
@click.option(
    "--root", is_flag=True, help="Run as uid 0, without CAP_SYS_ADMIN and other dangerous caps."
)
@click.option("--workdir", default=None, help="Working directory (default: the current one).")
@click.option("--state-file", type=click.Path(path_type=Path), default=None)
def run_command(
    target: str,
    command: tuple[str, ...],
    user: str | None,
    root: bool,
    workdir: str | None,
    state_file: Path | None,
) -> None:
    """Run COMMAND in a container of a pod `vgpu up` placed: vgpu run NS/POD[/CONTAINER] -- CMD.

    Exit status: the command's (128+N when signal N ended it); 125 when vgpu run itself
    failed, 126 when the command cannot be executed, 127 when it is not found.
    """
    if root and user is not None:
        raise click.UsageError("--root and --user exclude each other")
    uid, gid = (0, 0) if root else parse_user(user) if user else (NOBODY, NOBODY)
    try:
        check_privileges()  # first: nothing else matters without namespaces
        parsed = parse_target(target)
        state = read_state(state_file or default_state_file())
        resolved = resolve(parsed, state)
    except (TargetError, StateError, NamespacesUnavailable) as exc:
        click.echo(f"vgpu run: {exc}", err=True)
        sys.exit(EXIT_RUNTIME_FAILED)
    say_notices(resolved)
    spec = container_spec(resolved, state, list(command), uid, gid, workdir or os.getcwd())
    try:
        code = run_container(spec)
    except NamespacesUnavailable as exc:
        click.echo(f"vgpu run: {exc}", err=True)
        sys.exit(EXIT_RUNTIME_FAILED)
    sys.exit(code)
