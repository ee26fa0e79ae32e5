"""Run test_moe_metrics_groups.py on CPU: N pytest processes joined over gloo, no GPU, no port.

    python docs/upstream/run_gloo.py [--nproc 4] [--megatron-root DIR] [--timeout 180]

It lays out a scratch tree the way megatron-core's repository holds its tests
(``tests/unit_tests/test_utilities.py``: the CPU shim from ``shim/``;
``tests/unit_tests/transformer/moe/test_moe_metrics_groups.py``: the regression test), starts
one ``python -m pytest`` per rank in it (RANK / WORLD_SIZE set, rendezvous through a FileStore in
the scratch tree), and waits under a hard deadline. ``--megatron-root DIR`` puts the directory
holding ``megatron/`` first on PYTHONPATH (e.g. a patched copy of site-packages' ``megatron``);
every rank then reports which ``moe_logging.py`` it imported, and the run fails (exit 3) unless
it is the one under DIR.

Exit status: 0 when every rank passes, 1 when a rank fails, 3 when a rank imported another
megatron-core, 124 on the deadline, 128 + N on signal N (SIGTERM, SIGINT); every rank is killed
first and the scratch tree removed.
"""

import argparse
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
TEST = HERE / "test_moe_metrics_groups.py"
SHIM = HERE / "shim" / "tests" / "unit_tests" / "test_utilities.py"
#: How long the other ranks may run on once one rank has failed (it may have left them in a
#: collective that never completes).
GRACE_S = 15.0

CONFTEST = '''
import os
from pathlib import Path

import megatron.core.transformer.moe.moe_logging as moe_logging

Path(os.environ["MEGATRON_TEST_SENTINEL"]).write_text(moe_logging.__file__)
'''


def _layout(tree: Path) -> Path:
    (tree / "pytest.ini").write_text("[pytest]\naddopts = -p no:cacheprovider\n")
    (tree / "conftest.py").write_text(CONFTEST)
    moe = tree / "tests" / "unit_tests" / "transformer" / "moe"
    moe.mkdir(parents=True)
    for package in (moe, moe.parent, moe.parent.parent, moe.parent.parent.parent):
        (package / "__init__.py").touch()
    shutil.copy(SHIM, tree / "tests" / "unit_tests" / "test_utilities.py")
    shutil.copy(TEST, moe / TEST.name)
    return moe / TEST.name


def _kill(procs):
    for proc in procs:
        if proc.poll() is None:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    for proc in procs:
        proc.wait()


def run(nproc, megatron_root, timeout, pytest_args):
    tree = Path(tempfile.mkdtemp(prefix="moe-groups-"))
    procs = []
    try:
        test = _layout(tree)
        env = dict(os.environ, WORLD_SIZE=str(nproc), MEGATRON_TEST_FILESTORE=str(tree / "store"))
        env.setdefault("OMP_NUM_THREADS", "1")
        if megatron_root is not None:
            env["PYTHONPATH"] = os.pathsep.join(
                p for p in (str(megatron_root), env.get("PYTHONPATH")) if p
            )
        for rank in range(nproc):
            rank_env = dict(
                env,
                RANK=str(rank),
                LOCAL_RANK=str(rank),
                MEGATRON_TEST_SENTINEL=str(tree / f"rank{rank}.imported"),
            )
            log = open(tree / f"rank{rank}.log", "wb")
            procs.append(
                subprocess.Popen(
                    [sys.executable, "-m", "pytest", "-q", "-p", "no:pipemetrics",
                     "-p", "no:xdist", str(test.relative_to(tree)), *pytest_args],
                    cwd=tree, env=rank_env, stdout=log, stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            )
            log.close()
        deadline = time.monotonic() + timeout
        failed_at = None
        while any(p.poll() is None for p in procs):
            now = time.monotonic()
            if failed_at is None and any(p.returncode not in (None, 0) for p in procs):
                failed_at = now
            if now > deadline or (failed_at is not None and now > failed_at + GRACE_S):
                _kill(procs)
                if now > deadline:
                    status = 124
                    print(f"deadline of {timeout:.0f} s: killed every rank", file=sys.stderr)
                else:
                    status = 1
                    print(f"a rank failed; killed the rest after {GRACE_S:.0f} s", file=sys.stderr)
                break
            time.sleep(0.05)
        else:
            status = 0 if all(p.returncode == 0 for p in procs) else 1
        for rank, proc in enumerate(procs):
            sentinel = tree / f"rank{rank}.imported"
            imported = sentinel.read_text() if sentinel.exists() else "(nothing)"
            print(f"===== rank {rank}: exit {proc.returncode}, moe_logging from {imported}")
            print((tree / f"rank{rank}.log").read_text(errors="replace").rstrip())
            if megatron_root is not None and not imported.startswith(str(megatron_root) + os.sep):
                print(f"rank {rank} did not import megatron-core from {megatron_root}")
                status = 3 if status in (0, 1) else status
        return status
    finally:
        _kill(procs)
        shutil.rmtree(tree, ignore_errors=True)


def _stop(signum, frame):
    raise SystemExit(128 + signum)  # unwinds through run()'s cleanup: every rank is killed


def main():
    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=4)
    parser.add_argument("--megatron-root", type=Path, default=None)
    parser.add_argument("--timeout", type=float, default=180.0)
    parser.add_argument("pytest_args", nargs="*", help="passed to every rank's pytest")
    args = parser.parse_args()
    root = args.megatron_root.resolve() if args.megatron_root is not None else None
    sys.exit(run(args.nproc, root, args.timeout, args.pytest_args))


if __name__ == "__main__":
    main()
