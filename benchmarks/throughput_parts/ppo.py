"""The ppo and a2c parts of benchmarks/throughput.py: the sampler, PPO's learner, and both
algorithms end to end (one JSON: throughput-<host>-<device>.json).

More: docs/benchmarks.md, `benchmarks/throughput_parts/ppo.py`.
"""

from __future__ import annotations

import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from benchmarks.throughput_parts.measure import (ROOT, e2e_shares, fmt, load_algo,
                                                 random_rollout, run_e2e, sync, table,
                                                 timed)
from common import envs
from common.grad_step import AllReduceStep
from common.sampler import Sampler

STEM = "throughput"
PARTS = ("ppo", "a2c")


@dataclass
class Args:
    """the ppo and a2c parts (written together to throughput-<host>-<device>.json)"""
    num_envs: int = 8
    """environments for the raw, sampler, learner and PPO measurements (PPO paper: 8 per GPU)"""
    num_steps: int = 128
    """steps per environment per rollout (PPO's default); the learner batch is num_envs x this"""
    seconds: float = 5.0
    """timed seconds per in-process measurement, after its warm-up (at least one rollout/update)"""
    e2e_seconds: float = 20.0
    """seconds each end-to-end run (PPO and A2C) trains after its first iteration"""
    a2c_num_envs: int = 16
    """environments for the A2C end-to-end runs (paper: 16 per GPU)"""
    raw: bool = True
    """measure raw environment steps/s and the trivial-policy sampler, interleaved (--ppo.no-raw)"""
    sampler: bool = True
    """measure the sampler with PPO's network, plain and alternating (--ppo.no-sampler skips)"""
    learner: bool = True
    """measure PPO's update on random data (--ppo.no-learner skips)"""
    e2e: bool = True
    """run PPO end to end, plain and alternating (--ppo.no-e2e skips)"""


def bench_raw_and_sampler(a, device: torch.device, num_actions: int) -> dict:
    """Raw env steps/s and the trivial-policy sampler's, on the same environments, in
    interleaved one-rollout blocks: a shared VM's speed drifts by 20% within seconds, so two
    separate timings would compare different machines. Rates use each side's median block."""
    env_groups = envs.make_envs(a.env_id, a.num_envs)
    e, T, n = env_groups[0], a.num_steps, a.num_envs
    sampler = Sampler(env_groups, T, device)
    sampler.reset(envs.env_seeds(a.seed, 0, n))
    rng = np.random.default_rng(a.seed)

    def raw():  # the sampler's next_obs goes stale meanwhile: harmless for a throughput test
        for _ in range(T):
            e.send(rng.integers(0, num_actions, n, dtype=np.int64))
            e.recv()

    def trivial():  # random actions, no network
        sampler.collect(lambda obs, _: (torch.randint(num_actions, (len(obs),), device=device), {}))

    raw(), trivial()  # warm-up
    times = {"raw": [], "trivial": []}
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < 2 * a.seconds or len(times["raw"]) < 5:
        order = (("raw", raw), ("trivial", trivial))
        for name, fn in order if len(times["raw"]) % 2 else order[::-1]:
            t = time.perf_counter()
            fn()
            sync(device)  # the trivial policy's last writes to the rollout belong to its block
            times[name].append(time.perf_counter() - t)
    e.close()
    raw_s, triv_s = (float(np.median(times[k])) for k in ("raw", "trivial"))
    ratios = np.array(times["raw"]) / np.array(times["trivial"])
    return {"raw_env": {"steps_per_s": T * n / raw_s, "blocks": len(times["raw"])},
            "sampler_trivial": {"steps_per_s": T * n / triv_s, "blocks": len(times["trivial"]),
                                "paired_ratio_median": float(np.median(ratios)),
                                "paired_ratio_quartiles": np.percentile(ratios, [25, 75]).tolist()}}


