"""The investigation behind docs/PARALLELISM.md's ps table (ad hoc, kept as run):
ring, native, ps and ps's raw flows (benchmarks/ps.py's rank function) at one
size, 4 workers + K servers, each process on its own shaped link, with one
variation at a time: tbf arguments (--shape), TCP congestion control in the
namespaces (--cc), htb instead of tbf (--htb) with pure ACKs in a priority
class (--ackprio), a qdisc under tbf (--child), the raw pulls on connections
of their own (--split), ps's window and chunk size (--window, --chunk).
Root only. Example: python benchmarks/results/ps/investigate.py --split --htb --ackprio
"""

import argparse, os, subprocess, sys, time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", ".."))  # benchmarks/
sys.path.insert(0, os.path.join(HERE, "..", "..", ".."))  # the repository
import ps as psbench
from hybridcomm.launch import launch
from hybridcomm.netns import ShapedNetwork

ap = argparse.ArgumentParser()
ap.add_argument("--shape", default="rate 100mbit")
ap.add_argument("--cc", default=None)
ap.add_argument("--child", default=None, help="tc qdisc under tbf, e.g. 'fq_codel'")
ap.add_argument("--htb", action="store_true", help="htb 100mbit instead of tbf")
ap.add_argument("--ackprio", action="store_true", help="with --htb: packets < 128 B first")
ap.add_argument("--split", action="store_true", help="raw pulls on their own connections")
ap.add_argument("--window", type=int, default=None)
ap.add_argument("--chunk", type=int, default=256 << 10)
ap.add_argument("--servers", type=int, default=4)
ap.add_argument("--size", type=int, default=16 << 20)
ap.add_argument("--iters", type=int, default=2)


def qdisc_handle(cmd_prefix, dev):
    out = subprocess.run(
        cmd_prefix + ["qdisc", "show", "dev", dev], capture_output=True, text=True
    ).stdout
    for line in out.splitlines():
        w = line.split()
        if w[:2] == ["qdisc", "tbf"]:
            return w[2]
    raise RuntimeError(out)


PULL = {}


def _raw_split(role, nbytes, pull):
    """psbench._raw_exchange with the pulls on their own connections (a second group)."""
    import torch, torch.distributed as dist

    n = nbytes // 4 // len(role.servers)
    g = PULL["g"]
    works = []
    if role.is_server:
        for worker in role.workers:
            works.append(dist.irecv(torch.empty(n), worker, tag=91))
            if pull:
                works.append(dist.isend(torch.ones(n), worker, group=g, tag=92))
    else:
        for server in role.servers:
            works.append(dist.isend(torch.ones(n), server, tag=91))
            if pull:
                works.append(dist.irecv(torch.empty(n), server, group=g, tag=92))
    for w in works:
        w.wait()


def _rank_split(rank, world, *args):
    import torch.distributed as dist

    PULL["g"] = dist.new_group(list(range(world)))
    psbench._raw_exchange = _raw_split
    return psbench._rank(rank, world, *args)


def htb(pre, dev, ackprio, rate="100mbit", limit="689000"):
    run = lambda *c: subprocess.run(pre + list(c), check=True)
    run("qdisc", "del", "dev", dev, "root")
    run("qdisc", "add", "dev", dev, "root", "handle", "1:", "htb", "default", "20")
    run(
        "class",
        "add",
        "dev",
        dev,
        "parent",
        "1:",
        "classid",
        "1:1",
        "htb",
        "rate",
        rate,
        "ceil",
        rate,
        "burst",
        "64kb",
        "cburst",
        "64kb",
    )
    run(
        "class",
        "add",
        "dev",
        dev,
        "parent",
        "1:1",
        "classid",
        "1:10",
        "htb",
        "rate",
        "10mbit",
        "ceil",
        rate,
        "prio",
        "0",
        "burst",
        "64kb",
        "cburst",
        "64kb",
    )
    run(
        "class",
        "add",
        "dev",
        dev,
        "parent",
        "1:1",
        "classid",
        "1:20",
        "htb",
        "rate",
        "90mbit",
        "ceil",
        rate,
        "prio",
        "1",
        "burst",
        "64kb",
        "cburst",
        "64kb",
    )
    for c in ("10", "20"):
        run("qdisc", "add", "dev", dev, "parent", f"1:{c}", "bfifo", "limit", limit)
    if ackprio:  # IP total length < 128: pure ACKs (and other tiny packets) in the first band
        run(
            "filter",
            "add",
            "dev",
            dev,
            "parent",
            "1:",
            "protocol",
            "ip",
            "prio",
            "1",
            "u32",
            "match",
            "u16",
            "0x0000",
            "0xff80",
            "at",
            "2",
            "flowid",
            "1:10",
        )


def main():
    a = ap.parse_args()
    n = 4 + a.servers
    if a.window:
        import hybridcomm.ps

        hybridcomm.ps.SummationServers.__init__.__kwdefaults__["window"] = a.window
    net = ShapedNetwork(n, None if a.shape == "none" else a.shape).open()
    try:
        for r in range(n):
            ns = net.namespaces[r]
            if a.cc:
                subprocess.run(
                    [
                        "ip",
                        "netns",
                        "exec",
                        ns,
                        "sysctl",
                        "-qw",
                        f"net.ipv4.tcp_congestion_control={a.cc}",
                    ],
                    check=True,
                )
            if a.htb:
                for pre, dev in ((["tc", "-n", ns], net.rank_ifs[r]), (["tc"], net.host_ifs[r])):
                    htb(pre, dev, a.ackprio)
            if a.child:
                for pre, dev in ((["tc", "-n", ns], net.rank_ifs[r]), (["tc"], net.host_ifs[r])):
                    handle = qdisc_handle(pre, dev)
                    subprocess.run(
                        pre
                        + [
                            "qdisc",
                            "replace",
                            "dev",
                            dev,
                            "parent",
                            f"{handle}1",
                            *a.child.split(),
                        ],
                        check=True,
                    )
        t0 = time.time()
        per = launch(
            _rank_split if a.split else psbench._rank,
            n,
            a.servers,
            [a.size],
            a.iters,
            a.chunk,
            backend="gloo",
            start_method="fork",
            setup=net.setup,
            timeout=1200,
        )
        rows = [r[0] for r in per[:4]]
        ring = max(r["ring"] for r in rows) * 1e3
        nat = max(r["native"] for r in rows) * 1e3
        p = max(r["ps"] for r in rows) * 1e3
        push = max(x[0]["push"] for x in per) * 1e3
        pp = max(x[0]["pushpull"] for x in per) * 1e3
        print(
            f"shape={a.shape!r} cc={a.cc} child={a.child} window={a.window} chunk={a.chunk} K={a.servers}: ring {ring:.0f} native {nat:.0f} "
            f"ps {p:.0f} ring/ps {ring / p:.2f} raw push {push:.0f} raw p+p {pp:.0f} ({time.time() - t0:.0f}s)",
            flush=True,
        )
    finally:
        net.close()


if __name__ == "__main__":
    main()
