"""Shared test helpers: import an algorithm script as a module, run scripts as users do."""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch loads: see algos/*.py

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def load_algo(name: str):
    """algos/<name>.py as a module (the scripts are not a package: users launch them by path)."""
    spec = importlib.util.spec_from_file_location(name, ROOT / "algos" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses resolve string annotations through sys.modules
    spec.loader.exec_module(module)
    return module


def run_script(script: str, *args: str, nproc: int = 1, timeout: float = 300,
               check: bool = True) -> subprocess.CompletedProcess:
    """Run algos/<script>.py with plain python (nproc=1) or torchrun (nproc>1), on the CPU."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    path = str(ROOT / "algos" / f"{script}.py")
    if nproc > 1:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc_per_node={nproc}", path]
    else:
        cmd = [sys.executable, path]
    proc = subprocess.run(cmd + ["--no-cuda", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"{script} exited {proc.returncode}\nstdout:\n{proc.stdout[-3000:]}\n"
                             f"stderr:\n{proc.stderr[-3000:]}")
    return proc


def read_summary(run_dir: Path) -> dict:
    return json.loads((run_dir / "summary.json").read_text())


@pytest.fixture(scope="session")
def ppo():
    return load_algo("ppo_multigpu")
