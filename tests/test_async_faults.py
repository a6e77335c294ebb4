"""Faults in the asynchronous machinery that must neither hang a learner nor leave shared memory
behind (a delay injected in a copy of the code reproduced each): a sampler that dies holding the
parameter lock, a rank that dies while the central state is being set up, and the files of a
creator that was killed outright."""

import os
import subprocess
import sys
from functools import partial

import pytest
import torch
import torch.nn as nn

from common import central_optim, checkpoint, dist
from common.async_sampler import AsyncSampler, SamplerDied
from tests.conftest import run_two_ranks


def _policy(model, obs):
    return torch.zeros(len(obs), dtype=torch.long), {}


def test_a_sampler_that_dies_holding_the_parameter_lock_ends_publish():
    model = nn.Linear(2, 2)
    kwargs = dict(env_id="tests.catch_env:Catch-v0", num_envs=2)
    sampler = AsyncSampler(partial(nn.Linear, 2, 2), _policy, None, kwargs, 4,
                           [1, 2], model, torch.device("cpu"))
    try:
        sampler.get()  # it runs
        assert sampler.lock.acquire(timeout=60)  # as the sampler holds it while it copies in
        sampler.proc.kill()  # ... and dies there: the lock is never released
        sampler.proc.join()
        with pytest.raises(SamplerDied, match="killed by SIGKILL"):
            sampler.publish(model, 1)  # before the fix: blocked on a futex for good
    finally:
        sampler.close()


def _set_up_then_lose_a_rank(rank, folder):
    dist.setup(cuda=False, timeout=60)
    if rank == 1:
        os._exit(3)  # dies before attaching to the central state
    world = dist.World(0, 0, 2, torch.device("cpu"))
    # As in appo_async.py: SIGTERM (what torchrun, and mp.spawn here, send the other ranks when
    # one fails) only sets a flag, so this rank reaches the failing collective and its clean-up.
    checkpoint.StopRequest()
    make = partial(central_optim.CentralOptimizer, nn.Linear(3, 3).parameters(), 2, folder=folder)
    central_optim.shared(make, world)  # its collective fails: the rank leaves through os._exit


def test_a_rank_dying_while_the_central_state_is_set_up_leaves_no_file(tmp_path):
    with pytest.raises(Exception):  # both ranks end non-zero
        run_two_ranks(_set_up_then_lose_a_rank, tmp_path)
    assert list(tmp_path.iterdir()) == []  # rank 0 unlinked its files on its way out


def test_files_of_a_creator_that_was_killed_are_removed_by_the_next(tmp_path):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = tmp_path / f"accelrl-{dead.pid}-0123abcd.c0"
    live = tmp_path / f"accelrl-{os.getpid()}-4567ef01.c0"
    stale.write_bytes(b"x")
    live.write_bytes(b"x")
    central = central_optim.CentralOptimizer(nn.Linear(3, 3).parameters(), 2, folder=tmp_path)
    try:
        assert not stale.exists() and live.exists()
        assert central.name.startswith(f"accelrl-{os.getpid()}-")
    finally:
        central.unlink()
        central.close()
