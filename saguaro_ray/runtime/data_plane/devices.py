"""Which device a data-plane member uses, and which backend its group can run.

NCCL asks three things of a group that gloo does not, and each used to fail
only on the first GPU:

* ``torch.cuda.set_device`` needs an *indexed* device: ``"cuda"`` alone
  raises (torch 2.13), and a worker's runner is usually configured as just
  ``"cuda"``. :func:`indexed_device` is the one place that turns it into
  ``cuda:N`` — the device current in this process, which under Ray is the
  GPU Ray assigned (``CUDA_VISIBLE_DEVICES`` makes it index 0).
* Two ranks on one GPU cannot share an NCCL communicator (fractional
  ``gpus_per_worker`` puts several workers on one GPU), and a group whose
  members are not all on CUDA cannot use NCCL at all. So every member
  publishes its :class:`DeviceIdentity` at rendezvous, and all of them run
  :func:`choose_backend` on the same list — the same answer everywhere.
* Whatever is chosen instead of NCCL is said, with its cause: the plane
  keeps it (``DataPlane.backend_note``) and the engine reports it.
"""

from __future__ import annotations

import json
import os
import socket
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist

from saguaro_ray.errors import DataPlaneError


def indexed_device(device: str | torch.device, current: int | None = None) -> torch.device:
    """``device`` with an index if it is a CUDA device without one: ``cuda`` →
    ``cuda:N``, N being ``current`` (default: ``torch.cuda.current_device()``,
    the GPU Ray assigned this worker). Other devices are returned as given."""
    dev = torch.device(device)
    if dev.type != "cuda" or dev.index is not None:
        return dev
    return torch.device("cuda", torch.cuda.current_device() if current is None else current)


@dataclass(frozen=True)
class DeviceIdentity:
    """What one member tells the others at rendezvous: its device kind, which
    physical GPU (``gpu``: its UUID, else host and physical index; empty on
    the CPU) and whether its torch can run NCCL."""

    kind: str
    gpu: str = ""
    nccl: bool = False

    def encode(self) -> bytes:
        return json.dumps(asdict(self), sort_keys=True).encode()

    @classmethod
    def decode(cls, raw: bytes) -> DeviceIdentity:
        d = json.loads(raw)
        return cls(kind=str(d["kind"]), gpu=str(d.get("gpu", "")), nccl=bool(d.get("nccl", False)))


def identity_of(dev: torch.device) -> DeviceIdentity:
    """This process's identity for an (indexed) device."""
    if dev.type != "cuda":
        return DeviceIdentity(kind=dev.type)
    index = dev.index if dev.index is not None else torch.cuda.current_device()
    uuid = getattr(torch.cuda.get_device_properties(index), "uuid", None)
    if uuid:
        gpu = f"GPU-{uuid}"
    else:  # no UUID: the physical index behind CUDA_VISIBLE_DEVICES, on this host
        visible = [v for v in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if v.strip()]
        physical = visible[index].strip() if index < len(visible) else str(index)
        gpu = f"{socket.gethostname()}:cuda:{physical}"
    return DeviceIdentity(kind="cuda", gpu=gpu, nccl=dist.is_nccl_available())


def choose_backend(identities: Sequence[DeviceIdentity], requested: str | None = None) -> tuple[str, str | None]:
    """The group's backend and, when a CUDA group cannot use NCCL, why not.

    ``requested``: ``"gloo"`` is always honoured; ``"nccl"`` raises
    :class:`DataPlaneError` with the cause if the group cannot run it; None
    picks NCCL where every member is on its own GPU with an NCCL build, and
    gloo otherwise — with a cause whenever some member is on CUDA (gloo
    stages its tensors through host memory: slower, never wrong)."""
    if requested not in (None, "gloo", "nccl"):
        raise ValueError(f"data-plane backend must be 'gloo' or 'nccl', got {requested!r}")
    if requested == "gloo":
        return "gloo", None
    cause = _why_not_nccl(identities)
    if cause is None:
        return "nccl", None
    if requested == "nccl":
        raise DataPlaneError(f"the nccl data plane cannot form: {cause}")
    if not any(i.kind == "cuda" for i in identities):
        return "gloo", None  # a CPU group: gloo is its backend, nothing fell back
    return "gloo", f"{cause}; the data plane uses gloo (tensors staged through host memory)"


def _why_not_nccl(identities: Sequence[DeviceIdentity]) -> str | None:
    off_gpu = [r for r, i in enumerate(identities) if i.kind != "cuda"]
    if off_gpu:
        return f"ranks {off_gpu} are not on a CUDA device"
    no_nccl = [r for r, i in enumerate(identities) if not i.nccl]
    if no_nccl:
        return f"ranks {no_nccl} have no NCCL build of torch"
    owners: dict[str, list[int]] = {}
    for r, i in enumerate(identities):
        owners.setdefault(i.gpu, []).append(r)
    shared = [(gpu, ranks) for gpu, ranks in owners.items() if len(ranks) > 1]
    if shared:
        said = "; ".join(f"ranks {ranks} share GPU {gpu}" for gpu, ranks in shared)
        return f"{said} (one NCCL communicator cannot hold two ranks of one GPU)"
    return None
