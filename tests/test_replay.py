"""common/replay.py: rebuilt stacks against the environments' own observations, n-step returns
against brute force across terminations and truncations, prioritized sampling frequencies and
importance weights, and a saved shard that resumes."""

import numpy as np
import pytest
import torch

from common import envs
from common.replay import Replay, SumTree
from common.sampler import Sampler

CPU = torch.device("cpu")


def sampled_steps(replay, idx):
    """Absolute step numbers and columns of sampled flat indices (rows are steps mod T)."""
    lo, hi = replay._valid()
    rows, cols = idx // replay.B, idx % replay.B
    steps = lo + (rows - lo) % replay.T
    assert (steps <= hi).all()
    return steps, cols


@pytest.mark.parametrize("env_id", ["tests.catch_env:Catch-v0", "Breakout-v5"])
def test_rebuilt_stacks_equal_the_observations_the_agent_saw(env_id):
    """Catch pads a new episode's stack with copies of its first frame, ALE with zeros; on
    Breakout, a lost life ends the learner's episode while the stack runs on. The buffer (30
    rows per env) wraps around several times."""
    B, R = 3, 8
    sampler = Sampler(envs.make_envs(env_id, B, num_threads=1), R, CPU)
    sampler.reset(envs.env_seeds(0, 0, B))
    replay = Replay(30 * B, B, CPU, n_step=3)
    seen = {}  # step -> obs [B, 4, 84, 84]
    g = torch.Generator().manual_seed(0)
    starts = 0
    for i in range(40):
        buf = sampler.collect(lambda o, cols: (torch.randint(0, 4 if "Breakout" in env_id else 3,
                                                       (len(o),), generator=g), {}))
        replay.add(buf["obs"], buf["actions"], buf["rewards"], buf["terminated"],
                   buf["truncated"], sampler.next_obs, None)
        for t in range(R):
            seen[i * R + t] = buf["obs"][t].clone()
        seen[(i + 1) * R] = sampler.next_obs.clone()
        starts += int(buf["terminated"].sum())
    lo, hi = replay._valid()
    assert replay.steps == 320 and lo == 320 - 29 + 3 and hi == 320 - 3  # wrapped, history lost
    steps = torch.arange(lo, hi + 4)  # every sampleable step, and the newer ones up to pending
    for b in range(B):
        rebuilt = replay._stack(steps % replay.T, torch.full_like(steps, b))
        want = torch.stack([seen[int(s)][b] for s in steps])
        assert torch.equal(rebuilt, want)
    assert starts > 5  # episode starts inside the checked window are what this test is about


def synthetic_stream(B, steps, seed, p_term=0.12, p_trunc=0.08):
    """An ALE-like stream: distinct random frames, zero-padded stacks at each episode start,
    random terminations and truncations, and the true last observation of truncated episodes.
    Returns per-step lists and per-column reference arrays."""
    rng = np.random.default_rng(seed)
    frames = rng.integers(0, 256, (steps + 1, B, 84, 84), dtype=np.uint8)
    finals = rng.integers(0, 256, (steps, B, 84, 84), dtype=np.uint8)
    term = rng.random((steps, B)) < p_term
    trunc = (rng.random((steps, B)) < p_trunc) & ~term
    rewards = rng.normal(size=(steps, B)).astype(np.float32)
    obs = np.zeros((steps + 1, B, 4, 84, 84), np.uint8)
    final_obs = np.zeros((steps, B, 4, 84, 84), np.uint8)
    for b in range(B):
        stack = np.zeros((4, 84, 84), np.uint8)
        for t in range(steps + 1):
            if t == 0 or term[t - 1, b] or trunc[t - 1, b]:
                stack = np.zeros((4, 84, 84), np.uint8)
            stack = np.concatenate([stack[1:], frames[t, b][None]])
            obs[t, b] = stack
            if t < steps:
                final_obs[t, b] = np.concatenate([stack[1:], finals[t, b][None]])
    return obs, rewards, term, trunc, final_obs


def fill(replay, stream, R):
    obs, rewards, term, trunc, final_obs = (torch.from_numpy(x) for x in stream)
    steps = rewards.shape[0]
    actions = torch.arange(steps * replay.B).view(steps, replay.B) % 7
    for s in range(0, steps, R):
        sl = slice(s, s + R)
        tr = trunc[sl]
        replay.add(obs[sl], actions[sl], rewards[sl], term[sl], tr, obs[s + R],
                   final_obs[sl][tr])
    return actions


def reference(stream, s, b, n, gamma):
    """Brute force: (return, discount, bootstrap observation) of step s in column b."""
    obs, rewards, term, trunc, final_obs = stream
    total = 0.0
    for k in range(n):
        total += gamma ** k * float(rewards[s + k, b])
        if term[s + k, b]:
            return total, 0.0, None, "term"
        if trunc[s + k, b]:
            return total, gamma ** (k + 1), final_obs[s + k, b], "trunc"
    return total, gamma ** n, obs[s + n, b], "full"


