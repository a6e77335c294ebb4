"""The appo part of benchmarks/throughput.py: APPO's overlap of sampling and learning, beside
synchronous PPO (JSON: throughput-appo-<host>-<device>.json).

More: docs/benchmarks.md, `benchmarks/throughput_parts/appo.py`.
"""

from __future__ import annotations

import os
import sys
import tempfile
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch

from benchmarks.throughput_parts.measure import ROOT, fmt, random_rollout, run_e2e, \
    drain, scalar_series, split_problem, table, timed
from common import envs

STEM = "throughput-appo"
PARTS = ("appo",)


@dataclass
class Args:
    """the appo part"""
    num_envs: int = 8
    """environments per rank (paper: 8 per GPU for PPO and APPO)"""
    num_steps: int = 128
    """steps per environment per rollout; the learner batch is num_envs x this"""
    sampler_cores: tuple[int, ...] = (0,)
    """cores for the sampler process (emulators and inference); the learner gets the others.
    Empty: no pinning (use on a GPU machine)"""
    seconds: float = 20.0
    """timed seconds for sampling alone and for learning alone, after a warm-up"""
    e2e_seconds: float = 60.0
    """seconds each end-to-end run trains after its first iteration before it is stopped"""


def appo_async():
    """algos/appo_async.py, imported by name: the sampler process unpickles its Agent by module
    name, so the script's folder must be on the path (here and in that process)."""
    if str(ROOT / "algos") not in sys.path:
        sys.path.insert(0, str(ROOT / "algos"))
    import appo_async as module
    return module


def check(a) -> str | None:
    """What is wrong with --appo.sampler-cores on this machine, if anything."""
    return split_problem("--appo.sampler-cores", a.sampler_cores)


def sampling_alone(appo, a, device: torch.device, num_actions: int) -> dict:
    """Rollouts per second from the sampler process when nobody trains: buffers go straight back."""
    from common.async_sampler import AsyncSampler

    torch.manual_seed(a.seed)
    agent = appo.Agent(num_actions).to(device)
    env_kwargs = dict(env_id=a.env_id, num_envs=a.num_envs, num_threads=len(a.sampler_cores))
    sampler = AsyncSampler(partial(appo.Agent, num_actions), appo.act, appo.value, env_kwargs,
                           a.num_steps, envs.env_seeds(a.seed, 0, a.num_envs), agent, device,
                           extras=("logprob", "value"), seed=a.seed,
                           cores=list(a.sampler_cores), threads=max(1, len(a.sampler_cores)))
    return drain(sampler, a.num_envs * a.num_steps, a.seconds)


