"""Throughput of Categorical DQN's parts on this machine (sibling of throughput_dqn.py).

Measured in one run:
  1. projection  - seconds to project a batch of --batch-size target distributions onto the
                   support with cat_dqn.project (vectorised over the batch), against two
                   references written here: Algorithm 1 of Bellemare et al. 2017 one sample at a
                   time (a torch loop over samples, atoms vectorised) and one sample and one atom
                   at a time (Python floats). Outputs are checked equal before timing.
  2. learner     - c51_update steps/s at --batch-size (the paper's CatDQN-2K: 2048), plain
                   (catdqn-2k preset) and double+dueling+prioritized weights, on a batch already
                   sampled on the device; the projection's share of one update.
  3. end to end  - algos/cat_dqn.py with its defaults (16 envs x 16 steps, batch 2048, replay
                   ratio 8: one update an iteration) but --learning-starts 2048, so learning is on
                   from the first progress line, run as a subprocess and stopped with SIGINT after
                   --e2e-seconds (throughput.py's run_e2e).

Target (issue 7): the projection is a negligible share of an update at batch 2048.

Run:
    python benchmarks/throughput_cat_dqn.py                   # GPU if there is one
    python benchmarks/throughput_cat_dqn.py --no-cuda         # the CPU
"""

from __future__ import annotations

import json
import math
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


c51 = throughput.load_algo("cat_dqn")


@dataclass
class Args:
    env_id: str = "Pong-v5"
    """game for the end-to-end run"""
    batch_size: int = 2048
    """projection and update batch (the paper's CatDQN-2K)"""
    num_envs: int = 16
    """environments of the end-to-end run (cat_dqn default)"""
    repeats: int = 20
    """timed calls of the vectorised and per-sample projections, after one warm-up"""
    seconds: float = 20.0
    """timed seconds per learner measurement, after one warm-up update"""
    e2e_seconds: float = 180.0
    """seconds the end-to-end run trains after its first progress line (on a CPU, a progress
    line comes every 2,048 steps per rank: 8 updates at batch 2048)"""
    cuda: bool = True
    """use the GPU when one exists; --no-cuda forces the CPU"""
    torch_threads: int = 0
    """torch CPU threads; 0 keeps torch's default, like the training scripts"""
    seed: int = 1
    """seed for the synthetic batches, the networks and the end-to-end run"""
    e2e: bool = True
    """run cat_dqn.py end to end (--no-e2e skips)"""
    out: str | None = None
    """JSON output; default benchmarks/results/throughput-cat-dqn-<host>-<device>.json"""


def per_sample_projection(probs, returns, discounts, support):
    """Algorithm 1 one sample at a time (each sample's atoms vectorised), with its l == u case."""
    K, v_min, v_max = len(support), support[0], support[-1]
    dz = (v_max - v_min) / (K - 1)
    out = torch.zeros_like(probs)
    for i in range(len(probs)):
        b = ((returns[i] + discounts[i] * support).clamp(v_min, v_max) - v_min) / dz  # [K]
        lo, up = b.floor().long(), b.ceil().long()
        out[i].index_add_(0, lo, probs[i] * (up - b + (lo == up)))
        out[i].index_add_(0, up, probs[i] * (b - lo))
    return out


def per_atom_projection(probs, returns, discounts, v_min, v_max):
    """Algorithm 1 one sample and one atom at a time, in Python floats."""
    n, K = probs.shape
    dz = (v_max - v_min) / (K - 1)
    p, r, d = probs.tolist(), returns.tolist(), discounts.tolist()
    out = [[0.0] * K for _ in range(n)]
    for i in range(n):
        for j in range(K):
            b = (min(max(r[i] + d[i] * (v_min + j * dz), v_min), v_max) - v_min) / dz
            lo, up = math.floor(b), math.ceil(b)
            if lo == up:
                out[i][lo] += p[i][j]
            else:
                out[i][lo] += p[i][j] * (up - b)
                out[i][up] += p[i][j] * (b - lo)
    return torch.tensor(out)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_calls(fn, repeats: int, device: torch.device) -> float:
    fn()  # warm-up
    sync(device)
    t0 = time.perf_counter()
    for _ in range(repeats):
        fn()
    sync(device)
    return (time.perf_counter() - t0) / repeats


