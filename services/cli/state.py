"""Where `vgpu up` tells later commands (`vgpu submit`) how to reach the local system."""

from __future__ import annotations

import os
import ssl
from pathlib import Path

import msgspec

from services.common.processes import process_alive


class UpGpu(msgspec.Struct, frozen=True):
    uuid: str
    memory_mib: int


class UpState(msgspec.Struct, kw_only=True):
    nats_url: str
    api_url: str  # the local stand-in for the API server's pod endpoints
    allocator_url: str
    metrics_url: str
    # The extender: HTTPS that takes only a client certificate of `vgpu up`'s own CA. The CA
    # (to trust the extender) and the client certificate its scheduler emulation and
    # `vgpu submit` present (curl --cacert ca_file --cert client_cert_file --key ...).
    extender_url: str = ""
    ca_file: str = ""
    client_cert_file: str = ""
    client_key_file: str = ""
    kubelets: dict[str, str]  # node name -> kubelet simulator URL
    work_dir: str
    pid: int
    # What `vgpu run` needs to stand in for the NVIDIA container runtime on simulated GPUs:
    gpus: dict[str, list[UpGpu]] = {}  # node -> its simulated GPUs
    driver_dir: str = ""  # the simulated libcuda.so.1 and libnvidia-ml.so.1
    sim_state_dirs: dict[str, str] = {}  # node -> the simulated devices' shared state
    nats_store_dir: str = ""  # the embedded NATS server's JetStream store (kept at Ctrl-C)
    # Read APIs check bearer tokens with the local API server, from this users file; the
    # admin's token is what `vgpu inspect` sends ("" = the read APIs are open).
    users_file: str = ""
    admin_token: str = ""

    def extender_ssl(self) -> ssl.SSLContext | None:
        """The client side of the extender's mutual TLS (None for a plain-HTTP extender)."""
        if not self.client_cert_file:
            return None
        context = ssl.create_default_context(cafile=self.ca_file)
        context.load_cert_chain(self.client_cert_file, self.client_key_file)
        return context


class StateError(RuntimeError):
    pass


def default_state_file() -> Path:
    override = os.environ.get("VGPU_STATE_FILE")
    if override:
        return Path(override)
    runtime = os.environ.get("XDG_RUNTIME_DIR") or f"/tmp/vgpu-{os.getuid()}"
    return Path(runtime) / "vgpu" / "up.json"


def default_store_dir(state_file: Path) -> Path:
    """Where `vgpu up` keeps its JetStream store: beside its state file, so that two systems
    with two state files never share one."""
    return state_file.with_name(f"{state_file.stem}-jetstream")


def write_state(state: UpState, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_suffix(".tmp")
    temporary.write_bytes(msgspec.json.encode(state))
    temporary.replace(path)


def read_state(path: Path) -> UpState:
    try:
        state = msgspec.json.decode(path.read_bytes(), type=UpState)
    except FileNotFoundError as exc:
        raise StateError(f"no running `vgpu up` found ({path} is missing): start it first") from exc
    except msgspec.DecodeError as exc:
        raise StateError(f"{path} is not a vgpu state file: {exc}") from exc
    if not process_alive(state.pid):
        raise StateError(f"`vgpu up` (pid {state.pid}) is no longer running: start it again")
    return state
    return True
