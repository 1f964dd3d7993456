"""A shaped network on one machine: one network namespace per rank, veth pairs
to a bridge, and a ``tbf`` qdisc of a given rate on each rank's link.

With ``node_size``, one bridge per node and each node's uplink to a core bridge
shaped by ``inter_spec``, as one NIC per node. Bandwidth only: the development
kernels have ``tbf`` but no ``netem`` (latency is emulated in the transport,
transport/latency.py). Needs root (CAP_NET_ADMIN) and iproute2; everything is
removed on every exit path (``close()``, ``with``, ``atexit``, SIGINT/SIGTERM).

Usage (needs root)::

    with ShapedNetwork(4, "rate 1gbit") as net:
        launch(work, 4, setup=net.setup)
    with ShapedNetwork(4, None, node_size=2, inter_spec="rate 100mbit") as net:
        launch(work, 4, setup=net.setup)      # 2 nodes of 2, 100 Mbit/s between them
"""

from __future__ import annotations

import atexit
import ctypes
import os
import shlex
import shutil
import signal
import subprocess
from typing import List, Optional

CLONE_NEWNET = 0x40000000
SUBNET = "10.213.0"  # private, and only ever inside our own namespaces
DEFAULT_TBF = {"burst": "64kb", "latency": "50ms"}


class NetnsError(RuntimeError):
    """The shaped network could not be made (not root, no iproute2, a bad spec...)."""


def parse_shape(spec: str) -> List[str]:
    """``"rate 1gbit"`` -> tbf arguments, with burst 64kb and latency 50ms
    unless the spec sets them (or ``limit``, which replaces latency).

    Example::

        >>> parse_shape("rate 1gbit")
        ['rate', '1gbit', 'burst', '64kb', 'latency', '50ms']
    """
    words = shlex.split(spec.strip().removeprefix("tbf").strip())
    if len(words) % 2 or not words:
        raise NetnsError(f"--shape {spec!r}: expected 'rate RATE [burst SIZE] [latency TIME]'")
    opts = dict(zip(words[::2], words[1::2]))
    unknown = set(opts) - {"rate", "burst", "latency", "limit", "peakrate", "mtu", "minburst"}
    if "rate" not in opts or unknown:
        raise NetnsError(
            f"--shape {spec!r}: needs 'rate RATE'"
            + (f"; unknown tbf options {sorted(unknown)}" if unknown else "")
        )
    for key, value in DEFAULT_TBF.items():
        if key not in opts and not (key == "latency" and "limit" in opts):
            opts[key] = value
    return [w for kv in opts.items() for w in kv]


def _run(*cmd: str) -> None:
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode:
        raise NetnsError(f"`{' '.join(cmd)}` failed: {r.stderr.strip() or r.returncode}")


def _quiet(*cmd: str) -> None:
    subprocess.run(cmd, capture_output=True)


class EnterNamespace:
    """The launcher's ``setup`` hook: put rank r in its namespace (``setns``) and
    point gloo at its interface (``GLOO_SOCKET_IFNAME``). Picklable, so it also
    works with spawn; the FileStore rendezvous works across namespaces because
    the filesystem is shared."""

    def __init__(self, namespaces: List[str], ifnames: List[str]):
        self.namespaces, self.ifnames = namespaces, ifnames

    def __call__(self, rank: int, world_size: int) -> None:
        libc = ctypes.CDLL(None, use_errno=True)
        fd = os.open(f"/var/run/netns/{self.namespaces[rank]}", os.O_RDONLY)
        try:
            if libc.setns(fd, CLONE_NEWNET) != 0:
                err = ctypes.get_errno()
                raise NetnsError(f"rank {rank}: setns({self.namespaces[rank]}): {os.strerror(err)}")
        finally:
            os.close(fd)
        os.environ["GLOO_SOCKET_IFNAME"] = self.ifnames[rank]


