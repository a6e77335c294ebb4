"""Throughput of the DQN family's parts on this machine (sibling of throughput.py).

Measured in one run:
  1. replay bytes   - bytes per transition of common/replay.py's storage at --replay-size (frames
                      and per-step fields, plus the sum tree when prioritized), from its tensors.
  2. replay sample  - seconds to sample a batch of --batch-size from a full buffer of
                      --replay-size transitions: stacks rebuilt, n-step returns computed,
                      prioritized (sum tree) and uniform. One buffer serves both: uniform is
                      timed on the same data with the tree set aside, so only one buffer's memory
                      is held (1M transitions = 7.1 GB).
  3. learner        - dqn_update steps/s at --batch-size, DQN (dqn-512) and double+dueling
                      (eps-rainbow-512), on a batch already sampled on the device.
  4. end to end     - algos/dqn_multigpu.py with its defaults (16 envs x 4 steps, batch 512,
                      replay ratio 8) but --learning-starts 2048, so learning is on from the
                      first progress line, run as a subprocess and stopped with SIGINT after
                      --e2e-seconds (throughput.py's run_e2e).

Target (issue 6): sampling a batch takes under 10% of one update on the same device.

Run:
    python benchmarks/throughput_dqn.py                       # GPU if there is one
    python benchmarks/throughput_dqn.py --no-cuda --replay-size 200000   # a smaller buffer
"""

from __future__ import annotations

import json
import os
import re
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as the training scripts set it
import torch  # noqa: E402
import tyro  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]
import throughput  # noqa: E402  # hardware line, end-to-end runner, load_algo
from common.replay import Replay  # noqa: E402

dqn = throughput.load_algo("dqn_multigpu")


@dataclass
class Args:
    env_id: str = "Pong-v5"
    """game for the end-to-end run"""
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
    cuda: bool = True
    """use the GPU when one exists; --no-cuda forces the CPU"""
    torch_threads: int = 0
    """torch CPU threads; 0 keeps torch's default, like the training scripts"""
    seed: int = 1
    """seed for the synthetic buffer, the networks and the end-to-end run"""
    e2e: bool = True
    """run dqn_multigpu.py end to end (--no-e2e skips)"""
    out: str | None = None
    """JSON output; default benchmarks/results/throughput-dqn-<host>-<device>.json"""


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
    t0 = time.perf_counter()
    while replay.steps < replay.T:  # every row written (then history of the oldest is gone)
        replay.add(obs, actions, rewards, terminated, truncated, obs[-1], None)
    return time.perf_counter() - t0


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_sampling(replay: Replay, args: Args, device: torch.device) -> dict:
    replay.sample(args.batch_size)  # warm-up
    sync(device)
    t0 = time.perf_counter()
    for _ in range(args.samples):
        replay.sample(args.batch_size, beta=0.4)
    sync(device)
    return {"seconds_per_batch": (time.perf_counter() - t0) / args.samples,
            "batches": args.samples}


def time_learner(batch: dict, args: Args, device: torch.device, preset: str) -> dict:
    dargs = dqn.Args(**dqn.PRESETS[preset])
    torch.manual_seed(args.seed)
    model = dqn.QNetwork(6, dargs.dueling).to(device)
    target = dqn.QNetwork(6, dargs.dueling).to(device)
    optimizer = dqn.make_optimizer(model, dargs)
    r = throughput.timed(lambda: dqn.dqn_update(model, target, optimizer, batch, dargs), 1,
                         args.seconds, device)
    return {"updates_per_s": r["steps_per_s"], "updates": r["steps"], "seconds": r["seconds"],
            "double": dargs.double, "dueling": dargs.dueling}


def main() -> None:
    args = tyro.cli(Args)
    if args.torch_threads:
        torch.set_num_threads(args.torch_threads)
    device = torch.device("cuda" if args.cuda and torch.cuda.is_available() else "cpu")
    res: dict = {"hardware": throughput.hardware(device), "device": str(device),
                 "args": asdict(args)}
    print(f"hardware: {res['hardware']['line']}", flush=True)

    replay = Replay(args.replay_size, args.num_envs, device, n_step=args.n_step, prioritized=True)
    res["replay_bytes_per_transition"] = {
        "prioritized": replay.bytes_per_transition(),
        "uniform": replay.bytes_per_transition() - replay.tree.tree.numel() * 8 / args.replay_size,
        "full_stacks_for_comparison": 4 * 84 * 84}
    print(f"replay bytes per transition: {res['replay_bytes_per_transition']}", flush=True)
    print(f"filling {args.replay_size:,} transitions ...", flush=True)
    res["fill_seconds"] = fill_buffer(replay, args.seed)
    res["replay_transitions"] = replay.num_valid()
    res["sample_prioritized"] = time_sampling(replay, args, device)
    batch = replay.sample(args.batch_size)
    tree, replay.tree = replay.tree, None  # the same data, sampled uniformly
    res["sample_uniform"] = time_sampling(replay, args, device)
    replay.tree = tree
    for k in ("sample_prioritized", "sample_uniform"):
        print(f"  {k}: {1e3 * res[k]['seconds_per_batch']:.2f} ms per batch of "
              f"{args.batch_size}", flush=True)
    del replay, tree  # free the buffer before the learner and the end-to-end run

    batch["actions"] = batch["actions"] % 6
    for preset in ("dqn-512", "eps-rainbow-512"):
        print(f"measuring learner ({preset}) ...", flush=True)
        res[f"learner_{preset}"] = time_learner(batch, args, device, preset)
        print(f"  {res[f'learner_{preset}']['updates_per_s']:.2f} updates/s", flush=True)
    update_s = 1 / res["learner_dqn-512"]["updates_per_s"]
    res["sample_over_update"] = {k: res[f"sample_{k}"]["seconds_per_batch"] / update_s
                                 for k in ("uniform", "prioritized")}

    if args.e2e:
        with tempfile.TemporaryDirectory(prefix="accelrl-bench-") as tmp:
            e2e_args = throughput.Args(env_id=args.env_id, seed=args.seed,
                                       e2e_seconds=args.e2e_seconds,
                                       torch_threads=args.torch_threads)
            print("measuring dqn_multigpu end to end ...", flush=True)
            res["dqn_e2e"] = throughput.run_e2e(
                "dqn_multigpu", ["--num-envs", str(args.num_envs), "--learning-starts", "2048",
                                 "--eval-interval", "0", "--replay-size", "200000"],
                e2e_args, device.type == "cuda", Path(tmp) / "dqn")
            print(f"  {throughput.fmt(res['dqn_e2e']['steady_sps'])} steps/s", flush=True)

    b, rows = args.batch_size, [("measurement", "value", "notes"), ("-", "-", "-")]
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
        share = e.get("phase_share") or {}
        rows.append((f"dqn_multigpu end to end, {args.num_envs} envs, batch {b}, replay ratio 8",
                     f"{throughput.fmt(e['steady_sps'])} steps/s",
                     ", ".join(f"{k} {100 * v:.0f}%" for k, v in share.items())))
    res["table_markdown"] = "\n".join("| " + " | ".join(r) + " |" for r in rows) + (
        f"\n\nHardware: {res['hardware']['line']}; device {res['device']}.")
    print("\n" + res["table_markdown"])
    host = re.sub(r"[^A-Za-z0-9_.-]", "_", res["hardware"]["host"])
    out = Path(args.out or ROOT / f"benchmarks/results/throughput-dqn-{host}-{device.type}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=2, default=str))
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
