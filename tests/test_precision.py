"""--precision bf16 in every script (common/gpu.py's in_modes on each network's forward):
the outputs stay float32 and within bf16's precision of fp32's, each algorithm's loss and its
gradient follow fp32's on a fixed batch, and C51's projected distribution still sums to 1."""

import pytest
import torch
import torch.nn.functional as F

from tests.conftest import load_algo, read_summary, replay_batch, run_script


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Within bf16's precision: 2% of the reference's scale."""
    return (a - b).abs().max() <= 0.02 * b.abs().max().clamp(min=1e-3)


def _grad(model) -> torch.Tensor:
    return torch.cat([p.grad.reshape(-1) for p in model.parameters() if p.grad is not None])


def _both(model, loss_fn):
    """loss_fn(model) in fp32 and in bf16 on the same parameters: ((loss, grad), (loss, grad))."""
    out = []
    for precision in ("fp32", "bf16"):
        model.precision = precision
        model.zero_grad()
        loss = loss_fn(model)
        assert loss.dtype == torch.float32
        loss.backward()
        out.append((loss.item(), _grad(model)))
    return out


def _agrees(fp32, bf16):
    (l32, g32), (l16, g16) = fp32, bf16
    assert abs(l16 - l32) <= max(0.02 * abs(l32), 0.01), (l16, l32)
    assert F.cosine_similarity(g16, g32, dim=0) > 0.99
    assert abs(g16.norm() / g32.norm() - 1) < 0.05


def _reference(net, obs: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The network's outputs by hand: torso and hidden layers under bf16 autocast, each output
    layer in float32 on their output, the dueling sums in float32."""
    with torch.autocast("cpu", dtype=torch.bfloat16):
        h = net.torso(obs.float() / 255.0)
        hidden = {name: getattr(net, name)[:-1](h) for name in ("head", "value")
                  if isinstance(getattr(net, name, None), torch.nn.Sequential)}
    if not hidden:  # actor-critic: linear heads on the torso's features
        return net.actor(h.float()), net.critic(h.float()).squeeze(-1)
    out = {name: getattr(net, name)[-1](x.float()) for name, x in hidden.items()}
    q = out["head"] if not hasattr(net, "K") else out["head"].view(-1, net.A, net.K)
    if "value" not in out:
        return (q,)
    v = out["value"] if not hasattr(net, "K") else out["value"][:, None]
    return (v + q - q.mean(1, keepdim=True),)


def _networks():
    support = torch.linspace(-10, 10, 51)
    yield "ppo", load_algo("ppo_multigpu").Agent(6)
    yield "a2c", load_algo("a2c_multigpu").Agent(6)
    yield "appo", load_algo("appo_async").Agent(6)
    for dueling in (False, True):
        yield f"dqn dueling={dueling}", load_algo("dqn_multigpu").QNetwork(6, dueling)
        yield f"c51 dueling={dueling}", load_algo("cat_dqn").C51Network(6, support, dueling)


def test_output_layers_run_in_float32_on_the_bf16_features():
    """In bf16 only the torso and hidden layers round to bf16: every network's logits, values
    and Q-values are a float32 output layer (and dueling sum) on the bf16 features, bit for bit,
    so they are not all bf16-representable (bf16 outputs would quantise Q-values to about 0.4%,
    their argmax ties falling to the lowest action)."""
    obs = replay_batch(32, 6)["obs"]
    for name, net in _networks():
        torch.manual_seed(0)
        net.precision, net.channels_last = "bf16", "off"
        out = net(obs)
        out = out if isinstance(out, tuple) else (out,)
        for got, want in zip(out, _reference(net, obs), strict=True):
            assert got.dtype == torch.float32 and torch.equal(got, want), name
            assert not torch.equal(got, got.bfloat16().float()), name


@pytest.mark.parametrize("script", ["a2c_multigpu", "appo_async"])
def test_policy_gradient_networks(script):
    algo = load_algo(script)
    torch.manual_seed(0)
    agent, b = algo.Agent(6), replay_batch(64, 6)
    agent.precision = "bf16"
    logits16, value16 = agent(b["obs"])
    agent.precision = "fp32"
    logits32, value32 = agent(b["obs"])
    assert logits16.dtype == value16.dtype == torch.float32
    assert _close(logits16, logits32) and _close(value16, value32)

    def loss(model):  # actor-critic: -log pi(a) A - entropy + value error
        logits, value = model(b["obs"])
        logp = torch.log_softmax(logits, -1)
        chosen = logp.gather(1, b["actions"][:, None]).squeeze(1)
        entropy = -(logp.exp() * logp).sum(-1).mean()
        return -(chosen * b["weights"]).mean() - 0.01 * entropy + 0.5 * (
            (value - b["returns"]) ** 2).mean()
    _agrees(*_both(agent, loss))


