#!/usr/bin/env python3
"""`make mutation`: each mutation of tests/mutation/mutations.py, applied to a copy of
the checkout, must make a test of `make test` fail.

For every mutation: copy the tracked files (``git ls-files``, as they are in the
working tree) into a temporary directory, apply the one text replacement, and
run its guarding tests there with ``-x`` (HYBRIDCOMM_SIMULATE_GPU=1 for the
Makefile's SIM_TESTS, unset for the others) under a time limit. If they all
pass (the mutation survived them), the whole simulated suite runs (SIM_TESTS,
then the training loops' simgpu cases, as `make test` runs them) to see
whether anything else catches it. The copy imports its own ``hybridcomm``:
this script runs the venv's python with PYTHONPATH at the copy first, and
checks once that every hybridcomm module (``hybridcomm.kernels`` included:
the editable install maps it to this checkout's ``kernels/``, so the copy
gets a ``hybridcomm/kernels`` link to its own) comes from the copy.

Before any mutation, the unmutated copy must pass every selected guard (the
baseline), and every mutation's ``old`` text must occur exactly once in its
file: otherwise this is a harness error (exit 2), never "caught".

Prints a table (mutation, defect, the test that caught it, seconds) and last
``caught N of M``; exits 0 only if every mutation was caught.

    python tests/mutation/run.py                    # all (make mutation)
    python tests/mutation/run.py --list
    python tests/mutation/run.py --only no-wait-before-use,tolist-per-bucket
    python tests/mutation/run.py --rev HEAD         # the last commit, not the working tree
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(HERE))
from mutations import MUTATIONS, Mutation  # noqa: E402

SIM_ENV = "HYBRIDCOMM_SIMULATE_GPU"
# What `make test` runs on the simulated GPU besides SIM_TESTS (its ranks set the
# variable themselves).
SIM_EXTRA = (("tests/test_training_loops.py", "-k", "simgpu"),)


class HarnessError(Exception):
    """The harness cannot judge (stale mutation, failing baseline, wrong imports)."""


# -- the checkout -----------------------------------------------------------------------------


def sim_tests(makefile: Path = ROOT / "Makefile") -> List[str]:
    """The Makefile's SIM_TESTS (with its line continuations)."""
    m = re.search(r"^SIM_TESTS\s*:?=((?:[^\n]*\\\n)*[^\n]*)$", makefile.read_text(), re.M)
    if m is None:
        raise HarnessError(f"no SIM_TESTS in {makefile}")
    return m.group(1).replace("\\\n", " ").split()


def occurrences(m: Mutation, root: Path) -> int:
    path = root / m.file
    if not path.is_file():
        return 0
    return path.read_text().count(m.old)


def check_fresh(mutations: Sequence[Mutation], root: Path = ROOT) -> None:
    stale = [
        f"{m.id}: its old text occurs {occurrences(m, root)} times in {m.file} "
        "(must be exactly once)"
        for m in mutations
        if occurrences(m, root) != 1
    ]
    if stale:
        raise HarnessError(
            "stale mutations (update tests/mutation/mutations.py):\n  " + "\n  ".join(stale)
        )


def package_dirs(root: Path) -> Dict[str, str]:
    """pyproject's setuptools package-dir: package -> directory ("hybridcomm.kernels" ->
    "kernels")."""
    import tomllib

    with open(root / "pyproject.toml", "rb") as f:
        cfg = tomllib.load(f)
    return dict(cfg.get("tool", {}).get("setuptools", {}).get("package-dir", {}))


def snapshot(dest: Path, rev: Optional[str] = None) -> None:
    """The tracked files as they are in the working tree (or at commit ``rev``), and
    links for the packages setuptools maps elsewhere (hybridcomm/kernels -> kernels),
    so the copy imports only itself."""
    if rev is not None:
        import io
        import tarfile

        tar = subprocess.run(["git", "archive", "--format=tar", rev], cwd=ROOT, capture_output=True)
        if tar.returncode != 0:
            raise HarnessError(f"git archive {rev}: {tar.stderr.decode().strip()}")
        dest.mkdir(parents=True)
        with tarfile.open(fileobj=io.BytesIO(tar.stdout)) as t:
            t.extractall(dest, filter="tar")
        _link_packages(dest)
        return
    out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True)
    for name in out.stdout.decode().split("\0"):
        if not name:
            continue
        src = ROOT / name
        if not src.exists() and not src.is_symlink():
            continue  # deleted in the working tree
        dst = dest / name
        dst.parent.mkdir(parents=True, exist_ok=True)
        if src.is_symlink():
            os.symlink(os.readlink(src), dst)
        else:
            shutil.copy2(src, dst)
    _link_packages(dest)