def bench_sampler(a, device: torch.device, groups: int, policy, value_fn=None,
                  extras: tuple[str, ...] = ()) -> dict:
    """Sampler.collect steps/s over num_envs environments in `groups` groups."""
    env_groups = envs.make_envs(a.env_id, a.num_envs, groups=groups)
    sampler = Sampler(env_groups, a.num_steps, device, extras=extras)
    sampler.reset(envs.env_seeds(a.seed, 0, a.num_envs))
    r = timed(lambda: sampler.collect(policy, value_fn), a.num_steps * a.num_envs, a.seconds,
              device)
    for e in env_groups:
        e.close()
    return {**r, "groups": groups}


def ppo_policy(ppo, num_actions: int, device: torch.device, seed: int):
    """(policy, value_fn, extras) with PPO's network and its own act()."""
    torch.manual_seed(seed)
    agent = ppo.Agent(num_actions).to(device)
    return (lambda obs, _: ppo.act(agent, obs)), (lambda o: agent(o)[1]), ("logprob", "value")


def bench_learner(a, ppo, device: torch.device, num_actions: int) -> dict:
    pargs = ppo.Args(num_envs=a.num_envs, num_steps=a.num_steps)
    n = a.num_envs * a.num_steps
    torch.manual_seed(a.seed)
    agent = ppo.Agent(num_actions).to(device)
    step = AllReduceStep(agent, torch.optim.Adam(agent.parameters(), lr=pargs.learning_rate,
                                                 eps=1e-5), pargs.max_grad_norm)
    batch = random_rollout(n, num_actions, device)
    r = timed(lambda: ppo.ppo_update(agent, step, batch, pargs), n, a.seconds, device)
    return {"epoch_samples_per_s": r["steps_per_s"] * pargs.update_epochs,
            "batch_samples_per_s": r["steps_per_s"], "batch_size": n, "updates": r["steps"] // n,
            "seconds": r["seconds"], "epochs": pargs.update_epochs,
            "minibatches": pargs.num_minibatches}


def measure(res: dict, name: str, fn, *args) -> None:
    print(f"measuring {name} ...", flush=True)
    res[name] = fn(*args)
    rate = res[name].get("steps_per_s") or res[name].get("steady_sps") or \
        res[name].get("epoch_samples_per_s")
    print(f"  {fmt(rate)}/s" + (f"  error: {res[name]['error']}" if "error" in res[name]
                                else ""), flush=True)


def run(res: dict, a, parts: set[str], device: torch.device, num_actions: int) -> None:
    """Measure the chosen parts of this family into res, then its ratios and table."""
    res["args"].update(ppo="ppo" in parts and a.e2e, a2c="a2c" in parts)  # the old switches
    res["env_threads"] = max(1, min(a.num_envs, os.cpu_count() or 1))  # as make_envs
    if "ppo" in parts:
        ppo = load_algo("ppo_multigpu")
        if a.raw:
            print("measuring raw_env and sampler_trivial (interleaved) ...", flush=True)
            res.update(bench_raw_and_sampler(a, device, num_actions))
            print(f"  raw {fmt(res['raw_env']['steps_per_s'])}/s, trivial sampler "
                  f"{fmt(res['sampler_trivial']['steps_per_s'])}/s", flush=True)
        if a.sampler:
            for groups, name in ((1, "sampler_ppo_plain"), (2, "sampler_ppo_alternating")):
                measure(res, name, bench_sampler, a, device, groups,
                        *ppo_policy(ppo, num_actions, device, a.seed))
        if a.learner:
            measure(res, "learner", bench_learner, a, ppo, device, num_actions)
    runs = {"ppo": ["--num-envs", str(a.num_envs), "--num-steps", str(a.num_steps)],
            "a2c": ["--num-envs", str(a.a2c_num_envs)]}
    with tempfile.TemporaryDirectory(prefix="accelrl-bench-") as tmp:
        for key, flags in runs.items():
            if not res["args"][key]:
                continue
            if not (ROOT / "algos" / f"{key}_multigpu.py").is_file():
                res[f"{key}_e2e"] = {"skipped": f"algos/{key}_multigpu.py does not exist"}
                continue
            for alt, flag in (("plain", "--no-alternate"), ("alternating", "--alternate")):
                measure(res, f"{key}_e2e_{alt}", run_e2e, f"{key}_multigpu", flags + [flag], a,
                        device.type == "cuda", Path(tmp) / f"{key}_{alt}")
    res["ratios"] = ratios(res)