@pytest.mark.parametrize("dueling", [False, True])
def test_dqn_td_loss(dueling):
    dqn = load_algo("dqn_multigpu")
    torch.manual_seed(0)
    model, target = dqn.QNetwork(6, dueling), dqn.QNetwork(6, dueling)
    b = replay_batch(64, 6)

    def loss(m):
        target.precision = m.precision
        y = dqn.td_targets(m, target, b, double=True)
        q = m(b["obs"]).gather(1, b["actions"][:, None]).squeeze(1)
        assert y.dtype == q.dtype == torch.float32
        return (b["weights"] * F.smooth_l1_loss(q, y, reduction="none")).mean()
    _agrees(*_both(model, loss))


@pytest.mark.parametrize("dueling", [False, True])
def test_c51_cross_entropy_and_its_projection(dueling):
    c51 = load_algo("cat_dqn")
    torch.manual_seed(0)
    support = torch.linspace(-10, 10, 51)
    model, target = c51.C51Network(6, support, dueling), c51.C51Network(6, support, dueling)
    b = replay_batch(64, 6)
    for precision in ("fp32", "bf16"):
        model.precision = target.precision = precision
        m = c51.target_distribution(model, target, b, double=True)
        assert m.dtype == torch.float32 and torch.allclose(m.sum(1), torch.ones(64), atol=1e-5)

    def loss(net):
        target.precision = net.precision
        m = c51.target_distribution(net, target, b, double=True)
        chosen = net(b["obs"])[torch.arange(64), b["actions"]]
        return (b["weights"] * -(m * F.log_softmax(chosen, -1)).sum(1)).mean()
    _agrees(*_both(model, loss))


# Each script's Catch test run with --precision bf16, at that test's threshold. Seeds 1-3 on a
# 2-core Intel Xeon VM, one thread, last 100 games: A2C 0.90, 0.96, 0.98 (> 0.7); APPO 1.00,
# 1.00, 0.88 (> 0.8); C51 0.98, 0.94, 0.90 (> 0.6); PPO's is in tests/test_ppo.py. DQN has
# none: in bf16 it learns Catch slower (0.62, 0.74, 0.48 at 10,000 steps against fp32's 0.80,
# 0.82, 0.68; docs/results.md), so its bf16 stays a measured option, not a tested equal.
LEARNING = {
    "a2c_multigpu": (("--total-timesteps", "32000", "--learning-rate", "7e-3"), 0.7),
    "appo_async": (("--total-timesteps", "14336", "--num-steps", "32", "--num-minibatches", "8",
                    "--learning-rate", "1e-3"), 0.8),
    "cat_dqn": (("--total-timesteps", "15000", "--num-envs", "8", "--num-steps", "4",
                 "--replay-size", "20000", "--learning-starts", "500", "--batch-size", "32",
                 "--replay-ratio", "4", "--learning-rate", "1e-3", "--adam-eps", "3e-4",
                 "--n-step", "3", "--eps-decay-steps", "3000", "--eps-end", "0.02",
                 "--target-update-interval", "400", "--eval-interval", "0"), 0.6),
}


@pytest.mark.slow
@pytest.mark.parametrize("script", list(LEARNING))
def test_learns_catch_in_bf16(script, tmp_path):
    """On a CPU without bf16 units (no AVX-512 BF16 or AMX; an AMD EPYC VM with AVX2 only)
    oneDNN emulates bf16 convolutions at about 10x fp32's cost: there C51 (about 1,800 updates
    of 32) had done 12,288 of its 15,000 environment steps after 900 s under the suite's load,
    hence its longer limit (a limit only bounds a hang)."""
    flags, threshold = LEARNING[script]
    run = tmp_path / "run"
    run_script(script, "--env-id", "tests.catch_env:Catch-v0", "--seed", "1", *flags,
               "--precision", "bf16", "--run-dir", str(run),
               timeout=2400 if script == "cat_dqn" else 900)
    s = read_summary(run)
    assert s["args"]["precision"] == "bf16" and s["mean_return_last100"] > threshold
