"""The catdqn part of benchmarks/throughput.py: Categorical DQN (JSON:
throughput-cat-dqn-<host>-<device>.json).

More: docs/benchmarks.md, `benchmarks/throughput_parts/cat_dqn.py`.
"""

from __future__ import annotations

import math
import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import tyro

from benchmarks.throughput_parts.measure import e2e_shares, fmt, load_algo, per_call, run_e2e, \
    sync, table, timed
from common.grad_step import AllReduceStep

STEM = "throughput-cat-dqn"
PARTS = ("catdqn",)


@dataclass
class Args:
    """the catdqn part"""
    batch_size: int = 2048
    """projection and update batch (the paper's CatDQN-2K)"""
    num_envs: int = 16
    """environments of the end-to-end run (cat_dqn default)"""
    repeats: int = 20
    """timed calls of the vectorised projection (a tenth of them, at least one, for the
    per-sample loop), after one warm-up"""
    seconds: float = 20.0
    """timed seconds per learner measurement, after one warm-up update"""
    e2e_seconds: float = 180.0
    """seconds the end-to-end run trains after its first progress line (on a CPU, a progress
    line comes every 2,048 steps per rank: 8 updates at batch 2048)"""
    e2e: bool = True
    """run cat_dqn.py end to end (--catdqn.no-e2e skips)"""


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


def synthetic_batch(n: int, num_actions: int, device: torch.device, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    batch = {"obs": torch.randint(0, 256, (n, 4, 84, 84), generator=g, dtype=torch.uint8),
             "next_obs": torch.randint(0, 256, (n, 4, 84, 84), generator=g, dtype=torch.uint8),
             "actions": torch.randint(0, num_actions, (n,), generator=g),
             "returns": torch.randn(n, generator=g).sign() * (torch.rand(n, generator=g) < 0.1),
             "discounts": (torch.rand(n, generator=g) > 0.01) * 0.99,
             "weights": torch.rand(n, generator=g) * 0.9 + 0.1}
    return {k: v.to(device) for k, v in batch.items()}


def bench_projection(c51, a, device: torch.device) -> dict:
    n, support = a.batch_size, torch.linspace(-10.0, 10.0, 51, device=device)
    g = torch.Generator().manual_seed(a.seed)
    probs = (torch.randn(n, 51, generator=g) * 2).softmax(1).to(device)
    returns = (torch.randn(n, generator=g) * 3).to(device)
    discounts = torch.where(torch.rand(n, generator=g) < 0.1, 0.0, 0.99 ** 3).to(device)
    fast = c51.project(probs, returns, discounts, support)
    loop = per_sample_projection(probs, returns, discounts, support)
    sync(device)  # fast and loop may still run on the GPU: keep them out of the next timing
    t0 = time.perf_counter()
    atom = per_atom_projection(probs.cpu(), returns.cpu(), discounts.cpu(), -10.0, 10.0)
    per_atom_s = time.perf_counter() - t0  # once: it takes seconds
    return {"vectorised_s": per_call(lambda: c51.project(probs, returns, discounts, support),
                                     a.repeats, device),
            "per_sample_loop_s": per_call(lambda: per_sample_projection(
                probs, returns, discounts, support), max(1, a.repeats // 10), device),
            "per_atom_python_s": per_atom_s,
            "max_abs_diff_vs_per_sample": (fast - loop).abs().max().item(),
            "max_abs_diff_vs_per_atom": (fast.cpu() - atom).abs().max().item()}


def bench_learner(c51, a, device: torch.device, variant: str) -> dict:
    flags = ([] if variant == "catdqn-2k" else ["--double", "--dueling", "--prioritized"])
    cargs = tyro.cli(c51.Args, args=["--batch-size", str(a.batch_size), *flags])
    support = torch.linspace(cargs.v_min, cargs.v_max, cargs.num_atoms, device=device)
    torch.manual_seed(a.seed)
    model = c51.C51Network(6, support, cargs.dueling).to(device)
    target = c51.C51Network(6, support, cargs.dueling).to(device)
    step = AllReduceStep(model, c51.make_optimizer(model, cargs), cargs.max_grad_norm)
    batch = synthetic_batch(a.batch_size, 6, device, a.seed)
    r = timed(lambda: c51.c51_update(model, target, step, batch, cargs), 1, a.seconds, device)
    return {"updates_per_s": r["steps_per_s"], "updates": r["steps"], "seconds": r["seconds"],
            "double": cargs.double, "dueling": cargs.dueling}


def run(res: dict, a, parts: set[str], device: torch.device, num_actions: int) -> None:
    """Measure into res, then the projection's share of an update and the table."""
    c51 = load_algo("cat_dqn")
    res["load_average_at_start"] = os.getloadavg()
    print(f"load average {res['load_average_at_start']}", flush=True)
    print(f"measuring the projection at batch {a.batch_size} ...", flush=True)
    res["projection"] = p = bench_projection(c51, a, device)
    print(f"  vectorised {1e3 * p['vectorised_s']:.3f} ms, per-sample loop "
          f"{1e3 * p['per_sample_loop_s']:.1f} ms, per-atom Python {p['per_atom_python_s']:.2f} s",
          flush=True)
    for variant in ("catdqn-2k", "double-dueling-prioritized"):
        print(f"measuring learner ({variant}) ...", flush=True)
        res[f"learner_{variant}"] = r = bench_learner(c51, a, device, variant)
        print(f"  {r['updates_per_s']:.3f} updates/s", flush=True)
    update_s = 1 / res["learner_catdqn-2k"]["updates_per_s"]
    res["projection_share_of_update"] = p["vectorised_s"] / update_s

    if a.e2e:
        with tempfile.TemporaryDirectory(prefix="accelrl-bench-") as tmp:
            print("measuring cat_dqn end to end ...", flush=True)
            res["cat_dqn_e2e"] = run_e2e(
                "cat_dqn", ["--num-envs", str(a.num_envs), "--batch-size", str(a.batch_size),
                            "--learning-starts", "2048", "--eval-interval", "0",
                            "--replay-size", "100000"],
                a, device.type == "cuda", Path(tmp) / "cat_dqn")
            print(f"  {fmt(res['cat_dqn_e2e']['steady_sps'])} steps/s", flush=True)
        res["load_average_at_end"] = os.getloadavg()


def report(res: dict, a) -> str:
    """The markdown table of res."""
    b, p, rows = a.batch_size, res["projection"], [("measurement", "value", "notes")]
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
        rows.append((f"cat_dqn end to end, {a.num_envs} envs x 16 steps, batch {b}, replay "
                     "ratio 8", f"{fmt(e['steady_sps'])} steps/s", e2e_shares(e)))
    return table(rows, res, f"; load average {res['load_average_at_start'][0]:.1f} at the start.")

