"""Environment layer: id parsing, the observation contract, and true episode statistics."""

import numpy as np
import pytest
import torch
from ale_py.vector_env import AtariVectorEnv

from common import envs
from common.sampler import Sampler


@pytest.mark.parametrize("env_id", ["Pong-v5", "ALE/Pong-v5", "PongNoFrameskip-v4", "Pong-v4"])
def test_atari_ids_as_gymnasium_spells_them(env_id):
    assert envs.ale_game(env_id) == "pong"


def test_ids_that_are_not_atari():
    assert envs.ale_game("MsPacman-v5") == "ms_pacman"
    assert envs.ale_game("CartPole-v1") is None
    assert envs.ale_game("tests.catch_env:Catch-v0") is None
    with pytest.raises(envs.EnvError, match="unknown Atari game 'Foo-v5'.*get_all_rom_ids"):
        envs.ale_game("Foo-v5")


def test_observation_contract_is_checked():
    with pytest.raises(envs.EnvError, match=r"uint8 \(4, 84, 84\) observations"):
        envs.make_envs("CartPole-v1", 2)


def test_seeds_are_distinct_and_repeatable():
    a = envs.env_seeds(1, 0, 8)
    assert len(set(a.tolist())) == 8
    np.testing.assert_array_equal(a, envs.env_seeds(1, 0, 8))
    assert not set(a.tolist()) & set(envs.env_seeds(1, 1, 8).tolist())  # other rank
    assert not set(a.tolist()) & set(envs.env_seeds(2, 0, 8).tolist())  # other seed
    assert not set(a.tolist()) & set(envs.env_seeds(1, 0, 8, offset=5).tolist())  # resumed


def test_true_game_score_with_episodic_lives_and_reward_clipping():
    """Space Invaders: 3 lives, rewards 5 to 200. The learner sees sign-clipped rewards and an
    episode end at every life loss; the statistics must report whole games with raw scores,
    exactly as a plain emulator run with the same seeds and actions counts them."""
    n, T = 4, 1200
    seeds = envs.env_seeds(0, 0, n)
    actions = np.random.default_rng(0).integers(0, 6, size=(T, n))
    step = iter(range(T))

    def policy(obs, cols):
        return torch.from_numpy(actions[next(step)]), {}

    sampler = Sampler(envs.make_envs("SpaceInvaders-v5", n, episodic_life=True), T,
                      torch.device("cpu"), clip_rewards=True)
    sampler.reset(seeds)
    rollout = sampler.collect(policy)
    episodes = sampler.pop_episodes()

    # reference: the raw vector env, no life-loss signal, no clipping, same seeds and actions
    ref = AtariVectorEnv("space_invaders", n, episodic_life=False, life_loss_info=False,
                         reward_clipping=False, autoreset_mode="SameStep", num_threads=1)
    ref.reset(seed=seeds)
    ret, length, ref_episodes = np.zeros(n), np.zeros(n, int), []
    for t in range(T):
        _, r, term, trunc, _ = ref.step(actions[t])
        ret += r
        length += 1
        for i in np.flatnonzero(term | trunc):
            ref_episodes.append((float(ret[i]), int(length[i])))
            ret[i], length[i] = 0, 0
    ref.close()

    assert len(ref_episodes) >= 3, "budget too small to finish games"
    assert sorted(episodes) == sorted(ref_episodes)
    lives_lost = rollout["terminated"].sum().item()
    assert lives_lost >= 3 * len(episodes)  # the learner's episodes ended at every life loss
    assert set(rollout["rewards"].unique().tolist()) <= {-1.0, 0.0, 1.0}  # clipped for learning
    assert max(r for r, _ in episodes) > 100  # raw scores: far above any clipped sum here


@pytest.mark.parametrize("fire_reset", [True, False])
def test_fire_after_a_lost_life_lets_a_noop_policy_finish_breakout(fire_reset):
    """Breakout serves the ball only on FIRE. With fire_reset (the default) the environment
    presses it at the start and after every lost life, so NOOPs alone lose all 5 lives and end
    the game; without it the ball is never served and the game never ends."""
    env = envs.make_envs("Breakout-v5", 1, fire_reset=fire_reset)[0]
    env.reset(envs.env_seeds(0, 0, 1))
    lives_seen, steps = set(), 0
    while not env.episodes and steps < 3000:
        env.send(np.zeros(1, np.int64))
        env.recv()
        lives_seen.add(int(env._lives[0]))
        steps += 1
    env.close()
    if fire_reset:
        assert len(env.episodes) == 1 and {1, 2, 3, 4} <= lives_seen, (steps, lives_seen)
    else:
        assert not env.episodes and lives_seen == {5}


def test_a_game_is_cut_exactly_at_max_episode_steps():
    """Atari: 4 x max_episode_steps emulator frames; here a NOOP Breakout game never ends, so
    every game is cut at exactly the cap (and counted as a game)."""
    env = envs.make_envs("Breakout-v5", 2, fire_reset=False, max_episode_steps=50)[0]
    env.reset(envs.env_seeds(0, 0, 2))
    for _ in range(120):
        env.send(np.zeros(2, np.int64))
        *_, truncated, _ = env.recv()
    env.close()
    assert [length for _, length in env.episodes] == [50, 50, 50, 50]
