"""The learner's speed modes change no learning: each script's loss and its gradient are the same,
to float32 rounding, with the convolutions in channels-last memory format (--channels-last) and
under torch.compile (--compile); fused Adam (common/gpu.adam) takes torch's Adam step; and PPO in
its fastest CPU mode (bf16, channels-last, compiled) learns Catch at the Catch test's threshold.
The bf16 checks are in tests/test_precision.py."""

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from common import gpu
from tests.conftest import load_algo, read_summary, replay_batch, run_script


def _pg_batch(n: int, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"obs": torch.randint(0, 256, (n, 4, 84, 84), generator=g, dtype=torch.uint8),
            "actions": torch.randint(0, 6, (n,), generator=g),
            "logprob": -1.8 + 0.1 * torch.randn(n, generator=g),
            "prox_logprob": -1.8 + 0.1 * torch.randn(n, generator=g),
            "value": torch.randn(n, generator=g), "prox_value": torch.randn(n, generator=g),
            "advantages": torch.randn(n, generator=g), "returns": torch.randn(n, generator=g)}


def _a2c_rollout(T: int, B: int) -> tuple[dict, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    rollout = {"obs": torch.randint(0, 256, (T, B, 4, 84, 84), generator=g, dtype=torch.uint8),
               "actions": torch.randint(0, 6, (T, B), generator=g),
               "rewards": torch.randint(-1, 2, (T, B), generator=g).float(),
               "terminated": torch.rand(T, B, generator=g) < 0.2,
               "truncated": torch.rand(T, B, generator=g) < 0.1,
               "final_values": torch.randn(T, B, generator=g)}
    return rollout, torch.randint(0, 256, (B, 4, 84, 84), generator=g, dtype=torch.uint8)


def _case(name: str):
    """(model, loss(model, loss_fn) -> scalar, the script's loss function) for one script."""
    algo = load_algo(name)
    torch.manual_seed(0)
    if name in ("ppo_multigpu", "appo_async"):
        agent, mb = algo.Agent(6), _pg_batch(64)
        return agent, lambda m, fn: fn(m, mb, algo.Args())[0], getattr(
            algo, "ppo_loss" if name == "ppo_multigpu" else "appo_loss")
    if name == "a2c_multigpu":
        rollout, next_obs = _a2c_rollout(5, 4)
        return (algo.Agent(6), lambda m, fn: fn(m, rollout, next_obs, algo.Args())[0],
                algo.a2c_loss)
    b = replay_batch(64, 6)
    args = dataclasses.replace(algo.Args(), double=True)
    if name == "dqn_multigpu":
        model, target = algo.QNetwork(6, dueling=True), algo.QNetwork(6, dueling=True)
        return model, lambda m, fn: fn(m, target, b, args)[0], algo.dqn_loss
    support = torch.linspace(-10, 10, 51)
    model, target = algo.C51Network(6, support, True), algo.C51Network(6, support, True)
    return model, lambda m, fn: fn(m, target, b, args)[0], algo.c51_loss


def _loss_and_grad(model, loss):
    model.zero_grad()
    value = loss()
    value.backward()
    return value.item(), torch.cat([p.grad.reshape(-1) for p in model.parameters()
                                    if p.grad is not None])


def _same(a, b, rtol: float):
    (la, ga), (lb, gb) = a, b
    assert abs(la - lb) <= rtol * max(abs(lb), 1e-3), (la, lb)
    assert (ga - gb).abs().max() <= rtol * gb.abs().max(), (ga - gb).abs().max()


SCRIPTS = ["ppo_multigpu", "a2c_multigpu", "appo_async", "dqn_multigpu", "cat_dqn"]


@pytest.mark.parametrize("script", SCRIPTS)
def test_channels_last_changes_no_value(script):
    """The layout changes only the order of the convolutions' sums: loss and gradient agree to
    1e-4 of their scale; "auto" is on for a CPU tensor."""
    model, loss, fn = _case(script)
    assert gpu.channels_last("auto", torch.device("cpu"))
    assert not gpu.channels_last("auto", torch.device("cuda"))
    out = {}
    for setting in ("off", "on"):
        for m in model.modules():
            if hasattr(m, "channels_last"):
                m.channels_last = setting
        out[setting] = _loss_and_grad(model, lambda: loss(model, fn))
    _same(out["on"], out["off"], 1e-4)


@pytest.mark.slow
@pytest.mark.parametrize("script", SCRIPTS)
def test_compiled_loss_is_the_eager_loss(script):
    """--compile's learner loss (forward and loss one graph, the backward compiled with it) gives
    the eager loss and gradient to 1e-4 of their scale, on each script's loss function."""
    model, loss, fn = _case(script)
    eager = _loss_and_grad(model, lambda: loss(model, fn))
    compiled = gpu.compiled(fn, True)
    assert compiled is gpu.compiled(fn, True)  # one compilation, however often asked for
    _same(_loss_and_grad(model, lambda: loss(model, compiled)), eager, 1e-4)
    assert gpu.compile_seconds() > 0 and gpu.switches()["compile"]


def test_each_process_compiles_into_its_own_cache(monkeypatch, tmp_path):
    """Inductor's shared cache races when processes compile the same graph at once (a test run
    of two compiling processes failed on it): a process gets a folder of its own, a child
    process that inherited its parent's gets another inside it (a killed sampler process never
    removes its own), and a folder the user names is kept."""
    import os
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("ACCELRL_COMPILE_CACHE_OF", raising=False)
    gpu.own_compile_cache()
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path)  # the user's
    monkeypatch.setenv("ACCELRL_COMPILE_CACHE_OF", str(os.getpid() + 1))  # a parent's
    gpu.own_compile_cache()
    mine = os.environ["TORCHINDUCTOR_CACHE_DIR"]
    assert mine != str(tmp_path) and "accelrl-compile-" in mine and os.path.isdir(mine)
    assert os.path.dirname(mine) == str(tmp_path)  # inside the parent's: removed at its exit
    assert os.environ["ACCELRL_COMPILE_CACHE_OF"] == str(os.getpid())
    gpu.own_compile_cache()
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == mine  # made once per process
    # inductor's shared default, which it writes into the environment itself, is nobody's choice
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", default_cache_dir())
    monkeypatch.delenv("ACCELRL_COMPILE_CACHE_OF")
    gpu.own_compile_cache()
    assert "accelrl-compile-" in os.environ["TORCHINDUCTOR_CACHE_DIR"]


