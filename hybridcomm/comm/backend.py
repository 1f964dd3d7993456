"""Which torch.distributed backend a group uses for which device.

``init_process_group()`` without a backend makes one backend per device type
("cpu:gloo,cuda:nccl"), for which ``get_backend()`` answers ``"undefined"``;
everything in hybridcomm that asks which backend goes through here.

Example::

    >>> parse_backend_config("cpu:gloo,cuda:nccl")
    {'cpu': 'gloo', 'cuda': 'nccl'}
    >>> parse_backend_config("gloo")
    {'cpu': 'gloo', 'cuda': 'gloo'}
"""

from __future__ import annotations

from typing import Dict, Optional

import torch
import torch.distributed as dist


def parse_backend_config(config: str) -> Dict[str, str]:
    """``"cpu:gloo,cuda:nccl"`` -> per device type; a bare name serves every type."""
    config = config.strip()
    if ":" not in config:
        name = config.lower()
        return {"cpu": name, "cuda": name} if name != "nccl" else {"cuda": name}
    out = {}
    for part in config.split(","):
        device, _, name = part.partition(":")
        out[device.strip().lower()] = name.strip().lower()
    return out


def backends(group=None) -> Dict[str, str]:
    """device type -> backend of ``group`` (None: the default group)."""
    name = str(dist.get_backend(group)).lower()
    if name != "undefined":
        return parse_backend_config(name)
    return parse_backend_config(str(dist.get_backend_config(group)))


def backend_name(group=None) -> str:
    """The group's backend as a report shows it: "gloo", or "cpu:gloo,cuda:nccl"."""
    name = str(dist.get_backend(group))
    return name if name != "undefined" else str(dist.get_backend_config(group))


def backend_for(device_type: str, group=None) -> Optional[str]:
    """The backend ``group`` uses for tensors on ``device_type``, or None."""
    return backends(group).get(device_type)


def comm_device(group=None) -> torch.device:
    """Where a collective on ``group`` runs best: the current CUDA device when the
    group has NCCL for CUDA tensors, else the CPU."""
    if backend_for("cuda", group) == "nccl" and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
