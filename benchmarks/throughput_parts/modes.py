"""The modes part of benchmarks/throughput.py: every script's learner in each speed mode, and every
script end to end in its default mode and its fastest (throughput-modes-<host>-<device>.json).

More: docs/benchmarks.md, `benchmarks/throughput_parts/modes.py`.
"""

from __future__ import annotations

import dataclasses
import math
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from benchmarks.throughput_parts.cat_dqn import synthetic_batch
from benchmarks.throughput_parts.measure import (fmt, load_algo, random_rollout, run_e2e, sync,
                                                 table, timed)
from common import gpu
from common.grad_step import AllReduceStep, CentralStep

STEM = "throughput-modes"
PARTS = ("modes",)
MODES = {"fp32": dict(precision="fp32", channels_last="off", compile=False),
         "bf16": dict(precision="bf16", channels_last="off", compile=False),
         "channels-last": dict(precision="fp32", channels_last="on", compile=False),
         "compiled": dict(precision="fp32", channels_last="off", compile=True),
         "best": dict(precision="bf16", channels_last="on", compile=True)}
BEST_FLAGS = ["--precision", "bf16", "--channels-last", "on", "--compile"]
SCRIPTS = {"ppo": "ppo_multigpu", "a2c": "a2c_multigpu", "appo": "appo_async",
           "dqn": "dqn_multigpu", "c51": "cat_dqn"}
E2E_FLAGS = {"dqn": ["--learning-starts", "2048", "--eval-interval", "0", "--replay-size",
                     "100000"],
             "c51": ["--learning-starts", "2048", "--eval-interval", "0", "--replay-size",
                     "100000"],
             "appo": ["--eval-interval", "0"], "ppo": ["--eval-interval", "0"],
             "a2c": ["--eval-interval", "0"]}


@dataclass
class Args:
    """the modes part (written to throughput-modes-<host>-<device>.json)"""
    algos: tuple[str, ...] = tuple(SCRIPTS)
    """algorithms to measure, any of ppo a2c appo dqn c51"""
    modes: tuple[str, ...] = tuple(MODES)
    """learner modes to measure, any of fp32 bf16 channels-last compiled best (fp32: always)"""
    seconds: float = 5.0
    """timed seconds per learner measurement, after its warm-up (compilation included there)"""
    e2e_seconds: float = 30.0
    """seconds each end-to-end run trains after its first progress line"""
    e2e: bool = True
    """run every script end to end in its default and its best mode (--modes.no-e2e skips)"""
    update_epochs: int = 4
    """epochs of each PPO and APPO learner call (their default 4); the minibatch step measured
    is the same with fewer (the GPU check's quick run: 1)"""


def check(a) -> str | None:
    """What is wrong with --modes.algos or --modes.modes, if anything."""
    for flag, given, known in (("algos", a.algos, SCRIPTS), ("modes", a.modes, MODES)):
        if bad := [x for x in given if x not in known]:
            return f"--modes.{flag}: unknown {bad[0]!r}; choose from {', '.join(known)}"
    return None


def learner(name: str, mode: dict, device: torch.device, seed: int, epochs: int = 4):
    """(one update of `name`'s learner in `mode`, optimizer steps it takes, a cleanup, its
    step). PPO adapts its rate to the KL as the sprint's recipe does: its per-epoch KL check is
    timed, and the rate's change shows the compiled loss's statistics reached the schedule."""
    algo = load_algo(SCRIPTS[name])
    torch.manual_seed(seed)
    if name in ("ppo", "a2c", "appo"):
        args = dataclasses.replace(algo.Args(), **mode,
                                   **({"kl_threshold": 0.01} if name == "ppo" else {}),
                                   **({"update_epochs": epochs} if name != "a2c" else {}))
        agent = algo.Agent(6, args.precision, args.channels_last).to(device)
        if name == "a2c":
            T, B = args.num_steps, args.num_envs
            flat = random_rollout(T * B + B, 6, device)
            rollout = {"obs": flat["obs"][:T * B].view(T, B, 4, 84, 84),
                       "actions": flat["actions"][:T * B].view(T, B),
                       "rewards": flat["returns"][:T * B].view(T, B).sign(),
                       "terminated": flat["value"][:T * B].view(T, B) > 2,
                       "truncated": torch.zeros(T, B, dtype=torch.bool, device=device),
                       "final_values": flat["value"][:T * B].view(T, B)}
            step = AllReduceStep(agent, algo.make_optimizer(agent, args, args.learning_rate),
                                 args.max_grad_norm)
            return (lambda: algo.a2c_update(agent, step, rollout, flat["obs"][T * B:], args)), \
                1, lambda: None, step
        batch = random_rollout(args.num_envs * args.num_steps, 6, device)
        steps = args.update_epochs * args.num_minibatches
        if name == "ppo":
            step = AllReduceStep(agent, gpu.adam(agent.parameters(), lr=args.learning_rate,
                                                 eps=1e-5), args.max_grad_norm)
            return lambda: algo.ppo_update(agent, step, batch, args), steps, lambda: None, step
        from common.central_optim import CentralOptimizer
        central = CentralOptimizer(agent.parameters(), args.num_chunks, eps=1e-5)
        central.unlink()
        batch["prox_logprob"], batch["prox_value"] = batch["logprob"], batch["value"]
        step = CentralStep(agent, central, args.learning_rate, args.max_grad_norm)
        return lambda: algo.appo_update(agent, step, batch, args), steps, central.close, step
    args = dataclasses.replace(algo.Args(), **mode)
    batch = synthetic_batch(args.batch_size, 6, device, seed)
    if name == "dqn":
        model, target = (algo.QNetwork(6, args.dueling, args.precision, args.channels_last)
                         .to(device) for _ in range(2))
        step = AllReduceStep(model, algo.make_optimizer(model, args), args.max_grad_norm)
        return lambda: algo.dqn_update(model, target, step, batch, args), 1, lambda: None, step
    support = torch.linspace(args.v_min, args.v_max, args.num_atoms, device=device)
    model, target = (algo.C51Network(6, support, args.dueling, args.precision,
                                      args.channels_last).to(device) for _ in range(2))
    step = AllReduceStep(model, algo.make_optimizer(model, args), args.max_grad_norm)
    return lambda: algo.c51_update(model, target, step, batch, args), 1, lambda: None, step