def _link_packages(dest: Path) -> None:
    for package, directory in package_dirs(dest).items():
        link = dest / package.replace(".", "/")
        if not link.exists():
            os.symlink(os.path.relpath(dest / directory, link.parent), link)


def clone(pristine: Path, dest: Path) -> Path:
    shutil.copytree(pristine, dest, symlinks=True)
    return dest


def apply(m: Mutation, copy: Path) -> None:
    path = copy / m.file
    text = path.read_text()
    if text.count(m.old) != 1:
        raise HarnessError(
            f"{m.id}: old text occurs {text.count(m.old)} times in the copy's {m.file}"
        )
    path.write_text(text.replace(m.old, m.new))


# -- running pytest in a copy -----------------------------------------------------------------


class Runner:
    def __init__(self, python: str, sim: Sequence[str], logs: Path, verbose: bool):
        self.python, self.sim, self.logs, self.verbose = python, set(sim), logs, verbose
        self._n = 0

    def env(self, copy: Path, simulate: bool) -> Dict[str, str]:
        env = dict(os.environ)
        env["PYTHONPATH"] = str(copy)
        env.pop(SIM_ENV, None)
        if simulate:
            env[SIM_ENV] = "1"
        return env

    def verify_imports(self, copy: Path) -> None:
        code = (
            "import importlib, sys\n"
            "for name in ('hybridcomm', 'hybridcomm.kernels', 'hybridcomm.kernels.pack',\n"
            "             'hybridcomm.comm.transport.cupy_nccl', 'hybridcomm.testing.simgpu',\n"
            "             'hybridcomm.tools.bench.harness'):\n"
            "    importlib.import_module(name)\n"
            "for name, mod in sorted(sys.modules.items()):\n"
            "    if name.split('.')[0] == 'hybridcomm' and getattr(mod, '__file__', None):\n"
            "        print(name, mod.__file__)\n"
        )
        r = subprocess.run(
            [self.python, "-c", code],
            cwd=copy,
            env=self.env(copy, False),
            capture_output=True,
            text=True,
            timeout=300,
        )
        if r.returncode != 0:
            raise HarnessError(f"importing hybridcomm from the copy failed:\n{r.stderr}")
        real = os.path.realpath(copy)
        foreign = [
            line
            for line in r.stdout.splitlines()
            if not os.path.realpath(line.split(" ", 1)[1]).startswith(real + os.sep)
        ]
        if foreign or not r.stdout.strip():
            raise HarnessError(
                "the copy does not import its own hybridcomm:\n  "
                + "\n  ".join(foreign or ["(nothing imported)"])
            )

    def pytest(
        self, copy: Path, args: Sequence[str], simulate: bool, timeout: float, tag: str
    ) -> Tuple[int, Optional[str], float, Path]:
        """(exit status or None on a timeout, the first failing node id, seconds, log)."""
        self._n += 1
        log = self.logs / f"{self._n:03d}-{tag}.log"
        cmd = [self.python, "-m", "pytest", "-x", "-v", "-rfE", "-p", "no:cacheprovider", *args]
        t0 = time.monotonic()
        with open(log, "w") as out:
            out.write(f"# {SIM_ENV}={'1' if simulate else '(unset)'} " + " ".join(cmd) + "\n")
            out.flush()
            proc = subprocess.Popen(
                cmd,
                cwd=copy,
                env=self.env(copy, simulate),
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
            try:
                rc = proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)  # pytest and the rank processes it forked
                proc.wait()
                rc = None
            except BaseException:  # ^C: its own session does not get the terminal's signal
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                raise
        seconds = time.monotonic() - t0
        text = log.read_text()
        if rc is None:
            return (
                None,
                f"timeout after {timeout:.0f} s in {last_started(text) or '?'}",
                seconds,
                log,
            )
        if rc in (4, 5):  # usage error (a node id not found), nothing collected
            raise HarnessError(
                f"pytest exit {rc} for {' '.join(args)} (see {log}):\n"
                + "\n".join(text.splitlines()[-15:])
            )
        return rc, first_failure(text) if rc else None, seconds, log


