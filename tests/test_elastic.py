"""Elastic restart under torchrun: a worker killed (SIGKILL) mid-training, the
group restarted by torchrun (--max-restarts), training resumed from the last
checkpoint by examples/train.py itself, and the final parameters bitwise those
of a run that never stopped. 2 ranks on CPU/gloo with a deterministic data
order (with 2 ranks every all-reduce algorithm gives the same bits, so the
start-up probe's plan cannot make the two runs differ)."""
import os
import re
import signal
import subprocess
import sys

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
TRAIN = os.path.join(ROOT, "examples", "train.py")


def _torchrun(ckpt_dir, torchrun_args=(), script_args=()):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           *torchrun_args, TRAIN, "--epochs", "1", "--checkpoint-dir", str(ckpt_dir),
           "--checkpoint-every", "5", *script_args]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            cwd=ROOT, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=300)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # torchrun and its workers: no orphan left
        out, _ = proc.communicate()
        raise AssertionError("torchrun did not finish within 300 s:\n" + out[-3000:])
    assert proc.returncode == 0, out[-3000:]
    return out


def _digest(out):
    """The parameters' digest (each attempt that reached the end printed it)."""
    found = set(re.findall(r"parameters sha256 (\w+)", out))
    assert len(found) == 1, out[-3000:]
    return found.pop()


def test_a_killed_worker_is_restarted_and_training_resumes_exactly(tmp_path):
    straight = _torchrun(tmp_path / "straight")
    crashed = _torchrun(tmp_path / "crashed", ["--max-restarts", "2"], ["--crash-at-step", "12"])
    assert "exitcode: -9" in crashed  # the worker really was killed
    assert "resumed from step 10 (attempt 1)" in crashed  # the last checkpoint before step 12
    assert _digest(crashed) == _digest(straight)
    assert "ranks identical: True" in crashed
    # no stray process: nothing still runs the script with this run's checkpoint dir
    left = subprocess.run(["pgrep", "-f", str(tmp_path / "crashed")], capture_output=True,
                          text=True)
    assert left.stdout.strip() == "", left.stdout
