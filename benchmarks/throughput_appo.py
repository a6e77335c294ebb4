"""APPO's overlap of sampling and learning on this machine, beside synchronous PPO.

Measured in one run, on one rank, with the same per-rank settings (num_envs x num_steps):
  1. sampling alone  - common.async_sampler.AsyncSampler with APPO's network, its process pinned to
                       the sampler's cores; the learner side only hands buffers back
  2. learning alone  - appo_async.appo_update on a random rollout, pinned to the learner's cores
                       (the rest), central Adam with --num-chunks as the script's default
  3. APPO end to end - algos/appo_async.py --sampler-cores <the sampler's cores>
  4. PPO end to end  - algos/ppo_multigpu.py, same settings, not pinned (its best use of all the
                       cores: it samples and learns in turn)

Overlap needs resources that sampling and learning do not share. On a CPU-only machine that is
disjoint cores: the sampler's emulators and inference on --sampler-cores (default: core 0), the
learner's torch threads on the others. On a GPU machine pinning is off (--sampler-cores ''
behaviour: the GPU against the cores) unless you ask for it.

Targets: APPO e2e >= 0.9 x min(sampling, learning), each measured alone under the same split.
Synchronous PPO, which samples then learns, is bound by 1 / (1/sampling + 1/learning).
Shares of waiting (sampler waited for a free buffer, learner waited for a rollout) and the mean
policy lag come from APPO's TensorBoard scalars over iterations 2+ (no start-up). On a machine
shared with other work the rates drift between measurements, so the same two rates are also
taken inside the APPO run (steps over the sampler's busy seconds, env + inference, and over the
learner's), and APPO is compared with their minimum too.

Run:
    python benchmarks/throughput_appo.py --no-cuda                # about 4 minutes on 2 cores
    python benchmarks/throughput_appo.py --seconds 3 --e2e-seconds 10   # a quick check
"""

from __future__ import annotations

import json
import os
import re
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as the training scripts set it
import numpy as np  # noqa: E402
import torch  # noqa: E402
import tyro  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "algos"), str(ROOT / "benchmarks")]  # the sampler process
import appo_async  # noqa: E402  # imports these by name too, so they must be on its path
import throughput  # noqa: E402  # hardware line and end-to-end runner, shared with throughput.py
from common import envs  # noqa: E402
from common.async_sampler import AsyncSampler  # noqa: E402
from common.central_adam import CentralAdam  # noqa: E402


@dataclass
class Args:
    env_id: str = "Pong-v5"
    """game to measure"""
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
    cuda: bool = True
    """use the GPU when one exists; --no-cuda forces the CPU"""
    torch_threads: int = 0
    """OMP_NUM_THREADS for PPO's end-to-end run; 0 keeps torch's default (all cores)"""
    seed: int = 1
    """seed for environments, parameters and the random learner batch"""
    out: str | None = None
    """JSON output; default benchmarks/results/throughput-appo-<host>-<device>.json"""


def sampling_alone(args: Args, device: torch.device, num_actions: int) -> dict:
    """Rollouts per second from the sampler process when nobody trains: buffers go straight back."""
    torch.manual_seed(args.seed)
    agent = appo_async.Agent(num_actions).to(device)
    env_kwargs = dict(env_id=args.env_id, num_envs=args.num_envs,
                      num_threads=len(args.sampler_cores))
    sampler = AsyncSampler(partial(appo_async.Agent, num_actions), appo_async.act,
                           appo_async.value, env_kwargs, args.num_steps,
                           envs.env_seeds(args.seed, 0, args.num_envs), agent, device,
                           extras=("logprob", "value"), seed=args.seed,
                           cores=list(args.sampler_cores), threads=max(1, len(args.sampler_cores)))
    try:
        sampler.release(sampler.get()[0])  # warm-up: process start, first rollout
        t0, rollouts, waited = time.perf_counter(), 0, 0.0
        while time.perf_counter() - t0 < args.seconds:
            i, info = sampler.get()
            sampler.release(i)
            rollouts, waited = rollouts + 1, waited + info["sampler_wait"]
        elapsed = time.perf_counter() - t0
    finally:
        sampler.close()
    return {"steps_per_s": rollouts * args.num_envs * args.num_steps / elapsed,
            "rollouts": rollouts, "seconds": elapsed, "sampler_wait_share": waited / elapsed}


def learning_alone(args: Args, device: torch.device, num_actions: int) -> dict:
    """Environment steps per second the learner consumes: APPO's update on a random rollout."""
    pargs = appo_async.Args(num_envs=args.num_envs, num_steps=args.num_steps)
    n = args.num_envs * args.num_steps
    torch.manual_seed(args.seed)
    agent = appo_async.Agent(num_actions).to(device)
    central = CentralAdam(agent.parameters(), pargs.num_chunks, eps=1e-5)
    central.unlink()
    batch = {"obs": torch.randint(0, 256, (n, 4, 84, 84), dtype=torch.uint8, device=device),
             "actions": torch.randint(num_actions, (n,), device=device),
             "logprob": torch.full((n,), -float(np.log(num_actions)), device=device),
             "value": torch.randn(n, device=device), "advantages": torch.randn(n, device=device),
             "returns": torch.randn(n, device=device)}
    r = throughput.timed(lambda: appo_async.appo_update(agent, central, batch, pargs, 1e-4), n,
                         args.seconds, device)
    central.close()
    return {**r, "epochs": pargs.update_epochs, "minibatches": pargs.num_minibatches}


