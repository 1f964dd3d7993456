"""The Downpour parameter servers' wire format and how peers find each other.

A message is a 16-byte prefix (magic ``HCP1``, header length, payload length),
a JSON header, then the tensors' raw bytes, each padded to 8 bytes. Nothing is
unpickled: the receiver checks every dtype, shape and length before it makes a
tensor. Every call has a deadline. A server publishes ``host:port`` in a
rendezvous directory as ``server{index}.addr``.

Example::

    >>> import socket
    >>> a, b = socket.socketpair()
    >>> send(a, {"op": "push", "seq": 1}, {"w": torch.ones(2, 3)}, timeout=5)
    >>> header, tensors = recv(b, timeout=5)
    >>> header["op"], header["seq"], tensors["w"].shape
    ('push', 1, torch.Size([2, 3]))
    >>> a.close(); recv(b, timeout=5)
    Traceback (most recent call last):
    ...
    hybridcomm.strategies.downpour.wire.ConnectionLost: the connection was closed
    >>> b.close()
"""

from __future__ import annotations

import json
import os
import socket
import struct
import time
from typing import Dict, Mapping, Optional, Tuple

import torch

from ...base.errors import HybridCommError, HybridCommTimeout

MAGIC = b"HCP1"
_PREFIX = struct.Struct("!4sIQ")  # magic, header bytes, payload bytes
MAX_HEADER = 1 << 20
MAX_PAYLOAD = 1 << 36  # 64 GiB: a corrupt length fails here, not in an allocation
_PART = 1 << 26
_ALIGN = 8  # every tensor starts 8-byte aligned: view(float64) needs it
_DTYPES = {
    str(d).removeprefix("torch."): d
    for d in (torch.float32, torch.float16, torch.bfloat16, torch.float64)
}


class ConnectionLost(HybridCommError):
    """The peer closed, reset or refused the connection (it may come back)."""


