"""Scores a user can trust: the evaluation protocol (common/evaluation.py) and the DQN family's
exploration schedule (common/exploration.py)."""

import gymnasium as gym
import numpy as np
import pytest
import torch

from common import envs, evaluation, exploration


class LongGame(gym.Env):
    """A game whose score is its length: 1 point per step, and it ends after a random number of
    steps (1 to 60). Long games are the high-scoring ones, as in real Atari play."""

    def __init__(self):
        self.observation_space = gym.spaces.Box(0, 255, (4, 84, 84), np.uint8)
        self.action_space = gym.spaces.Discrete(2)

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.left = int(self.np_random.integers(1, 61))
        return np.zeros((4, 84, 84), np.uint8), {}

    def step(self, action):
        self.left -= 1
        return np.zeros((4, 84, 84), np.uint8), 1.0, self.left == 0, False, {}


gym.register("LongGame-v0", entry_point=LongGame)
ID = "tests.test_scores:LongGame-v0"


def _noop(obs):
    return torch.zeros(len(obs), dtype=torch.long)


def _reference_games(seed: int, games: int, cap: int) -> list[float]:
    """The games one environment plays in order from `seed`, each cut at `cap`."""
    env = gym.make(ID, max_episode_steps=cap)
    out, first = [], True
    while len(out) < games:
        env.reset(seed=int(seed) if first else None)
        first, score, done = False, 0.0, False
        while not done:
            _, r, term, trunc, _ = env.step(0)
            score += r
            done = term or trunc
        out.append(score)
    return out


def test_each_environment_plays_its_games_in_order_and_cut_games_count():
    """env j plays games j, j + n, ...: exactly the games a single environment with env j's seed
    plays first, cut ones (at the cap) included with their score so far."""
    cap, n, episodes = 40, 3, 10
    env = envs.make_envs(ID, n, max_episode_steps=cap)[0]
    seeds = envs.env_seeds(7, 0, n)
    returns, lengths = evaluation.play(_noop, env, episodes, seeds, torch.device("cpu"))
    env.close()
    quota = [4, 3, 3]
    ref = [_reference_games(seeds[j], quota[j], cap) for j in range(n)]
    want = [ref[j][k] for k in range(4) for j in range(n) if k < quota[j]]
    assert returns == want and lengths == [int(r) for r in want]
    assert max(lengths) == cap and cap in lengths  # some games were cut, exactly at the cap


def test_evaluation_is_unbiased_when_long_games_score_high():
    """True mean of min(L, cap) for L uniform on 1..60 and cap 40: (sum 1..40 + 20 x 40) / 60 =
    27. 100 evaluations of 4 games on 8 environments: ours plays games fixed in advance (one on
    each of envs 0-3); the old protocol kept the first 4 games to finish, the short ones."""
    cap, true_mean = 40, (sum(range(1, 41)) + 20 * 40) / 60
    env = envs.make_envs(ID, 8, max_episode_steps=cap)[0]
    ours, old = [], []
    for rep in range(100):
        seeds = envs.env_seeds(3, 0, 8, offset=rep)
        ours += evaluation.play(_noop, env, 4, seeds, torch.device("cpu"))[0]
        env.reset(seeds)
        env.episodes.clear()
        while len(env.episodes) < 4:
            env.send(np.zeros(8, np.int64))
            env.recv()
        old += [r for r, _ in env.episodes[:4]]
    env.close()
    assert len(ours) == 400
    assert np.mean(ours) == pytest.approx(true_mean, abs=2.0)  # 3 standard errors
    assert np.mean(old) < true_mean - 8  # the bias the old protocol had


def test_a_strong_agent_whose_games_outlast_the_cap_still_gets_a_score():
    cap = 5
    env = envs.make_envs(ID, 2, max_episode_steps=cap)[0]
    returns, lengths = evaluation.play(_noop, env, 4, envs.env_seeds(1, 0, 2),
                                       torch.device("cpu"))
    env.close()
    assert len(returns) == 4 and max(returns) <= cap and lengths.count(cap) >= 2


class _Args:
    eps_schedule, num_envs, eps_start, eps_end = "linear", 2, 1.0, 0.1
    eps_decay_steps, learning_starts = 1000, 500


def test_epsilon_decays_only_after_learning_starts():
    """Dopamine / DeepMind DQN: eps_start through the warm-up, then the linear decay."""
    for step, e in ((0, 1.0), (499, 1.0), (500, 1.0), (1000, 0.55), (1500, 0.1), (10**6, 0.1)):
        assert exploration.epsilons(_Args, step, 0, 1).tolist() == pytest.approx([e, e]), step


def test_epsilon_is_a_function_of_the_global_step_only():
    """A resume (on any world size, with or without the replay refilling, which moves the start
    of learning but not the schedule) continues the schedule where it stopped."""
    for ranks in (1, 2, 4):
        assert exploration.epsilons(_Args, 800, ranks - 1, ranks).tolist() == \
            pytest.approx([0.73, 0.73])