class ShapedNetwork:
    """``world_size`` namespaces on a bridge, each link shaped by ``tbf <spec>``
    (None: unshaped); with ``node_size``, one bridge per node and each node's
    uplink shaped by ``tbf <inter_spec>`` (None: unshaped)."""

    def __init__(
        self,
        world_size: int,
        spec: Optional[str],
        node_size: Optional[int] = None,
        inter_spec: Optional[str] = None,
    ):
        self.world_size = world_size
        self.tbf = parse_shape(spec) if spec is not None else None
        self.spec = " ".join(self.tbf) if self.tbf else None
        if inter_spec is not None and node_size is None:
            raise NetnsError("an inter-node shape needs node_size (ranks per node)")
        if node_size is not None and node_size < 1:
            raise NetnsError(f"node_size must be >= 1, got {node_size}")
        self.node_size = min(node_size or world_size, world_size)
        self.nodes = -(-world_size // self.node_size)
        self.inter_tbf = parse_shape(inter_spec) if inter_spec is not None else None
        self.inter_spec = " ".join(self.inter_tbf) if self.inter_tbf else None
        tag = f"hc{os.getpid() % 100000}"
        # One node: the single bridge of before; several: a bridge per node,
        # uplink veth pairs (node side u, core side d) to a core bridge. All
        # addresses on one subnet (layer 2 across the bridges): gloo needs only
        # its interface name.
        self.node_bridges = (
            [f"{tag}b"] if self.nodes == 1 else [f"{tag}b{k}" for k in range(self.nodes)]
        )
        self.core_bridge = f"{tag}c" if self.nodes > 1 else None
        self.uplinks = (
            [(f"{tag}u{k}", f"{tag}d{k}") for k in range(self.nodes)] if self.nodes > 1 else []
        )
        self.bridge = self.node_bridges[0]
        self.namespaces = [f"{tag}-r{r}" for r in range(world_size)]
        self.host_ifs = [f"{tag}h{r}" for r in range(world_size)]
        self.rank_ifs = [f"{tag}n{r}" for r in range(world_size)]
        self.addresses = [f"{SUBNET}.{r + 1}" for r in range(world_size)]
        self.setup = EnterNamespace(self.namespaces, self.rank_ifs)
        self._made = False
        self._old_handlers = {}

    def _check(self) -> None:
        if os.geteuid() != 0:
            raise NetnsError(
                "--shape needs root (it makes network namespaces, veth pairs, a "
                "bridge and tc qdiscs): run as root, or leave --shape out"
            )
        for tool in ("ip", "tc"):
            if shutil.which(tool) is None:
                raise NetnsError(f"--shape needs iproute2's `{tool}` on the PATH")
        if self.world_size > 250:
            raise NetnsError("--shape supports at most 250 ranks")

    def open(self) -> "ShapedNetwork":
        self._check()
        self._made = True
        atexit.register(self.close)
        for sig in (signal.SIGINT, signal.SIGTERM):
            self._old_handlers[sig] = signal.signal(sig, self._on_signal)
        try:
            for bridge in self.node_bridges + ([self.core_bridge] if self.core_bridge else []):
                _run("ip", "link", "add", bridge, "type", "bridge")
                _run("ip", "link", "set", bridge, "up")
            for k, (node_end, core_end) in enumerate(self.uplinks):
                _run("ip", "link", "add", node_end, "type", "veth", "peer", "name", core_end)
                _run("ip", "link", "set", node_end, "master", self.node_bridges[k])
                _run("ip", "link", "set", core_end, "master", self.core_bridge)
                for end in (node_end, core_end):  # out of the node, into the node
                    _run("ip", "link", "set", end, "up")
                    if self.inter_tbf:
                        _run("tc", "qdisc", "add", "dev", end, "root", "tbf", *self.inter_tbf)
            for r in range(self.world_size):
                ns, host, inner = self.namespaces[r], self.host_ifs[r], self.rank_ifs[r]
                _run("ip", "netns", "add", ns)
                _run("ip", "link", "add", host, "type", "veth", "peer", "name", inner)
                _run("ip", "link", "set", inner, "netns", ns)
                _run("ip", "link", "set", host, "master", self.node_bridges[r // self.node_size])
                _run("ip", "link", "set", host, "up")
                _run("ip", "-n", ns, "addr", "add", f"{self.addresses[r]}/24", "dev", inner)
                _run("ip", "-n", ns, "link", "set", inner, "up")
                _run("ip", "-n", ns, "link", "set", "lo", "up")
                if self.tbf:  # both directions, as a full-duplex NIC: sent, received
                    _run("tc", "-n", ns, "qdisc", "add", "dev", inner, "root", "tbf", *self.tbf)
                    _run("tc", "qdisc", "add", "dev", host, "root", "tbf", *self.tbf)
        except BaseException:
            self.close()
            raise
        return self

    def _on_signal(self, signum, frame):
        if not self._made:  # a second signal while close() runs: let it finish
            return
        self.close()
        old = self._old_handlers.get(signum)
        if callable(old):
            old(signum, frame)
        elif signum == signal.SIGINT:
            raise KeyboardInterrupt
        else:
            raise SystemExit(128 + signum)

    def close(self) -> None:
        """Remove the namespaces (their veth ends go with them), the host ends
        and the bridge. Idempotent."""
        if not self._made:
            return
        self._made = False
        for ns in self.namespaces:
            _quiet("ip", "netns", "del", ns)
        for host in self.host_ifs + [u for u, _ in self.uplinks]:
            _quiet("ip", "link", "del", host)
        for bridge in self.node_bridges + ([self.core_bridge] if self.core_bridge else []):
            _quiet("ip", "link", "del", bridge)
        for sig, old in self._old_handlers.items():
            try:
                signal.signal(sig, old)
            except (ValueError, TypeError):
                pass
        self._old_handlers.clear()
        try:
            atexit.unregister(self.close)
        except Exception:
            pass

    def leftovers(self) -> List[str]:
        """Namespaces or links of ours still present (for tests)."""
        out = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
        ns = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        names = (
            self.node_bridges
            + ([self.core_bridge] if self.core_bridge else [])
            + self.host_ifs
            + [x for pair in self.uplinks for x in pair]
        )
        return [n for n in names if f" {n}:" in out or f" {n}@" in out] + [
            n for n in self.namespaces if n in ns.split()
        ]

    def describe(self) -> str:
        """One line for a report header."""
        links = f"tbf {self.spec}" if self.spec else "unshaped"
        if self.nodes == 1:
            return f"{links} on each rank link (namespaces)"
        inter = f"tbf {self.inter_spec}" if self.inter_spec else "unshaped"
        last = self.world_size - (self.nodes - 1) * self.node_size
        return (
            f"{self.nodes} nodes of {self.node_size} ranks (last {last}); rank links {links}; "
            f"each node's uplink (shared by its ranks) {inter} (namespaces)"
        )

    def __enter__(self) -> "ShapedNetwork":
        return self.open()

    def __exit__(self, *exc) -> Optional[bool]:
        self.close()
        return None
