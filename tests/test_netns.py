"""--shape: spec parsing, the clear error without root, and (as root) the namespaces."""

import os
import signal
import subprocess
import sys

import pytest

from hybridcomm.tools.netns import NetnsError, ShapedNetwork, parse_shape


def test_parse_shape_fills_defaults_and_rejects_nonsense():
    assert parse_shape("rate 1gbit") == ["rate", "1gbit", "burst", "64kb", "latency", "50ms"]
    assert parse_shape("tbf rate 100mbit burst 128kb limit 1mb") == [
        "rate",
        "100mbit",
        "burst",
        "128kb",
        "limit",
        "1mb",
    ]
    for bad in ("", "1gbit", "burst 64kb", "rate 1gbit delay 10ms"):
        with pytest.raises(NetnsError):
            parse_shape(bad)


def test_not_root_gives_a_clear_error(monkeypatch):
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    with pytest.raises(NetnsError, match="needs root"):
        ShapedNetwork(2, "rate 1gbit").open()


def test_cli_reports_the_error_instead_of_hanging(tmp_path):
    # As a non-root user (or where namespaces cannot be made) the CLI must say so.
    code = (
        "import os, sys; os.geteuid = lambda: 1000; from hybridcomm.tools.bench.cli import main; "
        "sys.exit(main(['--nprocs', '2', '--shape', 'rate 1gbit', '-b', '4K', '-e', '4K']))"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode != 0
    assert "--shape" in r.stderr and "root" in r.stderr


def _can_make_namespaces():
    if os.geteuid() != 0:
        return False
    r = subprocess.run(["ip", "netns", "add", "hc-probe-ns"], capture_output=True)
    subprocess.run(["ip", "netns", "del", "hc-probe-ns"], capture_output=True)
    return r.returncode == 0


@pytest.mark.skipif(not _can_make_namespaces(), reason="needs root and network namespaces")
def test_shaped_tiny_sweep_runs_and_cleans_up(tmp_path):
    out = tmp_path / "shaped.json"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "hybridcomm.tools.bench",
            "--nprocs",
            "2",
            "--shape",
            "rate 1gbit",
            "-b",
            "4K",
            "-e",
            "64K",
            "-f",
            "16",
            "-n",
            "2",
            "-w",
            "1",
            "--algo",
            "ring,native",
            "--json",
            str(out),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    text, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, text
    import json

    doc = json.loads(out.read_text())
    assert doc["shape"].startswith("rate 1gbit") and all(x["wrong"] == 0 for x in doc["results"])
    tag = f"hc{proc.pid % 100000}"  # ShapedNetwork's names
    left = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
    assert f"{tag}-r" not in left and f" {tag}b:" not in links


@pytest.mark.skipif(not _can_make_namespaces(), reason="needs root and network namespaces")
def test_close_removes_everything_even_after_a_failure():
    net = ShapedNetwork(2, "rate 1gbit")
    net.open()
    assert net.leftovers()
    net.close()
    assert net.leftovers() == []
    net.close()  # idempotent


@pytest.mark.skipif(not _can_make_namespaces(), reason="needs root and network namespaces")
def test_a_second_signal_during_cleanup_does_not_cut_it_short(monkeypatch):
    """``timeout`` forwards its SIGTERM to a run that pkill signalled too: the second
    signal lands while close() is deleting; it must not stop it halfway."""
    import hybridcomm.tools.netns as netns

    net = ShapedNetwork(2, "rate 1gbit").open()
    real, sent = netns._quiet, []

    def quiet_and_signalled(*cmd):
        if not sent:  # the second SIGTERM, in the middle of the cleanup
            sent.append(cmd)
            os.kill(os.getpid(), signal.SIGTERM)
        return real(*cmd)

    monkeypatch.setattr(netns, "_quiet", quiet_and_signalled)
    with pytest.raises(SystemExit):
        os.kill(os.getpid(), signal.SIGTERM)
    assert sent and net.leftovers() == []
