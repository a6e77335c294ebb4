"""The dqn and dqn-async parts of benchmarks/throughput.py (one JSON:
throughput-dqn-<host>-<device>.json).

More: docs/benchmarks.md, `benchmarks/throughput_parts/dqn.py`.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch

from benchmarks.throughput_parts.measure import ROOT, e2e_shares, fmt, load_algo, per_call, \
    drain, run_e2e, scalar_series, sync, table, timed
from common import envs, replay_shard
from common.grad_step import AllReduceStep
from common.replay import Replay

STEM = "throughput-dqn"
PARTS = ("dqn", "dqn-async")
E2E_REPLAY = 200_000  # the end-to-end runs' replay (the overlap's: at most --dqn.replay-size)
E2E_FLAGS = ["--learning-starts", "2048", "--eval-interval", "0"]


@dataclass
class Args:
    """the dqn part"""
    replay_size: int = 1_000_000
    """transitions in the full buffer sampled from (Nature: 1M)"""
    num_envs: int = 16
    """environment columns of the buffer, and envs of the end-to-end run (dqn_multigpu default)"""
    batch_size: int = 512
    """sample and update batch (the paper's DQN-512)"""
    n_step: int = 3
    """n-step returns computed at sample time (eps-Rainbow: 3)"""
    samples: int = 20
    """timed batches per sampling measurement, after one warm-up"""
    seconds: float = 10.0
    """timed seconds per learner measurement, after one warm-up update"""
    e2e_seconds: float = 60.0
    """seconds the end-to-end run trains after its first progress line"""
    e2e: bool = True
    """run dqn_multigpu.py end to end (--dqn.no-e2e skips)"""
    sampler_cores: tuple[int, ...] = (0,)
    """cores for the sampler process in the overlap measurement; the learner gets the others.
    Empty: no pinning (use on a GPU machine)"""
    replay_ratio: float = 8.0
    """replay ratio of the overlap measurement: learning alone and its end-to-end run"""


def fill_buffer(replay: Replay, seed: int, chunk: int = 128) -> float:
    """Fill every row with synthetic frames (ALE-like zero-padded starts, an episode end about
    every 1,000 steps); returns the seconds it took. One chunk of frames is reused."""
    g = torch.Generator().manual_seed(seed)
    B, dev = replay.B, replay.device
    frames = torch.randint(0, 256, (chunk + 3, B, 84, 84), generator=g, dtype=torch.uint8)
    obs = torch.stack([frames[t:t + 4].transpose(0, 1) for t in range(chunk)]).to(dev)
    terminated = (torch.rand(chunk, B, generator=g) < 1e-3).to(dev)
    truncated = torch.zeros_like(terminated)
    rewards = torch.randn(chunk, B, generator=g).sign().to(dev)
    actions = torch.randint(0, 6, (chunk, B), generator=g).to(dev)
    sync(dev)  # the copies above are not part of the fill
    t0 = time.perf_counter()
    while replay.steps < replay.T:  # every row written (then history of the oldest is gone)
        replay.add(obs, actions, rewards, terminated, truncated, obs[-1], None)
    sync(dev)
    return time.perf_counter() - t0


def time_sampling(replay: Replay, a, device: torch.device) -> dict:
    return {"seconds_per_batch": per_call(lambda: replay.sample(a.batch_size, beta=0.4),
                                          a.samples, device),
            "batches": a.samples}


def time_learner(dqn, batch: dict, a, device: torch.device, preset: str) -> dict:
    dargs = dqn.Args(**dqn.PRESETS[preset])
    torch.manual_seed(a.seed)
    model = dqn.QNetwork(6, dargs.dueling).to(device)
    target = dqn.QNetwork(6, dargs.dueling).to(device)
    step = AllReduceStep(model, dqn.make_optimizer(model, dargs), dargs.max_grad_norm)
    r = timed(lambda: dqn.dqn_update(model, target, step, batch, dargs), 1, a.seconds, device)
    return {"updates_per_s": r["steps_per_s"], "updates": r["steps"], "seconds": r["seconds"],
            "double": dargs.double, "dueling": dargs.dueling}


def run(res: dict, a, parts: set[str], device: torch.device, num_actions: int) -> None:
    """Measure the chosen parts into res, with their ratios."""
    if "dqn" in parts:
        measure_dqn(res, a, device)
    if "dqn-async" in parts:
        overlap(res, a, device, num_actions)


def measure_dqn(res: dict, a, device: torch.device) -> None:
    """The replay, the learners and the plain end-to-end run, and the sampling/update ratios."""
    dqn = load_algo("dqn_multigpu")
    replay = Replay(a.replay_size, a.num_envs, device, n_step=a.n_step, prioritized=True)
    res["replay_bytes_per_transition"] = {
        "prioritized": replay.bytes_per_transition(),
        "uniform": replay.bytes_per_transition() - replay.tree.tree.numel() * 8 / a.replay_size,
        "full_stacks_for_comparison": 4 * 84 * 84}
    print(f"replay bytes per transition: {res['replay_bytes_per_transition']}", flush=True)
    print(f"filling {a.replay_size:,} transitions ...", flush=True)
    res["fill_seconds"] = fill_buffer(replay, a.seed)
    res["replay_transitions"] = replay.num_valid()
    res["sample_prioritized"] = time_sampling(replay, a, device)
    batch = replay.sample(a.batch_size)
    tree, replay.tree = replay.tree, None  # the same data, sampled uniformly
    res["sample_uniform"] = time_sampling(replay, a, device)
    replay.tree = tree
    for k in ("sample_prioritized", "sample_uniform"):
        print(f"  {k}: {1e3 * res[k]['seconds_per_batch']:.2f} ms per batch of "
              f"{a.batch_size}", flush=True)
    del replay, tree  # free the buffer before the learner and the end-to-end run

    batch["actions"] = batch["actions"] % 6
    for preset in ("dqn-512", "eps-rainbow-512"):
        print(f"measuring learner ({preset}) ...", flush=True)
        res[f"learner_{preset}"] = time_learner(dqn, batch, a, device, preset)
        print(f"  {res[f'learner_{preset}']['updates_per_s']:.2f} updates/s", flush=True)
    update_s = 1 / res["learner_dqn-512"]["updates_per_s"]
    res["sample_over_update"] = {k: res[f"sample_{k}"]["seconds_per_batch"] / update_s
                                 for k in ("uniform", "prioritized")}

    if a.e2e:
        with tempfile.TemporaryDirectory(prefix="accelrl-bench-") as tmp:
            print("measuring dqn_multigpu end to end ...", flush=True)
            res["dqn_e2e"] = run_e2e("dqn_multigpu", ["--num-envs", str(a.num_envs), *E2E_FLAGS,
                                                      "--replay-size", str(E2E_REPLAY)],
                                     a, device.type == "cuda", Path(tmp) / "dqn")
            print(f"  {fmt(res['dqn_e2e']['steady_sps'])} steps/s", flush=True)


def sampling_alone(dqn, a, device: torch.device, num_actions: int) -> dict:
    """Steps per second from the sampler process when nobody learns: buffers go straight back."""
    from common.async_sampler import AsyncSampler
    from common.exploration import Explorer, act
    from common.replay_feed import make_explorer

    torch.manual_seed(a.seed)
    explorer = Explorer(dqn.QNetwork(num_actions), a.num_envs).to(device)
    env_kwargs = dict(env_id=a.env_id, num_envs=a.num_envs, num_threads=len(a.sampler_cores))
    steps = dqn.Args().num_steps
    sampler = AsyncSampler(partial(make_explorer, partial(dqn.QNetwork, num_actions), a.num_envs,
                                   "forward", False), act, None, env_kwargs, steps,
                           envs.env_seeds(a.seed, 0, a.num_envs), explorer, device, seed=a.seed,
                           cores=list(a.sampler_cores), threads=max(1, len(a.sampler_cores)),
                           final_obs=True)
    return drain(sampler, a.num_envs * steps, a.seconds)


def learning_alone(dqn, a, device: torch.device) -> dict:
    """Steps per second the learner consumes: each rollout of num_envs x 4 (random frames)
    appended to a filled replay of the end-to-end run's size, then the updates the ratio asks for
    (dqn-512: one update of 512 per 64 steps), sampled and taken on the device."""
    dargs = dqn.Args(batch_size=a.batch_size, replay_ratio=a.replay_ratio)
    T, B = dargs.num_steps, a.num_envs
    replay = Replay(min(a.replay_size, E2E_REPLAY), B, device, n_step=dargs.n_step,
                    gamma=dargs.gamma)
    fill_buffer(replay, a.seed)
    g = torch.Generator().manual_seed(a.seed)
    rollout = [t.to(device) for t in (
        torch.randint(0, 256, (T, B, 4, 84, 84), generator=g, dtype=torch.uint8),
        torch.randint(0, 6, (T, B), generator=g), torch.randn(T, B, generator=g).sign(),
        torch.zeros(T, B, dtype=torch.bool), torch.zeros(T, B, dtype=torch.bool),
        torch.randint(0, 256, (B, 4, 84, 84), generator=g, dtype=torch.uint8))]
    torch.manual_seed(a.seed)
    model, target = dqn.QNetwork(6).to(device), dqn.QNetwork(6).to(device)
    step = AllReduceStep(model, dqn.make_optimizer(model, dargs), dargs.max_grad_norm)
    counters = replay_shard.counters(dargs, None)

    def learn():  # as dqn_multigpu.py's loop, less the sampling
        replay.add(*rollout, None)
        for _ in range(replay_shard.updates_due(counters, dargs, T * B, 1)):
            dqn.dqn_update(model, target, step, replay.sample(dargs.batch_size, 0.4, device),
                           dargs)

    return {**timed(learn, T * B, a.seconds, device), "replay_ratio": dargs.replay_ratio}


def in_run_rates(run_dir: Path, steps: int) -> dict:
    """The sampler's and the learner's busy seconds over the run's log points 2+ (no start-up),
    from its TensorBoard scalars, and the rates they imply for its steady steps."""
    tags = ("time/env", "time/inference", "time/learn", "time/sampler_wait", "time/learner_wait")
    series = scalar_series(run_dir, tags)
    points = sorted(series.get("time/learn", {}))[1:]
    if not points or not all(t in series for t in tags):
        return {}
    total = {t: sum(series[t][p] for p in points) for t in tags}
    busy = total["time/env"] + total["time/inference"]
    return {"log_points": len(points), "sampler_busy_s": busy, "learn_s": total["time/learn"],
            "sampler_wait_s": total["time/sampler_wait"],
            "learner_wait_s": total["time/learner_wait"],
            "in_run_sampling": steps / busy, "in_run_learning": steps / total["time/learn"]}


def overlap(res: dict, a, device: torch.device, num_actions: int) -> None:
    """--async-sampling under the split of --dqn.sampler-cores: each side alone, then end to end."""
    dqn = load_algo("dqn_multigpu")
    if str(ROOT / "algos") not in sys.path:  # the sampler process unpickles QNetwork by name
        sys.path.insert(0, str(ROOT / "algos"))
    allowed = os.sched_getaffinity(0)
    learner_cores = sorted(allowed - set(a.sampler_cores)) if a.sampler_cores else []
    res["split"] = {"sampler_cores": list(a.sampler_cores), "learner_cores": learner_cores}
    print(f"split {res['split']}\nmeasuring DQN sampling alone ...", flush=True)
    threads = torch.get_num_threads()
    try:
        if learner_cores:
            os.sched_setaffinity(0, learner_cores)  # this process only hands buffers back
        res["sampling_alone"] = sampling_alone(dqn, a, device, num_actions)
        print(f"  {res['sampling_alone']['steps_per_s']:,.0f} steps/s\nmeasuring DQN learning "
              "alone ...", flush=True)
        if learner_cores:
            torch.set_num_threads(len(learner_cores))  # as common.async_sampler.pin sets it
        res["learning_alone"] = learning_alone(dqn, a, device)
    finally:  # the parts measured after this one get the whole machine back
        torch.set_num_threads(threads)
        os.sched_setaffinity(0, allowed)
    print(f"  {res['learning_alone']['steps_per_s']:,.0f} steps/s", flush=True)
    with tempfile.TemporaryDirectory(prefix="accelrl-bench-") as tmp:
        print("measuring dqn_multigpu --async-sampling end to end ...", flush=True)
        cores = ["--sampler-cores", *map(str, a.sampler_cores)] if a.sampler_cores else []
        e = res["dqn_async_e2e"] = run_e2e(
            "dqn_multigpu", ["--num-envs", str(a.num_envs), *E2E_FLAGS, "--replay-size",
                             str(min(a.replay_size, E2E_REPLAY)), "--batch-size",
                             str(a.batch_size), "--replay-ratio", str(a.replay_ratio),
                             "--async-sampling", *cores], a, device.type == "cuda",
            Path(tmp) / "dqn")
        if e["steady_sps"]:
            e["steady"] = in_run_rates(Path(tmp) / "dqn", e["steady_steps"])
        print(f"  {fmt(e['steady_sps'])} steps/s", flush=True)
    s, lrn = res["sampling_alone"]["steps_per_s"], res["learning_alone"]["steps_per_s"]
    e2e, steady = e["steady_sps"], e.get("steady", {})
    res["overlap"] = {"min_rate": min(s, lrn), "plain_bound": 1 / (1 / s + 1 / lrn),
                      "async_over_min": e2e / min(s, lrn) if e2e else None,
                      "async_over_in_run_min": e2e / min(steady["in_run_sampling"],
                                                         steady["in_run_learning"])
                      if steady else None}


def report(res: dict, a) -> str:
    """The markdown table of res."""
    b, rows = a.batch_size, [("measurement", "value", "notes")]
    for k in ("uniform", "prioritized") if "sample_over_update" in res else ():
        rows.append((f"sample a batch of {b}, {k}, from {res['replay_transitions']:,} "
                     "transitions", f"{1e3 * res[f'sample_{k}']['seconds_per_batch']:.1f} ms",
                     f"{100 * res['sample_over_update'][k]:.1f}% of a DQN update (< 10%)"))
    if rb := res.get("replay_bytes_per_transition"):
        rows.insert(1, ("replay bytes per transition", f"{rb['uniform']:,.0f} "
                        f"({rb['prioritized']:,.0f} prioritized)",
                        f"full 4-frame stacks: {rb['full_stacks_for_comparison']:,}"))
    for preset in ("dqn-512", "eps-rainbow-512") if "learner_dqn-512" in res else ():
        r = res[f"learner_{preset}"]
        rows.append((f"learner, batch {b}, {preset} (double {r['double']}, dueling "
                     f"{r['dueling']})", f"{r['updates_per_s']:.2f} updates/s",
                     f"{r['updates_per_s'] * b:,.0f} samples/s"))
    if e := res.get("dqn_e2e"):
        rows.append((f"dqn_multigpu end to end, {a.num_envs} envs, batch {b}, replay ratio 8",
                     f"{fmt(e['steady_sps'])} steps/s", e2e_shares(e)))
    if o := res.get("overlap"):
        split = (f"sampler on cores {res['split']['sampler_cores']}, learner on "
                 f"{res['split']['learner_cores']}" if a.sampler_cores else "no pinning")
        e, steady = res["dqn_async_e2e"], res["dqn_async_e2e"].get("steady", {})
        secs = e.get("steady_seconds")
        share = lambda k: f"{100 * steady[k] / secs:.0f}%" if steady and secs else "n/a"  # noqa
        rows += [(f"sampling alone ({a.num_envs} envs x 4, DQN network, sampler process)",
                  f"{fmt(res['sampling_alone']['steps_per_s'])} steps/s", split),
                 (f"learning alone (append to the replay, batch {b}, replay ratio "
                  f"{a.replay_ratio:g})",
                  f"{fmt(res['learning_alone']['steps_per_s'])} steps/s", split),
                 ("dqn_multigpu --async-sampling end to end", f"{fmt(e['steady_sps'])} steps/s",
                  f"async / min = {o['async_over_min']:.2f} (>= 0.9); plain bound 1/(1/S + 1/L)"
                  f" = {fmt(o['plain_bound'])}" if o["async_over_min"] else "failed"),
                 ("", "", f"sampler waited {share('sampler_wait_s')}, learner waited "
                          f"{share('learner_wait_s')}; in the same run: sampler busy at "
                          f"{fmt(steady.get('in_run_sampling'))} steps/s, learner at "
                          f"{fmt(steady.get('in_run_learning'))}: async / min = "
                          + (f"{o['async_over_in_run_min']:.2f}" if o["async_over_in_run_min"]
                             else "n/a"))]
    return table(rows, res)