def appo_e2e_details(run_dir: Path) -> dict:
    """Waiting shares and policy lag over iterations 2+, from the run's TensorBoard scalars."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    series: dict[str, dict[int, float]] = {}
    for f in run_dir.glob("events.out.tfevents.*"):
        acc = EventAccumulator(str(f))
        acc.Reload()
        for tag in ("time/sampler_wait", "time/learner_wait", "time/learn", "time/env",
                    "time/inference", "charts/policy_lag_mean", "charts/policy_lag_max",
                    "charts/dropped_rollouts"):
            if tag in acc.Tags()["scalars"]:
                series.setdefault(tag, {}).update({e.step: e.value for e in acc.Scalars(tag)})
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


def main() -> None:
    args = tyro.cli(Args)
    device = torch.device("cuda" if args.cuda and torch.cuda.is_available() else "cpu")
    allowed = os.sched_getaffinity(0)
    learner_cores = sorted(allowed - set(args.sampler_cores)) if args.sampler_cores else []
    if args.sampler_cores and (not set(args.sampler_cores) <= allowed or not learner_cores):
        sys.exit(f"error: --sampler-cores {list(args.sampler_cores)} must be a strict subset of "
                 f"the usable cores {sorted(allowed)}")
    res: dict = {"hardware": throughput.hardware(device), "device": str(device),
                 "args": asdict(args), "split": {"sampler_cores": list(args.sampler_cores),
                                                 "learner_cores": learner_cores},
                 "load_average_before": os.getloadavg()}
    print(f"hardware: {res['hardware']['line']}; split {res['split']}", flush=True)
    probe = envs.make_envs(args.env_id, 1)[0]
    num_actions = probe.num_actions
    probe.close()

    print("measuring sampling alone ...", flush=True)
    if learner_cores:
        os.sched_setaffinity(0, learner_cores)  # this process only hands buffers back
    res["sampling_alone"] = sampling_alone(args, device, num_actions)
    print(f"  {res['sampling_alone']['steps_per_s']:,.0f} steps/s", flush=True)
    print("measuring learning alone ...", flush=True)
    threads = torch.get_num_threads()
    if learner_cores:
        torch.set_num_threads(len(learner_cores))  # as appo_async.py sets its learner
    res["learning_alone"] = learning_alone(args, device, num_actions)
    torch.set_num_threads(threads)
    os.sched_setaffinity(0, allowed)
    print(f"  {res['learning_alone']['steps_per_s']:,.0f} steps/s", flush=True)

    flags = ["--num-envs", str(args.num_envs), "--num-steps", str(args.num_steps)]
    with tempfile.TemporaryDirectory(prefix="accelrl-bench-") as tmp:
        for name, script, extra in (
                ("appo_e2e", "appo_async", ["--sampler-cores", *map(str, args.sampler_cores)]
                 if args.sampler_cores else []),
                ("ppo_e2e", "ppo_multigpu", [])):
            print(f"measuring {name} ...", flush=True)
            run_dir = Path(tmp) / name
            res[name] = throughput.run_e2e(script, flags + extra, args, device.type == "cuda",
                                           run_dir)
            if name == "appo_e2e":
                res[name]["steady"] = appo_e2e_details(run_dir)
            print(f"  {res[name]['steady_sps'] or 0:,.0f} steps/s"
                  + (f"  error: {res[name]['error']}" if "error" in res[name] else ""), flush=True)
    res["load_average_after"] = os.getloadavg()

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
    res["ratios"] = r
    f = lambda x: "n/a" if x is None else f"{x:,.0f}"  # noqa: E731
    p = lambda x: "n/a" if x is None else f"{100 * x:.0f}%"  # noqa: E731
    split = (f"sampler on cores {list(args.sampler_cores)}, learner on {learner_cores}"
             if args.sampler_cores else "no pinning")
    rows = [("measurement", "steps/s", "notes"), ("-", "-", "-"),
            (f"sampling alone ({args.num_envs} envs x {args.num_steps}, APPO network)", f(s),
             split),
            ("learning alone (APPO update, 4 epochs x 4 minibatches)", f(lrn), split),
            ("APPO end to end", f(appo),
             f"APPO / min = {r['appo_over_min']:.2f} (>= 0.9)" if appo else "failed"),
            ("", "", f"sampler waited {p(r['sampler_wait_share'])}, learner waited "
                     f"{p(r['learner_wait_share'])}, mean policy lag "
                     + (f"{r['policy_lag_mean']:.2f}" if r["policy_lag_mean"] is not None
                        else "n/a")),
            ("", "", "in the same run: sampler busy at {} steps/s, learner at {} steps/s; APPO / "
                     "min = {}".format(f(r.get("in_run_sampling")), f(r.get("in_run_learning")),
                                       f"{r['appo_over_in_run_min']:.2f}"
                                       if "appo_over_in_run_min" in r else "n/a")),
            ("PPO end to end (synchronous, not pinned)", f(ppo),
             f"APPO / PPO = {r['appo_over_ppo']:.2f}; PPO's bound from the split rates "
             f"1/(1/S + 1/L) = {f(r['harmonic_bound'])}" if r["appo_over_ppo"] else "failed")]
    table = "\n".join("| " + " | ".join(row) + " |" for row in rows)
    table += (f"\n\nHardware: {res['hardware']['line']}; device {res['device']}; load average "
              f"{res['load_average_before'][0]:.1f} before, {res['load_average_after'][0]:.1f} "
              f"after. End to end: steady state over iterations 2+ ({args.e2e_seconds:g} s).")
    res["table_markdown"] = table
    print("\n" + table)
    host = re.sub(r"[^A-Za-z0-9_.-]", "_", res["hardware"]["host"])
    out = Path(args.out or ROOT / f"benchmarks/results/throughput-appo-{host}-{device.type}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=2, default=str))
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
