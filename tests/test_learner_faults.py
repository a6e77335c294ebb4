"""An exception in the learner ends the run in every asynchronous mode: the traceback, a non-zero
exit, and no process (ranks, sampler processes, multiprocessing's trackers) or shared-memory file
left behind. The fault is injected by tests/inject_fault.py once training is under way, into the
optimizer step of rank 0 (a bug, or a CUDA out-of-memory, strikes there)."""

import os
import subprocess
import sys

import pytest

from tests.conftest import CHILD_ENV, ROOT
from tests.test_appo import _family, _left, _shm, _shm_left

CATCH = ("--env-id", "tests.catch_env:Catch-v0", "--num-envs", "4", "--eval-episodes", "0",
         "--total-timesteps", "10000000")
Q_LEARNING = (*CATCH, "--replay-size", "4000", "--learning-starts", "64", "--batch-size", "16",
              "--replay-ratio", "1")
PPO = (*CATCH, "--num-steps", "16", "--num-minibatches", "1", "--update-epochs", "1")


def fault_in_the_learner(script: str, flags, tmp_path, nproc: int = 1) -> None:
    trigger = tmp_path / "fault"
    env = {**os.environ, **CHILD_ENV, "ACCELRL_FAULT": str(trigger)}
    launcher = [sys.executable] + (["-m", "torch.distributed.run", "--standalone",
                                    f"--nproc_per_node={nproc}"] if nproc > 1 else [])
    shm_before = _shm()
    proc = subprocess.Popen(launcher + [str(ROOT / "tests" / "inject_fault.py"),
                                        str(ROOT / "algos" / f"{script}.py"), "--no-cuda", *flags,
                                        "--run-dir", str(tmp_path / "run")],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    try:
        head = []
        for line in proc.stdout:  # until training is under way: a progress line
            head.append(line)
            if line.startswith("step"):
                break
        family = _family(proc.pid)
        trigger.touch()
        out = "".join(head) + proc.communicate(timeout=120)[0]
    finally:
        for pid in [proc.pid, *(_family(proc.pid) if proc.poll() is None else [])]:
            try:
                os.kill(pid, 9)
            except ProcessLookupError:
                pass
    assert proc.returncode not in (0, None), out
    assert "Traceback" in out and "RuntimeError: fault injected into the learner" in out, out
    assert not _left(family)
    assert not _shm_left(shm_before)


def test_dqn_async_sampling(tmp_path):
    fault_in_the_learner("dqn_multigpu", (*Q_LEARNING, "--async-sampling"), tmp_path)


def test_c51_async_sampling(tmp_path):
    fault_in_the_learner("cat_dqn", (*Q_LEARNING, "--async-sampling"), tmp_path)


def test_appo(tmp_path):
    fault_in_the_learner("appo_async", PPO, tmp_path)


@pytest.mark.slow
def test_asynchronous_dqn_with_async_sampling_on_two_ranks(tmp_path):
    fault_in_the_learner("dqn_multigpu", (*Q_LEARNING, "--asynchronous", "--async-sampling"),
                         tmp_path, nproc=2)


@pytest.mark.slow
def test_a3c_on_two_ranks(tmp_path):
    fault_in_the_learner("a2c_multigpu", (*CATCH, "--asynchronous"), tmp_path, nproc=2)