def first_failure(text: str) -> str:
    for line in text.splitlines():
        for kind in ("FAILED ", "ERROR "):
            # (a -v status written after a crash's output also starts "FAILED [100%]")
            if line.startswith(kind + "tests/"):
                return line[len(kind) :].split(" - ", 1)[0].strip()
    return "pytest failed (no summary: see the log)"


def last_started(text: str) -> Optional[str]:
    """The node id of the last test pytest -v announced (what was running at a timeout)."""
    last = None
    for line in text.splitlines():
        m = re.match(r"^(tests/\S+::\S.*?)(?: (PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS).*)?$", line)
        if m:
            last = m.group(1).strip()
    return last


def split_by_env(nodes: Sequence[str], sim: Sequence[str]) -> List[Tuple[bool, List[str]]]:
    """Consecutive runs of node ids with the same environment, in order."""
    groups: List[Tuple[bool, List[str]]] = []
    for node in nodes:
        simulate = node.split("::", 1)[0] in sim
        if groups and groups[-1][0] == simulate:
            groups[-1][1].append(node)
        else:
            groups.append((simulate, [node]))
    return groups


# -- the run ----------------------------------------------------------------------------------


def run_guards(
    runner: Runner, copy: Path, nodes: Sequence[str], timeout: float, tag: str, sim: Sequence[str]
) -> Tuple[Optional[str], float]:
    """The first failing guard (None: all passed) and the seconds taken."""
    return _first_failure(runner, copy, split_by_env(nodes, sim), timeout, tag)


def run_whole(
    runner: Runner, copy: Path, sim: Sequence[str], timeout: float, tag: str
) -> Tuple[Optional[str], float]:
    """The simulated suites as `make test` runs them (SIM_TESTS, the training loops'
    simgpu cases), with -x: the first failure, or None."""
    runs = [(True, list(sim))] + [(False, list(a)) for a in SIM_EXTRA]
    return _first_failure(runner, copy, runs, timeout, tag)


def _first_failure(
    runner: Runner, copy: Path, runs, timeout: float, tag: str
) -> Tuple[Optional[str], float]:
    """Run each (simulate, pytest args) in turn within ``timeout`` in all: the first
    failing test (None: all passed) and the seconds taken."""
    total, deadline = 0.0, time.monotonic() + timeout
    for simulate, args in runs:
        left = max(1.0, deadline - time.monotonic())
        rc, failed, seconds, _ = runner.pytest(copy, args, simulate, left, tag)
        total += seconds
        if rc != 0:
            return failed, total
    return None, total