def test_ranks_on_one_machine_share_the_compile_workers(monkeypatch):
    """Inductor's min(32, cores) compile workers are per process: 8 torchrun ranks on a 64-core
    machine take 4 each (not 32), one rank takes min(32, cores), and the user's
    TORCHINDUCTOR_COMPILE_THREADS is left to decide."""
    import torch._inductor.config as inductor
    monkeypatch.setattr(inductor, "compile_threads", inductor.compile_threads)
    monkeypatch.delenv("TORCHINDUCTOR_COMPILE_THREADS", raising=False)
    monkeypatch.setattr(gpu.os, "cpu_count", lambda: 64)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    gpu.share_compile_workers()
    assert inductor.compile_threads == 4
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    gpu.share_compile_workers()
    assert inductor.compile_threads == 32
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    monkeypatch.setenv("TORCHINDUCTOR_COMPILE_THREADS", "3")
    inductor.compile_threads = 3
    gpu.share_compile_workers()
    assert inductor.compile_threads == 3


def test_fused_adam_takes_adams_step():
    """Three steps of gpu.adam (fused on a CPU) and of torch's default Adam, on the same
    gradients, leave the same parameters (to 1e-6)."""
    torch.manual_seed(0)
    nets = [torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
            for _ in range(2)]
    nets[1].load_state_dict(nets[0].state_dict())
    fused = gpu.adam(nets[0].parameters(), lr=1e-2, eps=1e-5)
    plain = torch.optim.Adam(nets[1].parameters(), lr=1e-2, eps=1e-5)
    assert fused.defaults["fused"] and not plain.defaults["fused"]
    x = torch.randn(32, 8)
    for _ in range(3):
        for net, opt in zip(nets, (fused, plain)):
            opt.zero_grad()
            F.mse_loss(net(x), torch.ones(32, 2)).backward()
            opt.step()
    for a, b in zip(nets[0].parameters(), nets[1].parameters()):
        assert torch.allclose(a, b, atol=1e-6)


@pytest.mark.slow
def test_ppo_learns_catch_in_its_fastest_cpu_mode(tmp_path):
    """tests/test_ppo.py's Catch run in bf16, channels-last and compiled, at its threshold; the
    compilation is recorded in summary.json."""
    run = tmp_path / "run"
    run_script("ppo_multigpu", "--env-id", "tests.catch_env:Catch-v0", "--seed", "1",
               "--total-timesteps", "8192", "--num-steps", "32", "--learning-rate", "1e-3",
               "--clip-coef", "0.2", "--precision", "bf16", "--channels-last", "on", "--compile",
               "--run-dir", str(run), timeout=900)
    s = read_summary(run)
    assert s["switches"]["compile"] and s["switches"]["compile_seconds"] > 1
    assert s["episodes"] > 1300 and s["mean_return_last100"] > 0.8