def synthetic_batch(n: int, num_actions: int, device: torch.device, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    batch = {"obs": torch.randint(0, 256, (n, 4, 84, 84), generator=g, dtype=torch.uint8),
             "next_obs": torch.randint(0, 256, (n, 4, 84, 84), generator=g, dtype=torch.uint8),
             "actions": torch.randint(0, num_actions, (n,), generator=g),
             "returns": torch.randn(n, generator=g).sign() * (torch.rand(n, generator=g) < 0.1),
             "discounts": (torch.rand(n, generator=g) > 0.01) * 0.99,
             "weights": torch.rand(n, generator=g) * 0.9 + 0.1}
    return {k: v.to(device) for k, v in batch.items()}


def bench_projection(args: Args, device: torch.device) -> dict:
    n, support = args.batch_size, torch.linspace(-10.0, 10.0, 51, device=device)
    g = torch.Generator().manual_seed(args.seed)
    probs = (torch.randn(n, 51, generator=g) * 2).softmax(1).to(device)
    returns = (torch.randn(n, generator=g) * 3).to(device)
    discounts = torch.where(torch.rand(n, generator=g) < 0.1, 0.0, 0.99 ** 3).to(device)
    fast = c51.project(probs, returns, discounts, support)
    loop = per_sample_projection(probs, returns, discounts, support)
    t0 = time.perf_counter()
    atom = per_atom_projection(probs.cpu(), returns.cpu(), discounts.cpu(), -10.0, 10.0)
    per_atom_s = time.perf_counter() - t0  # once: it takes seconds
    return {"vectorised_s": time_calls(lambda: c51.project(probs, returns, discounts, support),
                                       args.repeats, device),
            "per_sample_loop_s": time_calls(lambda: per_sample_projection(
                probs, returns, discounts, support), max(1, args.repeats // 10), device),
            "per_atom_python_s": per_atom_s,
            "max_abs_diff_vs_per_sample": (fast - loop).abs().max().item(),
            "max_abs_diff_vs_per_atom": (fast.cpu() - atom).abs().max().item()}


def bench_learner(args: Args, device: torch.device, variant: str) -> dict:
    flags = ([] if variant == "catdqn-2k" else ["--double", "--dueling", "--prioritized"])
    cargs = tyro.cli(c51.Args, args=["--batch-size", str(args.batch_size), *flags])
    support = torch.linspace(cargs.v_min, cargs.v_max, cargs.num_atoms, device=device)
    torch.manual_seed(args.seed)
    model = c51.C51Network(6, support, cargs.dueling).to(device)
    target = c51.C51Network(6, support, cargs.dueling).to(device)
    optimizer = c51.make_optimizer(model, cargs)
    batch = synthetic_batch(args.batch_size, 6, device, args.seed)
    r = throughput.timed(lambda: c51.c51_update(model, target, optimizer, batch, cargs), 1,
                         args.seconds, device)
    return {"updates_per_s": r["steps_per_s"], "updates": r["steps"], "seconds": r["seconds"],
            "double": cargs.double, "dueling": cargs.dueling}


def main() -> None:
    args = tyro.cli(Args)
    if args.torch_threads:
        torch.set_num_threads(args.torch_threads)
    device = torch.device("cuda" if args.cuda and torch.cuda.is_available() else "cpu")
    res: dict = {"hardware": throughput.hardware(device), "device": str(device),
                 "args": asdict(args), "load_average_at_start": os.getloadavg()}
    print(f"hardware: {res['hardware']['line']}; load average {res['load_average_at_start']}",
          flush=True)

    print(f"measuring the projection at batch {args.batch_size} ...", flush=True)
    res["projection"] = p = bench_projection(args, device)
    print(f"  vectorised {1e3 * p['vectorised_s']:.3f} ms, per-sample loop "
          f"{1e3 * p['per_sample_loop_s']:.1f} ms, per-atom Python {p['per_atom_python_s']:.2f} s",
          flush=True)
    for variant in ("catdqn-2k", "double-dueling-prioritized"):
        print(f"measuring learner ({variant}) ...", flush=True)
        res[f"learner_{variant}"] = throughput_r = bench_learner(args, device, variant)
        print(f"  {throughput_r['updates_per_s']:.3f} updates/s", flush=True)
    update_s = 1 / res["learner_catdqn-2k"]["updates_per_s"]
    res["projection_share_of_update"] = p["vectorised_s"] / update_s

    if args.e2e:
        with tempfile.TemporaryDirectory(prefix="accelrl-bench-") as tmp:
            e2e_args = throughput.Args(env_id=args.env_id, seed=args.seed,
                                       e2e_seconds=args.e2e_seconds,
                                       torch_threads=args.torch_threads)
            print("measuring cat_dqn end to end ...", flush=True)
            res["cat_dqn_e2e"] = throughput.run_e2e(
                "cat_dqn", ["--num-envs", str(args.num_envs), "--batch-size",
                            str(args.batch_size), "--learning-starts", "2048",
                            "--eval-interval", "0", "--replay-size", "100000"],
                e2e_args, device.type == "cuda", Path(tmp) / "cat_dqn")
            print(f"  {throughput.fmt(res['cat_dqn_e2e']['steady_sps'])} steps/s", flush=True)
        res["load_average_at_end"] = os.getloadavg()

    b, rows = args.batch_size, [("measurement", "value", "notes"), ("-", "-", "-")]
    rows.append((f"projection of {b} distributions (51 atoms), vectorised",
                 f"{1e3 * p['vectorised_s']:.2f} ms",
                 f"{100 * res['projection_share_of_update']:.2f}% of a CatDQN-2K update"))
    rows.append((f"projection of {b}, per-sample loop (Algorithm 1, atoms vectorised)",
                 f"{1e3 * p['per_sample_loop_s']:.0f} ms",
                 f"{p['per_sample_loop_s'] / p['vectorised_s']:,.0f}x the vectorised time"))
    rows.append((f"projection of {b}, per-sample per-atom Python loop",
                 f"{1e3 * p['per_atom_python_s']:,.0f} ms",
                 f"max difference {p['max_abs_diff_vs_per_atom']:.1e}"))
    for variant in ("catdqn-2k", "double-dueling-prioritized"):
        r = res[f"learner_{variant}"]
        rows.append((f"learner, batch {b}, {variant}", f"{r['updates_per_s']:.3f} updates/s",
                     f"{r['updates_per_s'] * b:,.0f} samples/s"))
    if e := res.get("cat_dqn_e2e"):
        share = e.get("phase_share") or {}
        rows.append((f"cat_dqn end to end, {args.num_envs} envs x 16 steps, batch {b}, replay "
                     "ratio 8", f"{throughput.fmt(e['steady_sps'])} steps/s",
                     ", ".join(f"{k} {100 * v:.0f}%" for k, v in share.items())))
    res["table_markdown"] = "\n".join("| " + " | ".join(r) + " |" for r in rows) + (
        f"\n\nHardware: {res['hardware']['line']}; device {res['device']}; load average "
        f"{res['load_average_at_start'][0]:.1f} at the start.")
    print("\n" + res["table_markdown"])
    host = re.sub(r"[^A-Za-z0-9_.-]", "_", res["hardware"]["host"])
    out = Path(args.out or ROOT / f"benchmarks/results/throughput-cat-dqn-{host}-{device.type}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=2, default=str))
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