@pytest.mark.parametrize("n,gamma", [(1, 0.99), (3, 0.9), (5, 0.5)])
def test_nstep_returns_and_bootstraps_match_brute_force(n, gamma):
    B, R, steps = 4, 5, 200
    stream = synthetic_stream(B, steps, seed=n)
    torch.manual_seed(n)
    replay = Replay(48 * B, B, CPU, n_step=n, gamma=gamma)  # 48 rows: wraps four times
    actions = fill(replay, stream, R)
    batch = replay.sample(2000)
    s, c = sampled_steps(replay, batch["indices"])
    assert len(set(s.tolist())) > 30
    kinds = {"term": 0, "trunc": 0, "full": 0}
    for i in range(len(s)):
        ret, disc, boot, kind = reference(stream, int(s[i]), int(c[i]), n, gamma)
        assert batch["returns"][i].item() == pytest.approx(ret, rel=1e-5, abs=1e-5)
        assert batch["discounts"][i].item() == pytest.approx(disc, rel=1e-6)
        assert torch.equal(batch["obs"][i], torch.from_numpy(stream[0][s[i], c[i]]))
        assert batch["actions"][i] == actions[s[i], c[i]]
        if boot is not None:
            assert torch.equal(batch["next_obs"][i], torch.from_numpy(boot))
        kinds[kind] += 1
    assert min(kinds.values()) > 0, kinds  # all three endings were checked
    assert (batch["weights"] == 1).all()


def test_sum_tree_descends_to_the_right_leaf():
    tree = SumTree(10, CPU)
    p = torch.tensor([0.0, 1.0, 2.0, 0.0, 3.0, 0.5, 0.0, 0.0, 1.5, 2.0], dtype=torch.float64)
    tree.set(torch.arange(10), p)
    assert tree.total().item() == pytest.approx(10.0)
    cum = torch.cumsum(p, 0)
    u = torch.linspace(0, 10 - 1e-9, 997, dtype=torch.float64)
    want = torch.searchsorted(cum, u, right=True)
    assert torch.equal(tree.find(u), want)
    assert (p[tree.find(torch.tensor([0.0, 3.0, 10.0], dtype=torch.float64))] > 0).all()


def test_prioritized_frequencies_follow_priority_alpha_and_weights_their_formula():
    B, alpha, beta = 4, 0.6, 0.4
    stream = synthetic_stream(B, 60, seed=7)
    replay = Replay(40 * B, B, CPU, n_step=3, prioritized=True, alpha=alpha)
    fill(replay, stream, 6)
    lo, hi = replay._valid()
    valid = ((torch.arange(lo, hi + 1) % replay.T)[:, None] * B + torch.arange(B)).flatten()
    g = torch.Generator().manual_seed(0)
    td = torch.rand(len(valid), generator=g) * 4
    td[::5] = 0.0  # a zero TD error still leaves priority_eps
    replay.update_priorities(valid, td)
    prob = (td.double() + replay.priority_eps) ** alpha
    prob /= prob.sum()

    torch.manual_seed(0)
    counts = torch.zeros(replay.T * B)
    draws = 0
    for _ in range(40):
        batch = replay.sample(512, beta=beta)
        counts += torch.bincount(batch["indices"], minlength=replay.T * B).float()
        draws += 512
    assert counts.sum() == counts[valid].sum()  # nothing outside the sampleable rows
    expected = prob * draws
    chi2 = (((counts[valid].double() - expected) ** 2) / expected).sum().item()
    dof = len(valid) - 1  # chi-square, 135 dof: mean 135, sd 16.4; the bound is 7 sd above
    assert chi2 < dof + 7 * (2 * dof) ** 0.5, chi2

    # importance weights: (N * P(i))^-beta, divided by the largest in the batch
    where = torch.full((replay.T * B,), -1)
    where[valid] = torch.arange(len(valid))
    p_i = prob[where[batch["indices"]]]
    w = (len(valid) * p_i) ** -beta
    torch.testing.assert_close(batch["weights"].double(), w / w.max(), rtol=1e-5, atol=1e-7)


def test_new_transitions_get_the_maximum_priority():
    B = 2
    stream = synthetic_stream(B, 40, seed=3)
    replay = Replay(30 * B, B, CPU, n_step=1, prioritized=True, alpha=0.5)
    obs, rewards, term, trunc, final_obs = (torch.from_numpy(x) for x in stream)
    replay.add(obs[:10], rewards[:10].long(), rewards[:10], term[:10], trunc[:10], obs[10],
               final_obs[:10][trunc[:10]])
    replay.update_priorities(torch.tensor([0, 1]), torch.tensor([9.0, 0.0]))
    replay.add(obs[10:20], rewards[10:20].long(), rewards[10:20], term[10:20], trunc[10:20],
               obs[20], final_obs[10:20][trunc[10:20]])
    leaves = replay.tree.tree[replay.tree.leaves:]
    new = leaves[10 * B:20 * B]  # steps 10..19 are now sampleable (n = 1)
    torch.testing.assert_close(new, torch.full_like(new, (9.0 + 1e-6) ** 0.5))
    assert leaves[20 * B:].sum() == 0  # the pending row and empty rows are never sampled


