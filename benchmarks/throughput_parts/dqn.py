"""The dqn part of benchmarks/throughput.py (JSON: throughput-dqn-<host>-<device>.json).

  1. replay bytes   - bytes per transition of common/replay.py's storage at --dqn.replay-size
                      (frames and per-step fields, plus the sum tree when prioritized), from its
                      tensors.
  2. replay sample  - seconds to sample a batch of --dqn.batch-size from a full buffer of
                      --dqn.replay-size transitions: stacks rebuilt, n-step returns computed,
                      prioritized (sum tree) and uniform. One buffer serves both: uniform is
                      timed on the same data with the tree set aside, so only one buffer's memory
                      is held (1M transitions = 7.1 GB).
  3. learner        - dqn_update steps/s at --dqn.batch-size, DQN (dqn-512) and double+dueling
                      (eps-rainbow-512), on a batch already sampled on the device.
  4. end to end     - algos/dqn_multigpu.py with its defaults (16 envs x 4 steps, batch 512,
                      replay ratio 8) but --learning-starts 2048, so learning is on from the
                      first progress line, stopped with SIGINT after --dqn.e2e-seconds.

Target: sampling a batch takes under 10% of one update on the same device.
"""

from __future__ import annotations

import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from benchmarks.throughput_parts.measure import e2e_shares, fmt, load_algo, per_call, run_e2e, \
    sync, table, timed
from common.replay import Replay

STEM = "throughput-dqn"
PARTS = ("dqn",)


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
    optimizer = dqn.make_optimizer(model, dargs)
    r = timed(lambda: dqn.dqn_update(model, target, optimizer, batch, dargs), 1, a.seconds,
              device)
    return {"updates_per_s": r["steps_per_s"], "updates": r["steps"], "seconds": r["seconds"],
            "double": dargs.double, "dueling": dargs.dueling}


def run(res: dict, a, parts: set[str], device: torch.device, num_actions: int) -> None:
    """Measure into res, then the sampling/update ratios and the table."""
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
            res["dqn_e2e"] = run_e2e(
                "dqn_multigpu", ["--num-envs", str(a.num_envs), "--learning-starts", "2048",
                                 "--eval-interval", "0", "--replay-size", "200000"],
                a, device.type == "cuda", Path(tmp) / "dqn")
            print(f"  {fmt(res['dqn_e2e']['steady_sps'])} steps/s", flush=True)


def report(res: dict, a) -> str:
    """The markdown table of res."""
    b, rows = a.batch_size, [("measurement", "value", "notes")]
    rb = res["replay_bytes_per_transition"]
    rows.append(("replay bytes per transition", f"{rb['uniform']:,.0f} ({rb['prioritized']:,.0f} "
                 "prioritized)", f"full 4-frame stacks: {rb['full_stacks_for_comparison']:,}"))
    for k in ("uniform", "prioritized"):
        rows.append((f"sample a batch of {b}, {k}, from {res['replay_transitions']:,} "
                     "transitions", f"{1e3 * res[f'sample_{k}']['seconds_per_batch']:.1f} ms",
                     f"{100 * res['sample_over_update'][k]:.1f}% of a DQN update (< 10%)"))
    for preset in ("dqn-512", "eps-rainbow-512"):
        r = res[f"learner_{preset}"]
        rows.append((f"learner, batch {b}, {preset} (double {r['double']}, dueling "
                     f"{r['dueling']})", f"{r['updates_per_s']:.2f} updates/s",
                     f"{r['updates_per_s'] * b:,.0f} samples/s"))
    if e := res.get("dqn_e2e"):
        rows.append((f"dqn_multigpu end to end, {a.num_envs} envs, batch {b}, replay ratio 8",
                     f"{fmt(e['steady_sps'])} steps/s", e2e_shares(e)))
    return table(rows, res)