def table(rows: Sequence[Tuple[str, str, str, float]], markdown: bool) -> List[str]:
    head = ("mutation", "defect", "caught by", "seconds")
    cells = [head] + [(a, b, c, f"{s:.0f}") for a, b, c, s in rows]
    if markdown:
        out = ["| " + " | ".join(head) + " |", "|---|---|---|---:|"]
        out += [
            "| "
            + " | ".join(
                f"`{c}`" if i in (0, 2) and c != "SURVIVED" else c for i, c in enumerate(r)
            )
            + " |"
            for r in cells[1:]
        ]
        return out
    widths = [max(len(r[i]) for r in cells) for i in range(4)]
    return [
        "  ".join(
            c.rjust(w) if i == 3 else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))
        ).rstrip()
        for r in cells
    ]


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--list", action="store_true", help="list the mutations and exit")
    ap.add_argument("--only", default="", help="comma-separated mutation ids")
    ap.add_argument(
        "--rev",
        default=None,
        help="copy the files of this commit (e.g. HEAD) instead of the working tree "
        "(whose uncommitted edits, anyone's, are otherwise included)",
    )
    ap.add_argument(
        "--python",
        default=sys.executable,
        help="the interpreter whose environment runs the tests (default: this one)",
    )
    ap.add_argument(
        "--timeout",
        type=float,
        default=600,
        help="seconds for one mutation's guarding tests (a hang counts as caught)",
    )
    ap.add_argument(
        "--whole-timeout",
        type=float,
        default=3600,
        help="seconds for the whole simulated suite on a surviving mutation",
    )
    ap.add_argument(
        "--no-whole", action="store_true", help="do not run the whole simulated suite on survivors"
    )
    ap.add_argument("--markdown", action="store_true", help="print the table in Markdown")
    ap.add_argument("--keep", action="store_true", help="keep the copies (and their logs)")
    ap.add_argument("--verbose", action="store_true")
    args = ap.parse_args(argv)

    selected = list(MUTATIONS)
    if args.only:
        wanted = [x.strip() for x in args.only.split(",") if x.strip()]
        known = {m.id for m in MUTATIONS}
        unknown = [x for x in wanted if x not in known]
        if unknown:
            print(f"error: unknown mutation ids {unknown}; --list shows them", file=sys.stderr)
            return 2
        selected = [m for m in MUTATIONS if m.id in wanted]
    if args.list:
        for m in selected:
            print(f"{m.id}  [{m.defect}]  {m.file}: {m.what}")
            for g in m.guards:
                print(f"    {g}")
        return 0

    work = Path(tempfile.mkdtemp(prefix="hybridcomm-mutation-"))
    logs = work / "logs"
    logs.mkdir()
    try:
        ids = [m.id for m in MUTATIONS]
        dupes = sorted({i for i in ids if ids.count(i) > 1})
        if dupes:
            raise HarnessError(f"duplicate mutation ids: {dupes}")
        pristine = work / "pristine"
        snapshot(pristine, args.rev)
        check_fresh(selected, pristine)
        sim = sim_tests(pristine / "Makefile")
        runner = Runner(args.python, sim, logs, args.verbose)
        base = clone(pristine, work / "baseline")
        runner.verify_imports(base)
        guards = list(dict.fromkeys(g for m in selected for g in m.guards))
        guards.sort(key=lambda g: g.split("::", 1)[0] not in sim)  # two pytest runs
        print(
            f"[mutation] baseline: {len(guards)} guarding tests on the unmutated copy ...",
            file=sys.stderr,
            flush=True,
        )
        failed, seconds = run_guards(runner, base, guards, args.timeout * 2, "baseline", sim)
        if failed is not None:
            raise HarnessError(
                f"the unmutated copy fails a guarding test: {failed} (logs in {logs})"
            )
        print(f"[mutation] baseline passed ({seconds:.0f} s)", file=sys.stderr, flush=True)
        if not args.keep:
            shutil.rmtree(base)

        rows = []
        for k, m in enumerate(selected, 1):
            copy = clone(pristine, work / m.id)
            apply(m, copy)
            print(
                f"[mutation] {k}/{len(selected)} {m.id} ({m.defect}): {m.what}",
                file=sys.stderr,
                flush=True,
            )
            failed, seconds = run_guards(runner, copy, m.guards, args.timeout, m.id, sim)
            if failed is None and not args.no_whole:
                print(
                    "[mutation]   survived its guards; running the whole simulated suite",
                    file=sys.stderr,
                    flush=True,
                )
                failed, more = run_whole(runner, copy, sim, args.whole_timeout, m.id + "-whole")
                seconds += more
            print(
                f"[mutation]   {'caught by ' + failed if failed else 'SURVIVED'} ({seconds:.0f} s)",
                file=sys.stderr,
                flush=True,
            )
            rows.append((m.id, m.defect, failed or "SURVIVED", seconds))
            if not args.keep:
                shutil.rmtree(copy)
    except HarnessError as e:
        print(f"mutation harness error: {e}", file=sys.stderr)
        return 2
    finally:
        if not args.keep:
            shutil.rmtree(work / "pristine", ignore_errors=True)
    caught = sum(1 for r in rows if r[2] != "SURVIVED")
    print(f"[mutation] logs: {logs}", file=sys.stderr, flush=True)
    for line in table(rows, args.markdown):
        print(line)
    print(f"caught {caught} of {len(rows)}", flush=True)
    return 0 if caught == len(rows) else 1


if __name__ == "__main__":
    sys.exit(main())