def bench_learner(name: str, mode_name: str, a, device: torch.device) -> dict:
    update, steps, cleanup, step = learner(name, MODES[mode_name], device, a.seed,
                                           a.update_epochs)
    compiled_before, first_lr = gpu.compile_seconds(), step.lr
    for _ in range(2):  # compilation, then one more warm call
        stats = update()[0]
    sync(device)
    compile_s = gpu.compile_seconds() - compiled_before
    r = timed(update, steps, a.seconds, device, warmup=0)
    cleanup()
    return {"ms_per_step": 1000 / r["steps_per_s"], "optimizer_steps": r["steps"],
            "seconds": r["seconds"], "compile_seconds": compile_s,
            "learning_rate": [first_lr, step.lr],  # before the first update and after the last
            "finite": all(math.isfinite(float(v)) for v in stats.values() if v is not None)}


def run(res: dict, a, parts: set[str], device: torch.device, num_actions: int) -> None:
    """Every chosen algorithm's learner in every mode, then end to end, and the ratios."""
    for name in a.algos:
        res[name] = {"learner": {}}
        for mode in [m for m in MODES if m == "fp32" or m in a.modes]:
            print(f"measuring {name}'s learner, {mode} ...", flush=True)
            r = res[name]["learner"][mode] = bench_learner(name, mode, a, device)
            print(f"  {r['ms_per_step']:.1f} ms per step"
                  + (f", compiled in {r['compile_seconds']:.0f} s" if r["compile_seconds"]
                     else ""), flush=True)
        ref = res[name]["learner"]["fp32"]["ms_per_step"]
        res[name]["speedup"] = {m: ref / r["ms_per_step"]
                                for m, r in res[name]["learner"].items()}
        if not a.e2e:
            continue
        with tempfile.TemporaryDirectory(prefix="accelrl-bench-") as tmp:
            for mode, flags in (("default", []), ("best", BEST_FLAGS)):
                print(f"measuring {name} end to end, {mode} mode ...", flush=True)
                e = res[name][f"e2e_{mode}"] = run_e2e(SCRIPTS[name], E2E_FLAGS[name] + flags, a,
                                                       device.type == "cuda",
                                                       Path(tmp) / f"{name}_{mode}")
                print(f"  {fmt(e.get('steady_sps'))} steps/s", flush=True)


def report(res: dict, a) -> str:
    """One row per algorithm: ms per step in each mode (speed-up over fp32), then end to end."""
    modes = [m for m in MODES if m == "fp32" or m in a.modes]
    head = ("algorithm", *(f"{m} ms/step" for m in modes), "compile s",
            "end to end, default", "end to end, best")
    rows = [head]
    for name in a.algos:
        r = res.get(name)
        if not r:
            continue
        lr, sp = r["learner"], r["speedup"]
        cells = [f"{lr[m]['ms_per_step']:.1f}" + ("" if m == "fp32" else f" ({sp[m]:.2f}x)")
                 for m in modes]
        e2e = []
        for mode in ("default", "best"):
            e = r.get(f"e2e_{mode}") or {}
            whole = (e.get("summary") or {}).get("sps")
            e2e.append(fmt(e.get("steady_sps")) + (f" (whole run {fmt(whole)})" if whole else "")
                       if e else "not run")
        compiled = max(r["compile_seconds"] for r in lr.values())
        rows.append((SCRIPTS[name], *cells, f"{compiled:.0f}", *e2e))
    return table(rows, res, ". Learner: ms per optimizer step on a synthetic batch of the script's "
                 "default size, speed-up over fp32 eager in brackets; compile s: the longest "
                 "mode's compilation. End to end: steady-state steps/s over iterations 2+ "
                 f"({a.e2e_seconds:g} s); whole run: summary.json's, start-up and compilation "
                 "included. Best: --precision bf16 --channels-last on --compile.")