def learning_alone(appo, a, device: torch.device, num_actions: int) -> dict:
    """Environment steps per second the learner consumes: APPO's update on a random rollout."""
    from common.central_optim import CentralOptimizer
    from common.grad_step import CentralStep

    pargs = appo.Args(num_envs=a.num_envs, num_steps=a.num_steps)
    n = a.num_envs * a.num_steps
    torch.manual_seed(a.seed)
    agent = appo.Agent(num_actions).to(device)
    central = CentralOptimizer(agent.parameters(), pargs.num_chunks, eps=1e-5)
    central.unlink()
    step = CentralStep(agent, central, 1e-4, pargs.max_grad_norm)
    batch = random_rollout(n, num_actions, device)
    def learn():  # what the learner does per rollout: the proximal pass, then the epochs
        batch["prox_logprob"], batch["prox_value"] = appo.proximal(
            agent, batch["obs"], batch["actions"], n // pargs.num_minibatches)
        return appo.appo_update(agent, step, batch, pargs)

    r = timed(learn, n, a.seconds, device)
    central.close()
    return {**r, "epochs": pargs.update_epochs, "minibatches": pargs.num_minibatches}


def appo_e2e_details(run_dir: Path) -> dict:
    """Waiting shares and policy lag over iterations 2+, from the run's TensorBoard scalars."""
    series = scalar_series(run_dir, (
        "time/sampler_wait", "time/learner_wait", "time/learn", "time/env", "time/inference",
        "charts/policy_lag_mean", "charts/policy_lag_max", "charts/dropped_rollouts"))
    steps = sorted(series.get("charts/policy_lag_mean", {}))[1:]  # drop the first iteration
    if not steps:
        return {}
    total = lambda tag: sum(series[tag][s] for s in steps)  # noqa: E731
    return {"iterations": len(steps), "sampler_wait_s": total("time/sampler_wait"),
            "learner_wait_s": total("time/learner_wait"), "learn_s": total("time/learn"),
            "sampler_busy_s": total("time/env") + total("time/inference"),
            "policy_lag_mean": total("charts/policy_lag_mean") / len(steps),
            "policy_lag_max": max(series["charts/policy_lag_max"][s] for s in steps),
            "dropped_rollouts": series["charts/dropped_rollouts"][steps[-1]]}


def run(res: dict, a, parts: set[str], device: torch.device, num_actions: int) -> None:
    """Measure into res (cores split as --appo.sampler-cores says), then ratios and the table."""
    appo = appo_async()
    allowed = os.sched_getaffinity(0)
    learner_cores = sorted(allowed - set(a.sampler_cores)) if a.sampler_cores else []
    res["split"] = {"sampler_cores": list(a.sampler_cores), "learner_cores": learner_cores}
    res["load_average_before"] = os.getloadavg()
    print(f"split {res['split']}", flush=True)

    print("measuring sampling alone ...", flush=True)
    threads = torch.get_num_threads()
    try:
        if learner_cores:
            os.sched_setaffinity(0, learner_cores)  # this process only hands buffers back
        res["sampling_alone"] = sampling_alone(appo, a, device, num_actions)
        print(f"  {res['sampling_alone']['steps_per_s']:,.0f} steps/s", flush=True)
        print("measuring learning alone ...", flush=True)
        if learner_cores:
            torch.set_num_threads(len(learner_cores))  # as appo_async.py sets its learner
        res["learning_alone"] = learning_alone(appo, a, device, num_actions)
    finally:  # the parts measured after this one get the whole machine back
        torch.set_num_threads(threads)
        os.sched_setaffinity(0, allowed)
    print(f"  {res['learning_alone']['steps_per_s']:,.0f} steps/s", flush=True)

    flags = ["--num-envs", str(a.num_envs), "--num-steps", str(a.num_steps)]
    with tempfile.TemporaryDirectory(prefix="accelrl-bench-") as tmp:
        for name, script, extra in (
                ("appo_e2e", "appo_async", ["--sampler-cores", *map(str, a.sampler_cores)]
                 if a.sampler_cores else []),
                ("ppo_e2e", "ppo_multigpu", [])):
            print(f"measuring {name} ...", flush=True)
            run_dir = Path(tmp) / name
            res[name] = run_e2e(script, flags + extra, a, device.type == "cuda", run_dir)
            if name == "appo_e2e":
                res[name]["steady"] = appo_e2e_details(run_dir)
            print(f"  {res[name]['steady_sps'] or 0:,.0f} steps/s"
                  + (f"  error: {res[name]['error']}" if "error" in res[name] else ""), flush=True)
    res["load_average_after"] = os.getloadavg()
    res["ratios"] = ratios(res)


def ratios(res: dict) -> dict:
    s, lrn = res["sampling_alone"]["steps_per_s"], res["learning_alone"]["steps_per_s"]
    appo, ppo = res["appo_e2e"].get("steady_sps"), res["ppo_e2e"].get("steady_sps")
    steady, secs = res["appo_e2e"].get("steady", {}), res["appo_e2e"].get("steady_seconds")
    r = {"min_rate": min(s, lrn), "harmonic_bound": 1 / (1 / s + 1 / lrn),
         "appo_over_min": appo / min(s, lrn) if appo else None,
         "appo_over_ppo": appo / ppo if appo and ppo else None,
         "sampler_wait_share": steady["sampler_wait_s"] / secs if steady and secs else None,
         "learner_wait_share": steady["learner_wait_s"] / secs if steady and secs else None,
         "policy_lag_mean": steady.get("policy_lag_mean")}
    if steady and appo:  # the same two rates inside the APPO run, under the load of that moment
        steps = res["appo_e2e"]["steady_steps"]
        r["in_run_sampling"] = steps / steady["sampler_busy_s"]
        r["in_run_learning"] = steps / steady["learn_s"]
        r["appo_over_in_run_min"] = appo / min(r["in_run_sampling"], r["in_run_learning"])
    return r


def report(res: dict, a) -> str:
    """The markdown table of res (its measurements and ratios)."""
    r, learner_cores = res["ratios"], res["split"]["learner_cores"]
    s, lrn = res["sampling_alone"]["steps_per_s"], res["learning_alone"]["steps_per_s"]
    appo, ppo = res["appo_e2e"].get("steady_sps"), res["ppo_e2e"].get("steady_sps")
    p = lambda x: "n/a" if x is None else f"{100 * x:.0f}%"  # noqa: E731
    split = (f"sampler on cores {list(a.sampler_cores)}, learner on {learner_cores}"
             if a.sampler_cores else "no pinning")
    rows = [("measurement", "steps/s", "notes"),
            (f"sampling alone ({a.num_envs} envs x {a.num_steps}, APPO network)", fmt(s), split),
            ("learning alone (APPO update, 4 epochs x 4 minibatches)", fmt(lrn), split),
            ("APPO end to end", fmt(appo),
             f"APPO / min = {r['appo_over_min']:.2f} (>= 0.9)" if appo else "failed"),
            ("", "", f"sampler waited {p(r['sampler_wait_share'])}, learner waited "
                     f"{p(r['learner_wait_share'])}, mean policy lag "
                     + (f"{r['policy_lag_mean']:.2f}" if r["policy_lag_mean"] is not None
                        else "n/a")),
            ("", "", "in the same run: sampler busy at {} steps/s, learner at {} steps/s; APPO / "
                     "min = {}".format(fmt(r.get("in_run_sampling")), fmt(r.get("in_run_learning")),
                                       f"{r['appo_over_in_run_min']:.2f}"
                                       if "appo_over_in_run_min" in r else "n/a")),
            ("PPO end to end (synchronous, not pinned)", fmt(ppo),
             f"APPO / PPO = {r['appo_over_ppo']:.2f}; PPO's bound from the split rates "
             f"1/(1/S + 1/L) = {fmt(r['harmonic_bound'])}" if r["appo_over_ppo"] else "failed")]
    return table(rows, res, f"; load average {res['load_average_before'][0]:.1f} before, "
                 f"{res['load_average_after'][0]:.1f} after. End to end: steady state over "
                 f"iterations 2+ ({a.e2e_seconds:g} s).")
