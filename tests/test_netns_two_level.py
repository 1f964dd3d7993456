"""The two-level shaped network: a bridge per node, a shaped uplink per node; as
root, hierarchical beats ring across a slow link and nothing is left behind."""

import json
import os
import subprocess
import sys

import pytest

from hybridcomm.tools.netns import NetnsError, ShapedNetwork


def test_two_level_arguments():
    with pytest.raises(NetnsError, match="node_size"):
        ShapedNetwork(4, None, inter_spec="rate 100mbit")
    net = ShapedNetwork(5, None, node_size=2, inter_spec="rate 100mbit")
    assert net.nodes == 3 and len(net.node_bridges) == 3 and len(net.uplinks) == 3
    assert "3 nodes of 2 ranks (last 1)" in net.describe() and "100mbit" in net.describe()
    one = ShapedNetwork(4, "rate 1gbit")
    assert one.node_bridges == [one.bridge] and not one.uplinks  # as before


def _can_make_namespaces():
    if os.geteuid() != 0:
        return False
    r = subprocess.run(["ip", "netns", "add", "hc-probe-ns2"], capture_output=True)
    subprocess.run(["ip", "netns", "del", "hc-probe-ns2"], capture_output=True)
    return r.returncode == 0


@pytest.mark.skipif(not _can_make_namespaces(), reason="needs root and network namespaces")
def test_open_close_leaves_nothing():
    net = ShapedNetwork(3, None, node_size=2, inter_spec="rate 100mbit")
    net.open()
    try:
        links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
        assert all(f" {b}:" in links for b in net.node_bridges + [net.core_bridge])
        qdisc = subprocess.run(
            ["tc", "qdisc", "show", "dev", net.uplinks[0][0]], capture_output=True, text=True
        ).stdout
        assert "tbf" in qdisc and "100Mbit" in qdisc
    finally:
        net.close()
    assert net.leftovers() == []


@pytest.mark.timeout(180)  # a shaped network
@pytest.mark.skipif(not _can_make_namespaces(), reason="needs root and network namespaces")
def test_hierarchical_ahead_of_ring_across_a_slow_link(tmp_path):
    # 2 nodes of 2 joined at 100 Mbit/s: at 1 MiB the wire dominates, and ring
    # puts 1.5 MiB through each node's link against hierarchical's 1 MiB.
    out = tmp_path / "two.json"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "hybridcomm.tools.bench",
            "--nprocs",
            "4",
            "--node-size",
            "2",
            "--inter-shape",
            "rate 100mbit",
            "-b",
            "1M",
            "-e",
            "1M",
            "-n",
            "3",
            "-w",
            "1",
            "--algo",
            "ring,hierarchical",
            "--json",
            str(out),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    text, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, text
    doc = json.loads(out.read_text())
    t = {r["algo"]: r["time_us"] for r in doc["results"]}
    assert all(r["wrong"] == 0 for r in doc["results"])
    assert t["hierarchical"] < t["ring"], t
    assert "2 nodes of 2" in doc["network"] and doc["inter_shape"].startswith("rate 100mbit")
    tag = f"hc{proc.pid % 100000}"
    left = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
    assert f"{tag}-r" not in left and f" {tag}b0:" not in links and f" {tag}c:" not in links