def test_saved_shard_resumes_and_closes_its_open_episodes():
    B, n, gamma = 3, 3, 0.9
    stream = synthetic_stream(B, 60, seed=11, p_term=0.0, p_trunc=0.0)
    replay = Replay(50 * B, B, CPU, n_step=n, gamma=gamma, prioritized=True)
    fill(replay, stream, 6)
    state = {k: (v.clone() if torch.is_tensor(v) else v) for k, v in replay.state_dict().items()}
    fresh = Replay(50 * B, B, CPU, n_step=n, gamma=gamma, prioritized=True)
    fresh.load_state_dict(state)
    assert torch.equal(fresh.frames, replay.frames) and fresh.steps == 60
    # after a resume the games restart: the next rollout begins with reset observations
    new = synthetic_stream(B, 12, seed=12, p_term=0.0, p_trunc=0.0)
    fill(fresh, new, 6)
    obs, rewards = stream[0], stream[1]
    checked = 0
    for _ in range(5):
        batch = fresh.sample(256)
        s, c = sampled_steps(fresh, batch["indices"])
        # 2 steps before the cut: a 2-step return, truncated
        for i in torch.nonzero(s == 58).flatten():
            b = int(c[i])
            want = float(rewards[58, b]) + gamma * float(rewards[59, b])
            assert batch["returns"][i].item() == pytest.approx(want, rel=1e-5)
            assert batch["discounts"][i].item() == pytest.approx(gamma ** 2)
            assert torch.equal(batch["next_obs"][i], torch.from_numpy(obs[60, b]))
            checked += 1
    assert checked > 5
    with pytest.raises(ValueError, match="does not fit"):
        Replay(40 * B, B, CPU, n_step=n, prioritized=True).load_state_dict(state)


def test_bytes_per_transition_at_most_7_1_kb():
    replay = Replay(2 ** 14, 16, CPU, prioritized=True)
    assert replay.bytes_per_transition() <= 7100
    assert Replay(2 ** 14, 16, CPU).bytes_per_transition() == 84 * 84 + 11


@pytest.mark.parametrize("groups", [1, 2])
def test_truncated_episodes_bootstrap_from_the_final_observation_the_sampler_saw(groups):
    """The scripts take final observations through the sampler's value_fn hook, in the order it
    values them; with the alternating sampler too, they must land on the right (step, env)."""
    B, R = 4, 8
    sampler = Sampler(envs.make_envs("tests.catch_env:CatchTruncated-v0", B, groups=groups), R,
                      CPU)
    sampler.reset(envs.env_seeds(0, 0, B))
    replay = Replay(40 * B, B, CPU, n_step=1, gamma=0.9)
    finals, truth = [], {}
    for i in range(4):
        buf = sampler.collect(lambda o, cols: (torch.randint(0, 3, (len(o),)), {}),
                              value_fn=lambda o: finals.append(o) or torch.zeros(len(o)))
        final_obs = torch.cat(finals) if finals else None
        for k, (t, b) in enumerate(buf["truncated"].nonzero().tolist()):
            truth[(i * R + t, b)] = final_obs[k]
        replay.add(buf["obs"], buf["actions"], buf["rewards"], buf["terminated"],
                   buf["truncated"], sampler.next_obs, final_obs)
        finals.clear()
    batch = replay.sample(400)
    s, c = sampled_steps(replay, batch["indices"])
    checked = 0
    for i in range(len(s)):
        if (int(s[i]), int(c[i])) in truth:
            assert torch.equal(batch["next_obs"][i], truth[(int(s[i]), int(c[i]))])
            assert batch["discounts"][i].item() == pytest.approx(0.9)
            checked += 1
    assert checked > 50


def test_the_sync_free_truncation_patch_of_a_gpu_replay_gives_the_same_batch():
    """On a GPU, sample() patches truncated bootstraps by masking every row (asking which rows
    are truncated would wait for the device); it must give exactly the CPU's batch."""
    B, n = 4, 3
    stream = synthetic_stream(B, 200, seed=7)
    replay = Replay(48 * B, B, CPU, n_step=n, gamma=0.9)
    fill(replay, stream, 5)
    batches = []
    for mask_all in (False, True):
        replay.mask_all = mask_all
        torch.manual_seed(0)
        batches.append(replay.sample(2000))
    truncated = batches[0]["discounts"] > 0.9 ** n + 1e-6  # cut before step n: 0.9^(m+1)
    assert truncated.sum() > 20  # cut episodes were sampled
    for k in batches[0]:
        assert torch.equal(batches[0][k], batches[1][k]), k
