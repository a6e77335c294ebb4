"""Sampling into the DQN family's replay (common/replay_feed.py), synchronous and with a sampler
process (--async-sampling): the same transitions and last observations of truncated episodes in
the replay either way, per-environment epsilons carried to the sampler process, a one-rank run on
Catch (update count, replay ratio, learning, resume), C51's mode, faults and signals."""

from functools import partial
from types import SimpleNamespace

import pytest
import torch
import torch.nn as nn

from common import envs
from common.async_sampler import AsyncSampler
from common.exploration import Explorer, act
from common.replay import Replay
from common import replay_feed
from common.sampler import Sampler
from tests.conftest import expect_error, read_summary, run_script
from tests.test_appo import _shm, _shm_left, interrupt_a_sampling_run, kill_a_sampler
from tests.test_dqn import CATCH, _scalars

CPU = torch.device("cpu")
TRUNCATING = "tests.catch_env:CatchTruncated-v0"  # cut after 3 steps, before the ball lands


class Follow(nn.Module):
    """Q values that follow Catch's ball (the best action scores 1, the others 0): a greedy
    policy whose actions depend on what it sees, with a parameter for publish to carry."""

    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(()))

    def forward(self, obs: torch.Tensor) -> torch.Tensor:
        frame = obs[:, -1]  # [n, 84, 84]: ball 255, paddle 128 on the bottom row of cells
        ball = (frame == 255).any(1).float().argmax(1)  # first pixel column of the ball
        paddle = (frame == 128).any(1).float().argmax(1)
        action = torch.where(ball == paddle, 0, torch.where(ball < paddle, 1, 2))
        return self.scale * nn.functional.one_hot(action, 3).float()


class Greedy0(nn.Module):
    """Action 0 is always greedy."""

    def __init__(self):
        super().__init__()
        self.bias = nn.Parameter(torch.tensor([1.0, 0.0, 0.0]))

    def forward(self, obs: torch.Tensor) -> torch.Tensor:
        return self.bias.expand(len(obs), 3)


def test_the_sampler_process_hands_over_the_last_observations_the_hook_records():
    T, B = 9, 2
    seeds = envs.env_seeds(0, 0, B)
    sync = Sampler(envs.make_envs(TRUNCATING, B), T, CPU)
    sync.reset(seeds)
    seen = []
    zeros = lambda obs, cols: (torch.zeros(len(obs), dtype=torch.long), {})  # noqa: E731
    expected = sync.collect(zeros, lambda obs: seen.append(obs.clone()) or torch.zeros(len(obs)))
    expected_truncated = expected["truncated"].clone()
    for e in sync.envs:
        e.close()
    model = Greedy0()
    sampler = AsyncSampler(Greedy0, _zero_policy, None, {"env_id": TRUNCATING, "num_envs": B}, T,
                           seeds, model, CPU, final_obs=True)
    try:
        i, _ = sampler.get()
        rollout = sampler.rollout(i)
        truncated = rollout["truncated"]
        assert torch.equal(truncated, expected_truncated) and truncated.sum() == 6  # 3 per env
        k = int(truncated.sum())
        assert torch.equal(rollout["final_obs"][:k], torch.cat(seen))
        assert torch.equal(rollout["obs"], expected["obs"])
    finally:
        sampler.close()


def _zero_policy(model, obs, cols):
    return torch.zeros(len(obs), dtype=torch.long), {}


@pytest.mark.parametrize("groups", [1, 2])
def test_columns_with_epsilon_0_and_1_act_greedy_and_uniform_in_the_sampler_process(groups):
    """The epsilons travel with the parameters: published as [0, 0, 1, 1], the sampler process's
    columns 0-1 take the greedy action and 2-3 all three, plain and alternating."""
    torch.manual_seed(0)
    explorer = Explorer(Greedy0(), 4)  # starts with epsilon 1 everywhere
    sampler = AsyncSampler(partial(_explorer, Greedy0), act, None,
                           {"env_id": "tests.catch_env:Catch-v0", "num_envs": 4,
                            "groups": groups}, 32, envs.env_seeds(0, 0, 4), explorer, CPU)
    try:
        explorer.eps.copy_(torch.tensor([0.0, 0.0, 1.0, 1.0]))
        sampler.publish(explorer, 1)
        for _ in range(10):  # the first rollouts may predate the publish
            i, info = sampler.get()
            actions = sampler.rollout(i)["actions"].clone()
            sampler.release(i)
            if info["version"] == 1:
                break
        assert info["version"] == 1
        assert (actions[:, :2] == 0).all()
        assert set(actions[:, 2:].flatten().tolist()) == {0, 1, 2}
    finally:
        sampler.close()