def rates(res: dict) -> dict[str, float]:
    return {k: v["steps_per_s"] for k, v in res.items()
            if isinstance(v, dict) and "steps_per_s" in v}


def ratios(res: dict) -> dict:
    """sampler/raw, and PPO's bound and end to end over it."""
    rate, r, lr = rates(res), {}, res.get("learner")
    if "sampler_trivial" in res:  # paired blocks: see bench_raw_and_sampler
        r["sampler_trivial_over_raw"] = res["sampler_trivial"]["paired_ratio_median"]
    for alt in ("plain", "alternating"):
        if lr and f"sampler_ppo_{alt}" in rate:  # learning seconds per step: epochs / learner
            r[f"ppo_bound_{alt}"] = 1 / (1 / rate[f"sampler_ppo_{alt}"]
                                         + lr["epochs"] / lr["epoch_samples_per_s"])
            if res.get(f"ppo_e2e_{alt}", {}).get("steady_sps"):
                r[f"ppo_e2e_over_bound_{alt}"] = (res[f"ppo_e2e_{alt}"]["steady_sps"]
                                                  / r[f"ppo_bound_{alt}"])
    return r


def report(res: dict, a) -> str:
    """The markdown table of res (its measurements and ratios)."""
    rate, r, lr = rates(res), res["ratios"], res.get("learner")
    n, q = a.num_envs, r.get("sampler_trivial_over_raw")
    rows = [("measurement", "steps/s", "ratio (target), notes")]
    if "raw_env" in rate:
        rows.append((f"raw env, {n} envs, {res['env_threads']} threads, random actions",
                     fmt(rate["raw_env"]), ""))
    if "sampler_trivial" in rate:
        spread = res["sampler_trivial"].get("paired_ratio_quartiles")  # older results lack it
        rows.append((f"sampler, trivial policy, {n} envs x {a.num_steps} steps",
                     fmt(rate["sampler_trivial"]),
                     (f"sampler/raw = {q:.2f} (>= 0.95), median of paired blocks"
                      + (", quartiles {:.2f}-{:.2f}".format(*spread) if spread else ""))
                     if q else ""))
    for alt in ("plain", "alternating"):
        if f"sampler_ppo_{alt}" in rate:
            rows.append((f"sampler, PPO network, {alt}", fmt(rate[f"sampler_ppo_{alt}"]), ""))
    if lr:
        rows.append((f"learner, PPO update, batch {lr['batch_size']}, {lr['epochs']} epochs x "
                     f"{lr['minibatches']} minibatches", f"{fmt(lr['epoch_samples_per_s'])} "
                     f"epoch-samples/s ({fmt(lr['batch_samples_per_s'])} batch/s)", ""))
    for key, label in (("ppo", f"PPO, {n} envs"), ("a2c", f"A2C, {a.a2c_num_envs} envs")):
        if "skipped" in res.get(f"{key}_e2e", {}):
            rows.append((f"{label}, end to end", "skipped", res[f"{key}_e2e"]["skipped"]))
        for alt in ("plain", "alternating"):
            if (e := res.get(f"{key}_e2e_{alt}")) is None:
                continue
            notes = []
            if f"{key}_bound_{alt}" in r:
                ratio = r.get(f"{key}_e2e_over_bound_{alt}")
                notes.append((f"e2e/bound = {ratio:.2f} (>= 0.85)" if ratio else "e2e failed")
                             + f", bound {fmt(r[f'{key}_bound_{alt}'])}"
                             + (" (alternating sampler)" if alt == "alternating" else ""))
            if share := e.get("phase_share"):
                top = max((k for k in share if k != "other"), key=share.get)
                notes.append(f"time: {e2e_shares(e)}; limited by {top}")
            whole = e.get("summary", {}).get("sps")
            rows.append((f"{label}, end to end, {alt}", fmt(e["steady_sps"])
                         + (f" (summary.json {fmt(whole)})" if whole else ""), "; ".join(notes)))
    return table(rows, res, f". End-to-end steps/s: steady state over iterations 2+ "
                    f"({a.e2e_seconds:g} s); summary.json's sps also counts the first iteration "
                    "and the final checkpoint.")
