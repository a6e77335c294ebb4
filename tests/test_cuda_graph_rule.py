"""Every script's update obeys CUDA graphs' rule for outputs (tests/cuda_graphs.py): run through
a stand-in for `gpu.compiled` that poisons each call's outputs and gradients at the next call, as
a replay does, three updates give the eager run's statistics, learning rate and parameters. On a
GPU, an update that breaks the rule raises or learns from overwritten numbers."""

import copy
import dataclasses
import math

import pytest
import torch

from common import gpu
from common.central_optim import CentralOptimizer
from common.grad_step import AllReduceStep, CentralStep
from tests.conftest import load_algo, read_summary, replay_batch, run_python
from tests.cuda_graphs import CudaGraphRule
from tests.test_speed_modes import _a2c_rollout, _pg_batch

CASES = [("ppo_multigpu", "all-reduce"), ("appo_async", "central"),
         ("a2c_multigpu", "all-reduce"), ("a2c_multigpu", "central"),
         ("dqn_multigpu", "all-reduce"), ("dqn_multigpu", "central"), ("cat_dqn", "all-reduce")]


def _setup(name: str):
    """(model, args, update(model, step, args) -> {stat: float}) for one script, on small data
    with the flags that make it keep outputs longest: the KL-driven rate and early stop."""
    algo = load_algo(name)
    torch.manual_seed(0)
    if name in ("ppo_multigpu", "appo_async"):
        batch = _pg_batch(64)
        if name == "ppo_multigpu":  # a tiny threshold: the rate falls after every epoch
            args = dataclasses.replace(algo.Args(), kl_threshold=1e-6, target_kl=1.0)
            update = algo.ppo_update
        else:  # a tiny limit: the second epoch is cut by the first's KL
            args, update = dataclasses.replace(algo.Args(), target_kl=1e-6), algo.appo_update
        args = dataclasses.replace(args, num_minibatches=4, update_epochs=3)
        return algo.Agent(6), args, lambda m, s, a: update(m, s, batch, a)[0]
    if name == "a2c_multigpu":
        rollout, next_obs = _a2c_rollout(5, 4)
        return algo.Agent(6), algo.Args(), lambda m, s, a: algo.a2c_update(
            m, s, rollout, next_obs, a)[0]
    batch, args = replay_batch(32, 6), dataclasses.replace(algo.Args(), double=True)
    if name == "dqn_multigpu":
        model = algo.QNetwork(6, dueling=True)
        target = copy.deepcopy(model)

        def update(m, s, a):
            stats, td_abs, _ = algo.dqn_update(m, target, s, batch, a)
            return {**stats, "td_abs": td_abs.sum()}  # the priorities, used at once
        return model, args, update
    model = algo.C51Network(6, torch.linspace(-10, 10, 51), dueling=True)
    target = copy.deepcopy(model)

    def update(m, s, a):
        stats, ce, _ = algo.c51_update(m, target, s, batch, a)
        return {**stats, "ce": ce.sum()}
    return model, args, update


def _three_updates(model, args, update, mode: str, folder):
    torch.manual_seed(1)
    if mode == "central":
        central = CentralOptimizer(model.parameters(), 3, eps=1e-5, folder=folder)
        step = CentralStep(model, central, 1e-3, 0.5)
    else:
        step = AllReduceStep(model, gpu.adam(model.parameters(), lr=1e-3, eps=1e-5), 0.5)
    stats = []
    for _ in range(3):
        s = update(model, step, args)
        stats.append({k: float(v) for k, v in s.items() if v is not None})  # as run.record
        stats[-1]["lr"] = step.lr
    if mode == "central":
        central.close()
    return stats, torch.cat([p.detach().reshape(-1) for p in model.parameters()])


@pytest.mark.parametrize("script,mode", CASES)
def test_update_under_the_cuda_graph_rule_is_the_eager_update(script, mode, monkeypatch,
                                                               tmp_path):
    model, args, update = _setup(script)
    eager = _three_updates(copy.deepcopy(model), dataclasses.replace(args, compile=False),
                           update, mode, tmp_path)
    rule = CudaGraphRule()
    monkeypatch.setattr(gpu, "compiled", rule.compiled)
    graphed = _three_updates(model, dataclasses.replace(args, compile=True), update, mode,
                             tmp_path)
    assert rule.shapes, "the update went through no compiled function"
    assert graphed[0] == eager[0]
    assert torch.equal(graphed[1], eager[1])
    if script == "ppo_multigpu":
        assert eager[0][-1]["lr"] < eager[0][0]["lr"] < 1e-3  # the KL drove the rate down


def test_the_stand_in_catches_a_kept_output_and_a_gradient_in_graph_memory():
    """The rule itself: an output kept past the next call reads NaN, and a parameter whose first
    gradient came from a backward in graph memory cannot be zeroed or accumulated into."""
    rule = CudaGraphRule()
    lin = torch.nn.Linear(3, 1)
    f = rule.compiled(lambda m, x: m(x).sum(), True)
    kept = f(lin, torch.ones(2, 3))
    kept.backward()
    f(lin, torch.ones(2, 3))
    assert torch.isnan(kept.detach())
    with pytest.raises(RuntimeError):
        lin.zero_grad(set_to_none=False)
    lin.weight.grad = torch.zeros_like(lin.weight)  # stable buffers of the caller's own
    lin.bias.grad = torch.zeros_like(lin.bias)
    f(lin, torch.ones(2, 3)).backward()
    f(lin, torch.ones(2, 3))
    lin.zero_grad(set_to_none=False)
    assert list(rule.shapes.values()) == [{((2, 3),)}]


RUNS = {"ppo_multigpu": ("--num-steps", "16", "--kl-threshold", "0.01"),
        "a2c_multigpu": ("--num-steps", "5"),
        "dqn_multigpu": ("--num-steps", "4", "--learning-starts", "256", "--batch-size", "32",
                         "--replay-size", "4096", "--dueling", "--double"),
        "cat_dqn": ("--num-steps", "4", "--learning-starts", "256", "--batch-size", "32",
                    "--replay-size", "4096")}


@pytest.mark.parametrize("script", sorted(RUNS))
def test_a_compiled_run_keeps_the_rule_and_one_shape_per_compiled_function(script, tmp_path):
    """A whole --compile run on Catch (sampling, learning, the evaluations) under the stand-in:
    it ends, its losses are numbers, and each compiled function met one set of input shapes
    (evaluation plays 4 environments against the sampler's 8: it must not use the sampling
    step's compiled network, which a GPU would record again for every new shape)."""
    import json

    run = tmp_path / "run"
    proc = run_python("tests/cuda_graphs.py", script, "--no-cuda", "--compile",
                      "--env-id", "tests.catch_env:Catch-v0", "--num-envs", "8",
                      "--total-timesteps", "1536", "--eval-interval", "512",
                      "--eval-episodes", "4", "--eval-envs", "4", *RUNS[script],
                      "--run-dir", str(run), timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    shapes = json.loads((run / "compiled_shapes.json").read_text())
    assert len(shapes) == 2 and all(len(s) == 1 for s in shapes.values()), shapes
    summary = read_summary(run)
    assert summary["global_step"] >= 1536 and summary["eval_episodes"] >= 4, summary
    from benchmarks.training import scalars
    losses = [v for tag, rows in scalars(run)[0].items() if "loss" in tag for _, _, v in rows]
    assert losses and all(math.isfinite(v) for v in losses)