def _explorer(make_net):
    return Explorer(make_net(), 4)


def _feed_args(**kw):
    return SimpleNamespace(**{**dict(
        env_id=TRUNCATING, num_envs=4, num_steps=9, seed=3, alternate=False, episodic_life=True,
        sticky_actions=False, fire_reset=True, clip_rewards=True, compile=False,
        async_sampling=False, num_buffers=2, eps_schedule="linear", eps_start=0.0, eps_end=0.0,
        learning_starts=0, eps_decay_steps=1), **kw})


@pytest.mark.parametrize("alternate", [False, True])
def test_both_modes_put_the_same_transitions_in_the_replay(alternate):
    """A greedy policy that follows the ball, on the game that truncates every third step: three
    rollouts through the sampler process leave the replay exactly as three synchronous ones do,
    the truncated episodes' last frames included."""
    world = SimpleNamespace(rank=0, world_size=1, device=CPU)
    phases = SimpleNamespace(add=lambda *a: None)
    replays = []
    for asynchronous in (False, True):
        args = _feed_args(async_sampling=asynchronous, alternate=alternate)
        feed = replay_feed.make(args, world, Follow(), Follow, "forward", 0, [])
        replay = Replay(400, 4, CPU, n_step=3)
        try:
            for _ in range(3):
                feed.collect(torch.zeros(4), replay, phases)
                feed.publish()
            episodes = feed.pop_episodes()
        finally:
            feed.close()
        assert episodes == [(0.0, 3)] * 36  # 3 rollouts x 9 steps / 3 x 4 envs, all cut
        replays.append(replay.state_dict())
    sync, asyn = replays
    assert sync.keys() == asyn.keys()
    for k in sync:
        assert torch.equal(torch.as_tensor(sync[k]), torch.as_tensor(asyn[k])), k
    assert (sync["final_idx"] >= 0).sum() == 3 * 3 * 4  # a truncation every 3rd step, each env


@pytest.mark.parametrize("asynchronous", [False, True])
def test_collect_returns_the_epsilons_the_rollout_acted_with(asynchronous):
    """Action 0 is greedy; epsilons 0 and 1 alternate from one iteration to the next. What collect
    returns (what charts/epsilon logs) is what the rollout acted with: 0 where every action is
    0, 1 where the actions are uniform. With a sampler process that is an older iteration's."""
    world = SimpleNamespace(rank=0, world_size=1, device=CPU)
    phases = SimpleNamespace(add=lambda *a: None)
    added = []
    replay = SimpleNamespace(device=CPU,
                             add=lambda obs, actions, *rest: added.append(actions.clone()))
    feed = replay_feed.make(_feed_args(async_sampling=asynchronous,
                                       env_id="tests.catch_env:Catch-v0"),
                            world, Greedy0(), Greedy0, "forward", 0, [])
    acted = []
    try:
        for k in range(8):
            acted.append(feed.collect(torch.full((4,), float(k % 2)), replay, phases).clone())
            feed.publish()
    finally:
        feed.close()
    for eps, actions in zip(acted, added):
        assert eps.unique().tolist() in ([0.0], [1.0])
        assert (actions != 0).any() == (eps[0] == 1.0), (eps, actions)
    this_iteration = [k % 2 == int(eps[0]) for k, eps in enumerate(acted)]
    # asynchronous: the first rollouts act with the initial epsilons (0 here), later ones lag
    assert all(this_iteration) != asynchronous, acted


