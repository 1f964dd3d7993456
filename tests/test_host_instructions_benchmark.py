"""benchmarks/host_instructions.py: its configs run (without valgrind: a full count takes
minutes), it reads real callgrind dumps, and its figures and verdict follow the counts."""

import os
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "benchmarks", "host_instructions.py")
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import host_instructions  # noqa: E402
import sync_overhead  # noqa: E402


def test_every_config_runs_phase_by_phase_without_valgrind():
    tiny = [
        "--no-valgrind",
        "--layers",
        "3",
        "--width",
        "8",
        "--batch",
        "4",
        "--channels",
        "2",
        "--image",
        "4",
        "--conv-batch",
        "2",
        "--steps",
        "2",
        "--warmup",
        "1",
    ]
    proc = subprocess.run(
        [sys.executable, SCRIPT, *tiny], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "nothing was counted" in proc.stdout


@pytest.mark.skipif(shutil.which("valgrind") is None, reason="valgrind is not installed")
def test_reads_the_instruction_count_of_each_numbered_callgrind_dump(tmp_path):
    base = str(tmp_path / "callgrind.out")
    for _ in range(2):  # two runs of /bin/true: the final dump of each, numbered by hand
        subprocess.run(
            ["valgrind", "--tool=callgrind", f"--callgrind-out-file={base}", "true"],
            check=True,
            capture_output=True,
        )
        os.rename(base, f"{base}.{len(host_instructions.dumps(base)) + 1}")
    os.rename(f"{base}.2", f"{base}.10")  # numeric order, not the names' order
    shutil.copy(f"{base}.1", f"{base}.9")
    found = host_instructions.dumps(base)
    assert [p.rsplit(".", 1)[1] for p in found] == ["1", "9", "10"]
    counts = [host_instructions.instructions(p) for p in found]
    assert counts[0] == counts[1] and all(c > 1000 for c in counts)
    (tmp_path / "other").write_text("events: Ir\n")
    with pytest.raises(ValueError, match="summary"):
        host_instructions.instructions(str(tmp_path / "other"))


def test_added_counts_are_over_plain_and_the_verdict_follows_the_best_ddp():
    def config(total):  # spread over the phases; the figures use the sum
        return {"zero_grad": 1.0, "forward": total - 3.0, "backward": 1.0, "step": 1.0}

    per_config = {c: config(300.0) for c in sync_overhead.CONFIGS}
    per_config["plain"] = config(100.0)
    per_config["ddp-view"] = config(150.0)  # the best DDP: +50
    per_config["forward"] = config(140.0)  # +40
    per_config["backward"] = config(150.0)  # +50: equal counts as <=
    per_config["none"] = config(175.0)  # +75
    [res] = host_instructions.figures({"linear": per_config}, {"linear": 10})
    rows = res["configs"]
    assert res["best_ddp"] == "ddp-view" and not res["hybridcomm_le_ddp"]
    assert rows["forward"]["added"] == 40.0 and rows["forward"]["added_per_param"] == 4.0
    assert rows["forward"]["per_step"] == 140.0 and rows["forward"]["phases"]["forward"] == 137.0
    assert rows["backward"]["x_ddp"] == 1.0 and rows["none"]["x_ddp"] == 1.5
    assert rows["plain"]["x_ddp"] is None
    assert host_instructions.verdict(res) == (
        "hybridcomm adds <= DDP's instructions in every mode: no "
        "(forward 0.80, backward 1.00, none 1.50 x DDP)"
    )
