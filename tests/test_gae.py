"""GAE against a brute-force reference, with terminations, truncations and bootstrapping."""

import torch


def reference_advantages(r, v, term, trunc, final_v, next_v, gamma, lam):
    """A(t) = sum_k (gamma*lam)^k delta(t+k) until the episode ends, written out per step."""
    T, B = r.shape
    out = torch.zeros(T, B, dtype=torch.float64)
    for b in range(B):
        deltas = []
        for t in range(T):
            if term[t, b]:
                v_next = 0.0
            elif trunc[t, b]:
                v_next = final_v[t, b].item()
            elif t == T - 1:
                v_next = next_v[b].item()
            else:
                v_next = v[t + 1, b].item()
            deltas.append(r[t, b].item() + gamma * v_next - v[t, b].item())
        for t in range(T):
            total, k = 0.0, 0
            while t + k < T:
                total += (gamma * lam) ** k * deltas[t + k]
                if term[t + k, b] or trunc[t + k, b]:
                    break
                k += 1
            out[t, b] = total
    return out


def random_rollout(T, B, seed=0):
    """Random rewards, values and episode ends in a [T, B] rollout, float64 for exact checks."""
    g = torch.Generator().manual_seed(seed)
    r = torch.randn(T, B, generator=g, dtype=torch.float64)
    v = torch.randn(T, B, generator=g, dtype=torch.float64)
    final_v = torch.randn(T, B, generator=g, dtype=torch.float64)
    next_v = torch.randn(B, generator=g, dtype=torch.float64)
    term = torch.rand(T, B, generator=g) < 0.15
    trunc = (torch.rand(T, B, generator=g) < 0.1) & ~term
    term[T - 1, 0] = True  # an episode ending on the last step must not bootstrap
    trunc[T - 1, 1], term[T - 1, 1] = True, False  # truncation on the last step uses final_v
    term[:, 2] = trunc[:, 2] = False  # one column with no episode end: pure bootstrap
    term[3, 3], trunc[3, 3] = True, True  # both flags: a termination wins, no bootstrap
    final_v[~trunc] = 0.0  # as the sampler stores it
    return r, v, term, trunc, final_v, next_v


def test_gae_matches_reference(ppo):
    r, v, term, trunc, final_v, next_v = random_rollout(16, 6)
    for gamma, lam in ((0.99, 0.95), (0.9, 1.0), (0.99, 0.0)):
        got = ppo.gae(r, v, term, trunc, final_v, next_v, gamma, lam)
        want = reference_advantages(r, v, term, trunc, final_v, next_v, gamma, lam)
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)


def test_truncation_bootstraps_and_termination_does_not(ppo):
    # one env, two steps, reward 1 each; values 0 except the bootstraps
    r = torch.ones(2, 1)
    v = torch.zeros(2, 1)
    zero = torch.zeros(2, 1, dtype=torch.bool)
    final_v = torch.tensor([[5.0], [0.0]])
    trunc = torch.tensor([[True], [False]])
    adv = ppo.gae(r, v, zero, trunc, final_v, torch.tensor([7.0]), 0.5, 1.0)
    assert adv[0, 0].item() == 1 + 0.5 * 5  # truncated: bootstrap from the final observation
    assert adv[1, 0].item() == 1 + 0.5 * 7  # next episode: bootstrap from next_value only
    term = trunc.clone()
    adv = ppo.gae(r, v, term, zero, final_v * 0, torch.tensor([7.0]), 0.5, 1.0)
    assert adv[0, 0].item() == 1.0