def _padded(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


def _raw(t: torch.Tensor):
    """The tensor's bytes as a uint8 array (no copy for a contiguous CPU tensor)."""
    return t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()


def send(
    sock: socket.socket,
    header: Mapping,
    tensors: Optional[Mapping[str, torch.Tensor]] = None,
    *,
    timeout: float,
) -> None:
    """One message: ``header`` (JSON-serializable) and the ``tensors`` in order."""
    tensors = tensors or {}
    specs = []
    for name, t in tensors.items():
        dtype = str(t.dtype).removeprefix("torch.")
        if dtype not in _DTYPES:
            raise HybridCommError(f"cannot send {name}: dtype {dtype} (not one of {list(_DTYPES)})")
        specs.append([name, dtype, list(t.shape)])
    head = json.dumps(dict(header, tensors=specs)).encode()
    sizes = [t.numel() * t.element_size() for t in tensors.values()]
    total = sum(_padded(n) for n in sizes)
    deadline = time.monotonic() + timeout
    try:
        _set_deadline(sock, deadline)
        sock.sendall(_PREFIX.pack(MAGIC, len(head), total) + head)
        for t, n in zip(tensors.values(), sizes):
            _set_deadline(sock, deadline)
            sock.sendall(_raw(t))
            if _padded(n) > n:
                sock.sendall(bytes(_padded(n) - n))
    except OSError as e:
        raise _wrap(e, "sending") from e


def recv(sock: socket.socket, *, timeout: float) -> Tuple[dict, Dict[str, torch.Tensor]]:
    """The next message: ``(header, tensors)``; the tensors share one received buffer."""
    deadline = time.monotonic() + timeout
    prefix = _recv_exact(sock, _PREFIX.size, deadline)
    magic, head_len, total = _PREFIX.unpack(prefix)
    if magic != MAGIC:
        raise HybridCommError(f"not a Downpour message (magic {magic!r}, expected {MAGIC!r})")
    if head_len > MAX_HEADER or total > MAX_PAYLOAD:
        raise HybridCommError(f"message too large: header {head_len} B, payload {total} B")
    try:
        header = json.loads(_recv_exact(sock, head_len, deadline))
    except ValueError as e:
        raise HybridCommError(f"a message header is not JSON: {e}") from e
    if not isinstance(header, dict) or not isinstance(header.get("op"), str):
        raise HybridCommError("a message header is not an object with an 'op'")
    payload = _recv_payload(sock, total, deadline)
    return header, _tensors(header.pop("tensors", []), payload)


def _tensors(specs, payload: bytearray) -> Dict[str, torch.Tensor]:
    """Check each ``[name, dtype, shape]`` against the payload, then view it as a tensor."""
    out, offset = {}, 0
    if not isinstance(specs, list):
        raise HybridCommError("a message's 'tensors' is not a list")
    for spec in specs:
        ok = (
            isinstance(spec, list)
            and len(spec) == 3
            and isinstance(spec[0], str)
            and spec[1] in _DTYPES
            and isinstance(spec[2], list)
            and all(type(d) is int and d >= 0 for d in spec[2])
        )
        if not ok:
            raise HybridCommError(f"bad tensor description in a message: {str(spec)[:200]}")
        name, dtype, shape = spec[0], _DTYPES[spec[1]], spec[2]
        numel = 1
        for d in shape:
            numel *= d
        n = numel * torch.empty((), dtype=dtype).element_size()
        if offset + n > len(payload):
            raise HybridCommError(f"message payload too short for {name} ({len(payload)} B)")
        if n == 0:
            out[name] = torch.empty(shape, dtype=dtype)
        else:
            out[name] = (
                torch.frombuffer(payload, dtype=torch.uint8, count=n, offset=offset)
                .view(dtype)
                .reshape(shape)
            )
        offset += _padded(n)
    if offset != len(payload):
        raise HybridCommError(f"message payload is {len(payload)} B, its tensors {offset} B")
    return out


def _set_deadline(sock: socket.socket, deadline: float) -> None:
    left = deadline - time.monotonic()
    if left <= 0:
        raise socket.timeout("timed out")
    sock.settimeout(left)


def _recv_exact(sock: socket.socket, n: int, deadline: float) -> bytearray:
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    try:
        while got < n:
            _set_deadline(sock, deadline)
            k = sock.recv_into(view[got:])
            if k == 0:
                raise ConnectionLost("the connection was closed")
            got += k
    except OSError as e:
        raise _wrap(e, "receiving") from e
    return buf


def _recv_payload(sock: socket.socket, n: int, deadline: float) -> bytearray:
    """Large payloads arrive in 64 MiB parts: memory grows only as bytes do, so a
    corrupt (or hostile) length cannot make the receiver allocate it up front."""
    if n <= _PART:
        return _recv_exact(sock, n, deadline)
    parts = [_recv_exact(sock, min(_PART, n - i), deadline) for i in range(0, n, _PART)]
    return bytearray().join(parts)


def _wrap(e: OSError, what: str) -> HybridCommError:
    if isinstance(e, socket.timeout):
        return HybridCommTimeout(f"timed out {what}")
    return ConnectionLost(f"{what} failed: {e}")


# --- addresses ---------------------------------------------------------------------


def format_address(host: str, port: int) -> str:
    """``host:port``, IPv6 hosts in brackets."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def parse_address(text: str) -> Tuple[str, int]:
    """``"host:port"`` or ``"[v6]:port"`` -> ``(host, port)``.

    >>> parse_address("10.0.0.5:7000"), parse_address("[::1]:7000")
    (('10.0.0.5', 7000), ('::1', 7000))
    """
    host, sep, port = text.strip().rpartition(":")
    if not sep or not host or not port.isdigit():
        raise HybridCommError(f"not a host:port address: {text!r}")
    return host.strip("[]"), int(port)


def listen(host: str, port: int) -> socket.socket:
    """A listening socket on ``host:port`` (port 0: a free one)."""
    try:
        return socket.create_server(
            (host, port), family=socket.AF_INET6 if ":" in host else socket.AF_INET, backlog=64
        )
    except OSError as e:
        raise HybridCommError(f"cannot listen on {format_address(host, port)}: {e}") from e


def connect(address: str, *, timeout: float) -> socket.socket:
    """A connection to ``host:port``; a refusal or an unreachable host is
    :class:`ConnectionLost` (the server may be restarting)."""
    host, port = parse_address(address)
    try:
        sock = socket.create_connection((host, port), timeout=timeout)
    except OSError as e:
        raise _wrap(e, f"connecting to {address}") from e
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def address_file(rendezvous: str, name: str) -> str:
    return os.path.join(rendezvous, f"{name}.addr")


def publish(rendezvous: str, name: str, address: str) -> None:
    """Write ``address`` as ``name``'s in ``rendezvous`` (atomically: a temporary
    file, then a rename, so a reader sees the old address or the new one)."""
    path = address_file(rendezvous, name)
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        f.write(address)
    os.replace(tmp, path)


def lookup(rendezvous: str, name: str) -> str:
    """``name``'s published address; :class:`ConnectionLost` while there is none."""
    try:
        with open(address_file(rendezvous, name)) as f:
            return f.read().strip()
    except FileNotFoundError:
        raise ConnectionLost(f"{name} has not published its address in {rendezvous}") from None
