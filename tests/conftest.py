"""Shared test helpers: import an algorithm script as a module, run scripts as users do."""

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch loads: see algos/*.py
# One torch thread in the test process, as in the ranks that run_two_ranks starts: equivalence
# tests compare the two, and a different thread count changes float reduction orders (which
# Adam's first step, g / |g|, magnifies for near-zero gradients).
os.environ.setdefault("OMP_NUM_THREADS", "1")

ROOT = Path(__file__).resolve().parents[1]
# The environment of every script a test starts: one torch thread each (tests run in parallel),
# and a crash (SIGABRT, SIGSEGV) prints the Python stack of every thread.
CHILD_ENV = {"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "PYTHONFAULTHANDLER": "1"}
sys.path.insert(0, str(ROOT))
from common.trained import load_algo  # noqa: E402,F401  # one copy, cached
from tests import warm  # noqa: E402

_warm = threading.local()  # .server: this thread's warm server, started on first use


def run_script(script: str, *args: str, nproc: int = 1, timeout: float = 300,
               check: bool = True) -> subprocess.CompletedProcess:
    """Run algos/<script>.py as plain python (nproc=1) or under torchrun (nproc>1), on the CPU,
    forked from this test process's warm server (tests/warm.py)."""
    path = str(ROOT / "algos" / f"{script}.py")
    if nproc == 1:
        proc = run_python(path, "--no-cuda", *args, timeout=timeout)
    else:  # torchrun's own process forked warm too; it starts the ranks as fresh interpreters
        proc = run_python("-m torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
                          path, "--no-cuda", *args, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"{script} exited {proc.returncode}\nstdout:\n{proc.stdout[-3000:]}\n"
                             f"stderr:\n{proc.stderr[-3000:]}")
    return proc


def run_python(path: str, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    """`python path ARGS` (path "-m module": `python -m module ARGS`) in the repository root,
    forked from this test process's warm server (tests/warm.py: the imports are done once), with
    CHILD_ENV."""
    server = getattr(_warm, "server", None)  # one request at a time: a server per thread
    if server is None or not server.in_step:  # one out of step is replaced, never reused
        server = _warm.server = warm.Server({**os.environ, **CHILD_ENV})
    return server.run(str(path), list(args), str(ROOT), timeout)


def read_summary(run_dir: Path) -> dict:
    return json.loads((run_dir / "summary.json").read_text())


@pytest.fixture(scope="session")
def ppo():
    return load_algo("ppo_multigpu")


def replay_batch(n: int, num_actions: int, seed: int = 0) -> dict:
    """A random batch shaped as common/replay.py samples it (n-step returns, discounts that are
    0 after a termination, importance weights), for the DQN family's update tests."""
    import torch
    g = torch.Generator().manual_seed(seed)
    return {"obs": torch.randint(0, 256, (n, 4, 84, 84), generator=g, dtype=torch.uint8),
            "next_obs": torch.randint(0, 256, (n, 4, 84, 84), generator=g, dtype=torch.uint8),
            "actions": torch.randint(0, num_actions, (n,), generator=g),
            "returns": torch.randn(n, generator=g) * 2,
            "discounts": (torch.rand(n, generator=g) > 0.2) * 0.99 ** 3,
            "weights": torch.rand(n, generator=g) * 0.9 + 0.1}


def _rank_main(rank: int, port: int, fn, args: tuple) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      LOCAL_RANK=str(rank), WORLD_SIZE="2")
    import torch
    torch.set_num_threads(1)
    fn(rank, *args)


def run_two_ranks(fn, *args) -> None:
    """fn(rank, *args) in two processes joined in a gloo group (as torchrun would set them up)."""
    import socket

    import torch.multiprocessing as mp
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_rank_main, args=(port, fn, args), nprocs=2, join=True)


def scalar_tags(run_dir: Path) -> set[str]:
    """Every scalar tag in the run's TensorBoard event files."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    tags = set()
    for f in run_dir.glob("events.out.tfevents.*"):
        acc = EventAccumulator(str(f))
        acc.Reload()
        tags |= set(acc.Tags()["scalars"])
    return tags


def expect_error(script: str, *args: str) -> str:
    """Run a script that must refuse its input: exit code 2; returns the last stderr line."""
    proc = run_script(script, *args, check=False, timeout=120)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2, proc.stderr
    return lines[-1] if lines else ""


def start_training(script: str, *args: str, nproc: int = 1):
    """Start a long run and return (process, its output so far) once training is under way."""
    env = {**os.environ, **CHILD_ENV}
    launcher = ([sys.executable, "-m", "torch.distributed.run", "--standalone",
                 f"--nproc_per_node={nproc}"] if nproc > 1 else [sys.executable])
    proc = subprocess.Popen(launcher + [str(ROOT / "algos" / f"{script}.py"), "--no-cuda", *args],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    seen = []
    for line in proc.stdout:
        seen.append(line)
        if line.startswith("step"):
            break
    return proc, "".join(seen)


def assert_stopped_with_checkpoint(run_dir: Path, out: str) -> int:
    """A signalled run said so with the command that continues it, left exactly one complete
    checkpoint and a matching summary."""
    assert "stopped by signal" in out, out
    assert f"--resume {run_dir}" in out.split("continue with:\n")[1].splitlines()[0], out
    ckpts = list((run_dir / "checkpoints").glob("step_*.pt"))
    assert len(ckpts) == 1 and not list((run_dir / "checkpoints").glob("*.tmp"))
    step = int(ckpts[0].stem.split("_")[1])
    assert read_summary(run_dir)["global_step"] == step > 0
    return step


# The longest tests first: pytest-xdist (`--dist loadgroup`: a module's grouped tests on one
# worker, first, then one test at a time) hands tests out in collection order, so a long test
# collected last would run alone at the end while the other worker idles: the suite's wall time
# would be its tail, not its total over the workers. Order only: every test still runs.
LONGEST = ("test_gpu_check.py", "learns_catch", "killed_rank", "torchrun_two_ranks",
           "hung_worker", "test_scaling_table", "test_throughput_parts")


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "slow: a learning, torchrun, benchmark or GPU-check run; the quick tier "
        "(-m 'not slow', docs/tests.md) leaves these out, the whole suite and CI run them")


def pytest_collection_modifyitems(items):
    items.sort(key=lambda item: next((i for i, name in enumerate(LONGEST)
                                      if name in item.nodeid), len(LONGEST)))
