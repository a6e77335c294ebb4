"""Faults in the asynchronous machinery that must neither hang a learner nor leave shared memory
behind (a delay injected in a copy of the code reproduced each): a sampler that dies holding the
parameter lock, a rank that dies while the central state is being set up, and the files of a
creator that was killed outright."""

import os
import subprocess
import sys
from functools import partial
from types import SimpleNamespace

import pytest
import torch
import torch.nn as nn

from common import central_optim, dist
from common.run import StopRequest
from common.async_sampler import AsyncSampler, SamplerDied
from tests.conftest import ROOT, run_two_ranks


def _policy(model, obs, cols):
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
    StopRequest(SimpleNamespace(checkpoint_minutes=0.0))
    make = partial(central_optim.CentralOptimizer, nn.Linear(3, 3).parameters(), 2, folder=folder)
    central_optim.shared(make, world)  # its collective fails: the rank leaves through os._exit


def test_a_rank_dying_while_the_central_state_is_set_up_leaves_no_file(tmp_path):
    with pytest.raises(torch.multiprocessing.ProcessExitedException):  # both ranks end non-zero
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



def test_every_asynchronous_mode_refuses_a_second_machine(monkeypatch, capsys):
    """The central state lives in one machine's shared memory: a launch whose ranks are not all
    on this machine (LOCAL_WORLD_SIZE below WORLD_SIZE) is refused with one line, by the one
    check that A3C, APPO and asynchronous DQN call."""
    for script in ("a2c_multigpu", "appo_async", "dqn_multigpu"):
        assert "central_optim.check(args, world" in (ROOT / "algos" / f"{script}.py").read_text()
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    for kwargs, instead in (({}, "drop --asynchronous"),
                            ({"instead": "use ppo_multigpu.py"}, "use ppo_multigpu.py")):
        with pytest.raises(SystemExit) as e:
            central_optim.check(SimpleNamespace(num_chunks=3), SimpleNamespace(world_size=16),
                                **kwargs)
        err = capsys.readouterr().err
        assert e.value.code == 2 and err.count("\n") == 1, err
        assert "runs on one machine" in err and err.strip().endswith(instead)


def test_a_dead_peer_ends_the_rank_with_one_line_naming_it(tmp_path):
    """Asynchronous ranks meet only at the logging cadence; each iteration they look whether
    another rank of the machine has died (ended, or a zombie torchrun has not reaped yet) and end
    with one line naming it, after the exit clean-ups, instead of running on until torchrun's
    SIGKILL. A live peer changes nothing."""
    dead = subprocess.Popen(["true"])
    dead.wait()  # reaped: its pid names no process
    zombie = subprocess.Popen(["true"])  # never waited for here: a zombie once it ends
    code = f"""if True:
        import torch
        from common import central_optim, dist
        from pathlib import Path
        c = central_optim.CentralOptimizer([torch.zeros(3)], 1, folder=Path({str(tmp_path)!r}))
        dist.on_exit(lambda: print("clean-up ran", flush=True))
        c.peers = {{1: {os.getpid()}}}
        c.check_peers()
        print("live peer: went on", flush=True)
        c.peers = {{1: {zombie.pid}, 2: {dead.pid}}}
        import time; time.sleep(0.5)
        c.check_peers()
        print("not reached")
        """
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), "RANK": "0"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                         timeout=120)
    zombie.wait()
    assert out.returncode == 1, out.stderr
    assert out.stdout == "live peer: went on\nclean-up ran\n"
    assert out.stderr == (f"error: rank 0: rank 1 (pid {zombie.pid}) died; ending this rank so "
                          "torchrun can stop or restart the group\n")


def test_a_failed_meeting_names_the_dead_peer_not_the_socket(tmp_path):
    """When a peer is killed just as the asynchronous ranks meet, the collective fails first
    (gloo: "Connection reset by peer"); the rank still ends with the one line naming the dead
    rank. A failed collective with every peer alive keeps gloo's reason and the timeout."""
    dead = subprocess.Popen(["true"])
    dead.wait()
    code = f"""if True:
        import sys, torch
        from common import central_optim, dist
        from pathlib import Path
        c = central_optim.CentralOptimizer([torch.zeros(3)], 1, folder=Path({str(tmp_path)!r}))
        @dist._guarded
        def all_reduce_mean():
            raise RuntimeError("Connection reset by peer")
        dist.name_dead_peer = c.check_peers
        c.peers = {{1: {os.getpid()}}}
        if sys.argv[1] == "dead":
            c.peers = {{1: {dead.pid}}}
        all_reduce_mean()
        """
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), "RANK": "0"}
    for case, expected in (("dead", f"error: rank 0: rank 1 (pid {dead.pid}) died; "),
                           ("alive", "error: rank 0: all_reduce_mean failed: Connection reset "
                                     "by peer. Another rank died or made no progress")):
        out = subprocess.run([sys.executable, "-c", code, case], capture_output=True, text=True,
                             env=env, timeout=120)
        assert out.returncode == 1 and out.stderr.count("\n") == 1, out.stderr
        assert out.stderr.startswith(expected), out.stderr