@pytest.mark.slow
def test_async_sampling_learns_catch_keeps_the_replay_ratio_and_resumes(tmp_path):
    """dqn_multigpu.py --async-sampling on one rank with the synchronous Catch test's flags, for
    16,000 steps: the same 970 updates as the synchronous mode (the ratio is exact by
    construction), charts/replay_ratio at --replay-ratio, and it learns. Seeds 1, 2, 3 on the
    2-core CPU here: 0.98, 1.00, 0.98 over the last 100 games (synchronous: 0.98, 0.96, 1.00),
    every ball of the final evaluation caught; a random policy scores about -0.7. Resumed with
    its replay to a larger budget, it learns on at once."""
    run, shm_before = tmp_path / "run", _shm()
    run_script("dqn_multigpu", *CATCH, "--async-sampling", "--seed", "1", "--save-replay",
               "--total-timesteps", "16000", "--run-dir", str(run), timeout=900)
    s = read_summary(run)
    assert s["global_step"] == 16000 and s["updates"] == 970 and s["args"]["async_sampling"]
    assert set(s["phase_seconds"]) >= {"env", "inference", "learn", "sampler_wait",
                                       "learner_wait"}
    assert _scalars(run, "charts/replay_ratio")[-1] == (16000, pytest.approx(4.0, rel=0.05))
    assert s["mean_return_last100"] > 0.8 and s["eval_return"] > 0.5
    run_script("dqn_multigpu", "--resume", str(run), "--total-timesteps", "16640",
               "--eval-episodes", "0")
    s = read_summary(run)
    assert s["global_step"] == 16640 and s["updates"] == 970 + 40  # 640 steps x 4 / 64
    assert _scalars(run, "charts/replay_ratio")[-1] == (16640, pytest.approx(4.0, rel=0.05))
    assert not _shm_left(shm_before)


def test_c51_async_sampling_on_two_ranks_takes_the_updates_the_ratio_asks_for(tmp_path):
    """Synchronous data-parallel C51 with a sampler process per rank (and the alternating
    sampler): 2 ranks x 4 envs x 8 steps = 64 steps an iteration, 2 x 64 / (32 x 2) = 2 updates
    an iteration from step 64, all ranks taking the same updates on averaged gradients."""
    run = tmp_path / "run"
    run_script("cat_dqn", "--env-id", TRUNCATING, "--num-envs", "4", "--num-steps", "8",
               "--replay-size", "8000", "--learning-starts", "64", "--batch-size", "32",
               "--replay-ratio", "2", "--total-timesteps", "640", "--eval-episodes", "0",
               "--async-sampling", "--alternate", "--run-dir", str(run), nproc=2)
    s = read_summary(run)
    assert s["global_step"] == 640 and s["world_size"] == 2 and s["updates"] == 10 * 2
    assert _scalars(run, "charts/replay_ratio")[-1] == (640, pytest.approx(2.0))


LONG_RUN = ("--env-id", "tests.catch_env:Catch-v0", "--num-envs", "4", "--replay-size", "4000",
            "--learning-starts", "64", "--batch-size", "16", "--replay-ratio", "1",
            "--total-timesteps", "10000000",
            "--async-sampling", "--eval-episodes", "0")


@pytest.mark.slow
def test_killed_sampler_ends_the_run_with_one_line_and_leaves_nothing(tmp_path):
    """Asynchronous DQN on two ranks, each with a sampler process (APPO's fault test)."""
    kill_a_sampler("dqn_multigpu", (*LONG_RUN, "--asynchronous"), tmp_path)


def test_sigint_checkpoints_and_leaves_no_process(tmp_path):
    interrupt_a_sampling_run("dqn_multigpu", LONG_RUN, tmp_path)


def test_bad_inputs_give_one_clear_line(tmp_path):
    run = str(tmp_path / "new")
    for script in ("dqn_multigpu", "cat_dqn"):
        assert "--num-buffers must be >= 2, got 1" in expect_error(
            script, "--async-sampling", "--num-buffers", "1", "--run-dir", run)
        assert "--sampler-cores pins the sampler process of --async-sampling" in expect_error(
            script, "--sampler-cores", "0", "--run-dir", run)
    assert "are not all among the cores" in expect_error(
        "dqn_multigpu", "--async-sampling", "--sampler-cores", "4096", "--run-dir", run)
    assert not (tmp_path / "new").exists()
