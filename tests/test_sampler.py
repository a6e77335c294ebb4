"""The batched-inference sampler: episode boundaries, truncation bootstrap, alternating == plain."""

import pytest
import torch

from common import envs
from common.sampler import Sampler

CPU = torch.device("cpu")


def fixed_policy(net):
    """Deterministic in the observation alone: the same obs gives the same action, whatever the
    batch it arrives in. The value comes from a network, as PPO's does."""
    def policy(obs, cols):
        actions = obs.long().sum(dim=(1, 2, 3)) % 3
        return actions, {"value": net(obs)}
    return policy


def make_net():
    torch.manual_seed(0)
    lin = torch.nn.Linear(4 * 84 * 84, 1)
    return lambda obs: lin(obs.float().flatten(1) / 255).squeeze(-1)


def collect(env_id, num_envs, groups, T, rollouts=3):
    sampler = Sampler(envs.make_envs(env_id, num_envs, groups=groups, num_threads=1), T, CPU,
                      extras=("value",))
    sampler.reset(envs.env_seeds(3, 0, num_envs))
    net = make_net()
    out = []
    for _ in range(rollouts):  # several rollouts: state carries over between them
        buf = sampler.collect(fixed_policy(net), value_fn=net)
        out.append({k: v.clone() for k, v in buf.items()})
    return out, sampler.pop_episodes()


@pytest.mark.parametrize("env_id,T", [("tests.catch_env:Catch-v0", 16), ("Breakout-v5", 64)])
def test_alternating_gives_the_same_rollouts_as_plain(env_id, T):
    plain, plain_eps = collect(env_id, 4, 1, T)
    alt, alt_eps = collect(env_id, 4, 2, T)
    for p, a in zip(plain, alt):
        for k in ("obs", "actions", "rewards", "terminated", "truncated"):
            assert torch.equal(p[k], a[k]), k
        # half-size batches may round differently in the matmul: values agree to float precision
        torch.testing.assert_close(p["value"], a["value"])
    assert sorted(plain_eps) == sorted(alt_eps)
    assert any(p["terminated"].any() for p in plain)  # boundaries were crossed


def test_episode_boundaries_are_same_step():
    """After an episode ends at step t, obs[t + 1] is the first frame of the next episode and no
    transition is wasted on a reset step."""
    T = 20
    sampler = Sampler(envs.make_envs("tests.catch_env:Catch-v0", 2), T, CPU)
    sampler.reset(envs.env_seeds(0, 0, 2))
    buf = sampler.collect(lambda obs, cols: (torch.zeros(len(obs), dtype=torch.long), {}))
    term, obs, rew = buf["terminated"], buf["obs"], buf["rewards"]
    assert torch.equal(term, rew != 0)  # Catch pays only when the ball lands
    for t in range(T):
        for b in range(2):
            first = bool((obs[t, b] == obs[t, b, :1]).all())  # stack of 4 equal frames
            starts = t == 0 or bool(term[t - 1, b])
            assert first == starts, (t, b)
    assert torch.equal(term[:, 0].nonzero().flatten(), torch.tensor([5, 11, 17]))  # 6-step games


def test_truncation_bootstraps_from_the_final_observation():
    T = 9
    sampler = Sampler(envs.make_envs("tests.catch_env:CatchTruncated-v0", 2), T, CPU)
    sampler.reset(envs.env_seeds(0, 0, 2))
    seen = []

    def value_fn(obs):  # records the observations it was asked to value
        seen.append(obs.clone())
        return obs.float().mean(dim=(1, 2, 3))

    buf = sampler.collect(lambda obs, cols: (torch.zeros(len(obs), dtype=torch.long), {}), value_fn)
    trunc = buf["truncated"]
    assert torch.equal(trunc[:, 0].nonzero().flatten(), torch.tensor([2, 5, 8]))
    assert not buf["terminated"].any()
    final = torch.cat(seen)
    # the valued observation is the true last one: ball on row 3, 3 frames after the start
    assert len(final) == 6 and not (final[:, 0] == final[:, 3]).all(dim=(1, 2)).any()
    expected = final.float().mean(dim=(1, 2, 3))
    torch.testing.assert_close(buf["final_values"][trunc], expected)
    assert (buf["final_values"][~trunc] == 0).all()
    # the next stored observation is a fresh episode, not the final one
    assert (buf["obs"][3, 0] == buf["obs"][3, 0, :1]).all()
