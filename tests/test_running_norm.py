"""common/running_norm.py and A2C's, PPO's and APPO's --normalize-input and --normalize-value
(PPO's and APPO's --activation): reference computations, the two-rank equivalence, and a
checkpoint's policy rebuilt by evaluate."""

import numpy as np
import pytest
import torch

from common.running_norm import CLIP, EPS, RunningNorm
from tests.conftest import load_algo, run_two_ranks


def _data(n=90, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 3, 5, generator=g) * torch.arange(1.0, 16.0).reshape(3, 5) + 7.0
    x[:, 0, 0] = 2.5  # an element that never changes
    return x


def test_batches_give_the_moments_of_everything_seen():
    """Three batches of unequal size: the population mean and variance of their concatenation."""
    x = _data()
    norm = RunningNorm((3, 5))
    for part in (x[:7], x[7:50], x[50:]):
        norm.update(part, chunk=16)  # chunks smaller than a batch change nothing
    ref = x.double().numpy()
    np.testing.assert_allclose(norm.mean.numpy(), ref.mean(0), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(norm.var.numpy(), ref.var(0), rtol=1e-5, atol=1e-6)
    assert norm.count.item() == 90


def test_normalised_clipped_and_constant_elements_zero():
    x = _data()
    norm = RunningNorm((3, 5))
    norm.update(x)
    y = torch.randn(4, 3, 5) * 40
    expected = ((y - x.mean(0)) / torch.sqrt(x.var(0, unbiased=False) + EPS)).clamp(-CLIP, CLIP)
    torch.testing.assert_close(norm(y), expected, rtol=1e-4, atol=1e-4)
    assert norm(y).abs().max() <= CLIP and (norm(y).abs() == CLIP).any()  # clipping took effect
    assert torch.equal(norm(x)[:, 0, 0], torch.zeros(90))  # constant: 0, never nan
    torch.testing.assert_close(norm.denormalize(norm(x[:3])), x[:3], rtol=1e-4, atol=1e-4)


def test_uint8_frames_scaled_as_floats():
    g = torch.Generator().manual_seed(1)
    frames = torch.randint(0, 256, (40, 4, 84, 84), generator=g, dtype=torch.uint8)
    a, b = RunningNorm((4, 84, 84)), RunningNorm((4, 84, 84))
    a.update(frames, scale=1 / 255.0, chunk=9)
    b.update(frames.double() / 255.0)
    torch.testing.assert_close(a.mean, b.mean)
    torch.testing.assert_close(a.var, b.var)


def _rank(rank, out_path):
    from common import dist
    world = dist.setup(cuda=False)
    norm = RunningNorm((3, 5))
    x = _data()
    norm.update(x[:40].chunk(2)[rank])
    norm.update(x[40:].chunk(2)[rank])
    torch.save(norm.state_dict(), f"{out_path}.{world.rank}")
    dist.cleanup()


def test_two_ranks_hold_the_statistics_of_both_halves(tmp_path):
    run_two_ranks(_rank, str(tmp_path / "n"))
    r0, r1 = torch.load(tmp_path / "n.0"), torch.load(tmp_path / "n.1")
    single = RunningNorm((3, 5))
    x = _data()
    single.update(x[:40])
    single.update(x[40:])
    for k in ("mean", "var", "count"):
        assert torch.equal(r0[k], r1[k])
        torch.testing.assert_close(r0[k], single.state_dict()[k])


def _fitted_agent(ppo, **options):
    torch.manual_seed(0)
    agent = ppo.Agent(6, **options)
    g = torch.Generator().manual_seed(2)
    obs = torch.randint(0, 256, (32, 4, 84, 84), generator=g, dtype=torch.uint8)
    agent.update_norms(obs, torch.randn(32, generator=g) * 4 + 3)
    return agent, obs


NORMALISED = ("a2c_multigpu", "ppo_multigpu", "appo_async")  # the scripts with the normalisers
PG = ("ppo_multigpu", "appo_async")  # and with --activation


@pytest.mark.parametrize("script", NORMALISED)
def test_forward_normalises_the_input_and_returns_the_value_in_return_units(script):
    ppo = load_algo(script)
    agent, obs = _fitted_agent(ppo, normalize_input=True, normalize_value=True)
    x = agent.obs_norm(obs.float() / 255.0)
    h = agent.torso(x)
    logits, value = agent(obs)
    torch.testing.assert_close(logits, agent.actor(h))
    vn = agent.value_norm
    torch.testing.assert_close(value, agent.critic(h).squeeze(-1) * vn.std() + vn.mean)
    assert agent.value_scale() == vn.std()
    assert {"obs_norm.mean", "obs_norm.var", "value_norm.count"} <= set(agent.state_dict())
    assert "obs_norm.mean" not in ppo.Agent(6).state_dict()  # off: the checkpoints of before


def test_ppo_value_loss_in_units_of_the_returns_std():
    """--normalize-value: 0.5 * mean(((v - R) / std)^2); with value clipping the clip range is
    in those units too."""
    ppo = load_algo("ppo_multigpu")
    agent, obs = _fitted_agent(ppo, normalize_value=True)
    g = torch.Generator().manual_seed(3)
    mb = {"obs": obs, "actions": torch.randint(0, 6, (32,), generator=g),
          "logprob": -torch.rand(32, generator=g), "advantages": torch.randn(32, generator=g),
          "returns": torch.randn(32, generator=g) * 4 + 3,
          "value": torch.randn(32, generator=g) * 4}
    value = agent(obs)[1]
    s = agent.value_norm.std()
    _, stats = ppo.ppo_loss(agent, mb, ppo.Args(clip_vloss=False))
    ref = 0.5 * (((value - mb["returns"]) / s) ** 2).mean()
    torch.testing.assert_close(stats["value_loss"], ref)
    _, stats = ppo.ppo_loss(agent, mb, ppo.Args(clip_vloss=True, clip_coef=0.1))
    clipped = mb["value"] / s + ((value - mb["value"]) / s).clamp(-0.1, 0.1)
    ref = 0.5 * torch.max(((value - mb["returns"]) / s) ** 2,
                          (clipped - mb["returns"] / s) ** 2).mean()
    torch.testing.assert_close(stats["value_loss"], ref)


def test_appo_value_loss_in_units_of_the_returns_std():
    """APPO's --normalize-value: PPO's value loss in the returns' standard deviations, its clip
    around the proximal values."""
    appo = load_algo("appo_async")
    agent, obs = _fitted_agent(appo, normalize_value=True)
    g = torch.Generator().manual_seed(3)
    logprob = -torch.rand(32, generator=g)
    mb = {"obs": obs, "actions": torch.randint(0, 6, (32,), generator=g), "logprob": logprob,
          "prox_logprob": logprob, "advantages": torch.randn(32, generator=g),
          "returns": torch.randn(32, generator=g) * 4 + 3,
          "prox_value": torch.randn(32, generator=g) * 4}
    value = agent(obs)[1]
    s = agent.value_norm.std()
    _, stats = appo.appo_loss(agent, mb, appo.Args(clip_vloss=False))
    torch.testing.assert_close(stats["value_loss"],
                               0.5 * (((value - mb["returns"]) / s) ** 2).mean())
    _, stats = appo.appo_loss(agent, mb, appo.Args(clip_vloss=True, clip_coef=0.1))
    clipped = mb["prox_value"] / s + ((value - mb["prox_value"]) / s).clamp(-0.1, 0.1)
    ref = 0.5 * torch.max(((value - mb["returns"]) / s) ** 2,
                          (clipped - mb["returns"] / s) ** 2).mean()
    torch.testing.assert_close(stats["value_loss"], ref)


def _a2c_rollout(T=4, B=8, seed=3):
    g = torch.Generator().manual_seed(seed)
    term = torch.rand(T, B, generator=g) < 0.2
    trunc = (torch.rand(T, B, generator=g) < 0.1) & ~term
    rollout = {"obs": torch.randint(0, 256, (T, B, 4, 84, 84), generator=g, dtype=torch.uint8),
               "actions": torch.randint(0, 6, (T, B), generator=g),
               "rewards": torch.randn(T, B, generator=g), "terminated": term, "truncated": trunc,
               "final_values": (torch.randn(T, B, generator=g) * 4 + 3) * trunc}
    return rollout, torch.randint(0, 256, (B, 4, 84, 84), generator=g, dtype=torch.uint8)


def test_a2c_value_loss_in_units_of_the_returns_std():
    """A2C's --normalize-value: the n-step returns bootstrap from the value in return units, and
    the value loss is 0.5 * mean(((v - R) / std)^2)."""
    a2c = load_algo("a2c_multigpu")
    agent, _ = _fitted_agent(a2c, normalize_input=True, normalize_value=True)
    rollout, next_obs = _a2c_rollout()
    args = a2c.Args()
    _, stats, returns = a2c.a2c_loss(agent, rollout, next_obs, args)
    with torch.no_grad():
        value = agent(rollout["obs"].flatten(0, 1))[1]
        next_value = agent(next_obs)[1]
    ref_returns = a2c.nstep_returns(rollout["rewards"], rollout["terminated"],
                                    rollout["truncated"], rollout["final_values"], next_value,
                                    args.gamma).flatten()
    torch.testing.assert_close(returns, ref_returns)
    s = agent.value_norm.std()
    assert s.item() > 2  # the fitted returns' deviation is about 4: the units matter
    torch.testing.assert_close(stats["value_loss"], 0.5 * (((value - ref_returns) / s) ** 2).mean())


def test_a2c_update_takes_the_rollout_into_the_statistics_after_its_step():
    """The step on a rollout is taken under the statistics before it (its loss and bootstrap value
    see one set); then its frames / 255 and its returns are folded in."""
    from common.grad_step import AllReduceStep
    a2c = load_algo("a2c_multigpu")
    agent, _ = _fitted_agent(a2c, normalize_input=True, normalize_value=True)
    twin, _ = _fitted_agent(a2c, normalize_input=True, normalize_value=True)
    rollout, next_obs = _a2c_rollout()
    args = a2c.Args(optimizer="adam", max_grad_norm=0.0)  # no clip: gradients compare as they are
    before = {k: v.clone() for k, v in agent.state_dict().items() if "_norm." in k}
    loss, _, returns = a2c.a2c_loss(twin, rollout, next_obs, args)  # under the old statistics
    loss.backward()
    a2c.a2c_update(agent, AllReduceStep(agent, a2c.make_optimizer(agent, args, 1e-3),
                                        args.max_grad_norm), rollout, next_obs, args)
    for p, q in zip(agent.parameters(), twin.parameters()):
        torch.testing.assert_close(p.grad, q.grad)
    expected = RunningNorm(()), RunningNorm((4, 84, 84))
    for norm, key in zip(expected, ("value_norm", "obs_norm")):
        norm.load_state_dict({k.split(".", 1)[1]: v for k, v in before.items()
                              if k.startswith(key)})
    expected[0].update(returns)
    expected[1].update(rollout["obs"].flatten(0, 1), scale=1 / 255.0)
    for norm, key in zip(expected, ("value_norm", "obs_norm")):
        for k, v in norm.state_dict().items():
            torch.testing.assert_close(agent.state_dict()[f"{key}.{k}"], v)
    assert agent.value_norm.count.item() == 32 + 32  # the fit's batch and this rollout's 4 x 8


@pytest.mark.parametrize("script", PG)
def test_activation_elu(script):
    ppo = load_algo(script)
    kinds = {type(m) for m in ppo.Agent(6, activation="elu").torso}
    assert torch.nn.ELU in kinds and torch.nn.ReLU not in kinds
    kinds = {type(m) for m in ppo.Agent(6).torso}
    assert torch.nn.ReLU in kinds and torch.nn.ELU not in kinds


@pytest.mark.parametrize("script", NORMALISED)
@pytest.mark.parametrize("options", [{}, {"activation": "elu", "normalize_input": True,
                                          "normalize_value": True}])
def test_evaluate_rebuilds_the_trained_network(options, script):
    """benchmarks/evaluate.py's network for an A2C, PPO or APPO checkpoint: the normalisers from
    the weights, PPO's and APPO's activation from the run's flags; the same outputs as the
    trained agent."""
    from common.trained import build_network
    ppo = load_algo(script)
    if script not in PG:
        options = {k: v for k, v in options.items() if k != "activation"}
    agent, obs = _fitted_agent(ppo, **options)
    weights = agent.state_dict()
    run = ppo.Args(**{k: v for k, v in options.items() if k == "activation"})
    net = build_network(ppo, "pg", weights, 6, run)
    net.load_state_dict(weights)
    for a, b in zip(net(obs), agent(obs)):
        torch.testing.assert_close(a, b)


@pytest.mark.slow
def test_compiled_network_sees_each_update_of_the_statistics():
    """--compile with the normalisers (the sprint's mode): the compiled forward reads the running
    statistics as they are now, not as they were when it was compiled."""
    from common import gpu
    ppo = load_algo("ppo_multigpu")
    agent, obs = _fitted_agent(ppo, normalize_input=True, normalize_value=True, activation="elu")
    step = gpu.compiled(agent, True)
    with torch.no_grad():
        for i in range(2):
            for a, b in zip(step(obs), agent(obs)):
                torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
            before = step(obs)[1].clone()
            agent.update_norms(torch.full_like(obs, 200), torch.full((32,), 50.0 + i))
        assert not torch.allclose(step(obs)[1], before)
