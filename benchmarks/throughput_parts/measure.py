"""What every part of benchmarks/throughput.py shares: timing that waits for the GPU at its
edges, the end-to-end run (benchmarks/training.py) and the markdown table."""

from __future__ import annotations

import math
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as the training scripts set it
import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from benchmarks.training import (ROOT, Training, as_typed, command,  # noqa: E402,F401
                                 phase_shares, scalars, summary)  # ROOT: the parts' too
from common.trained import load_algo  # noqa: E402,F401  # the throughput parts' loader


def sync(device: torch.device) -> None:
    """Wait for the GPU's queued work: a host timer read without it times the launches only."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, steps_per_call: int, seconds: float, device: torch.device, warmup: int = 1) -> dict:
    """Call fn `warmup` times untimed, then until `seconds` have passed; steps/s over the calls.
    The loop reads the clock without synchronising (the GPU may run a few calls behind), and the
    sync before the last reading brings that work inside the timed span."""
    for _ in range(warmup):
        fn()
    sync(device)
    t0, calls = time.perf_counter(), 0
    while True:
        fn()
        calls += 1
        if time.perf_counter() - t0 >= seconds:
            break
    sync(device)
    elapsed = time.perf_counter() - t0
    return {"steps_per_s": calls * steps_per_call / elapsed, "steps": calls * steps_per_call,
            "seconds": elapsed}


def per_call(fn, calls: int, device: torch.device) -> float:
    """Seconds per call of fn over `calls` calls, after one untimed warm-up call."""
    fn()
    sync(device)
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    sync(device)
    return (time.perf_counter() - t0) / calls


def random_rollout(n: int, num_actions: int, device: torch.device) -> dict:
    """A flat batch of n samples shaped as a policy-gradient update takes it (random values)."""
    return {"obs": torch.randint(0, 256, (n, 4, 84, 84), dtype=torch.uint8, device=device),
            "actions": torch.randint(num_actions, (n,), device=device),
            "logprob": torch.full((n,), -math.log(num_actions), device=device),
            "value": torch.randn(n, device=device), "advantages": torch.randn(n, device=device),
            "returns": torch.randn(n, device=device)}


def run_e2e(script: str, flags: list[str], a, use_cuda: bool, run_dir: Path) -> dict:
    """Train algos/<script>.py (a.env_id, a.seed, a.torch_threads) for a.e2e_seconds after its
    first progress line, then stop it (benchmarks/training.py). Steady-state steps/s is timed
    between progress lines (Training.steady); phase shares are summary.json's."""
    cmd = command(script, ["--env-id", a.env_id, "--seed", str(a.seed), "--total-timesteps",
                           str(10**12), "--run-dir", str(run_dir),
                           "--cuda" if use_cuda else "--no-cuda", *flags])
    env = {"OMP_NUM_THREADS": str(a.torch_threads)} if a.torch_threads else None
    t = Training(cmd, env=env).run(
        until=lambda t: bool(t.progress) and t.elapsed - t.progress[0][0] >= a.e2e_seconds,
        limit=a.e2e_seconds + 600)  # never hang the benchmark
    out = {"cmd": " ".join(as_typed(cmd, run_dir.parent, "<tmp>")[1:]),
           "returncode": t.returncode, "iterations": len(t.progress), "first_iteration_done_s":
           t.progress[0][0] if t.progress else None, **t.steady()}
    if len(t.progress) < 2 or t.returncode != 0:
        out["error"] = (t.tail(40)[-2000:] if t.returncode
                        else "fewer than 2 progress lines: " + t.tail(3))
    if s := summary(run_dir):
        out["summary"] = {k: s.get(k) for k in ("global_step", "wall_seconds", "sps",
                                                "phase_seconds")}
        out["phase_share"] = phase_shares(s.get("phase_seconds") or {}, s.get("wall_seconds"))
    return out


def split_problem(flag: str, sampler_cores) -> str | None:
    """What is wrong with a sampler/learner split of this machine's cores, if anything: the
    sampler's must leave the learner at least one."""
    allowed = os.sched_getaffinity(0)
    if sampler_cores and not set(sampler_cores) < allowed:
        return (f"{flag} {list(sampler_cores)} must be a strict subset of the usable cores "
                f"{sorted(allowed)}")
    return None


def drain(sampler, steps_per_rollout: int, seconds: float) -> dict:
    """An AsyncSampler's rate when nobody learns: each buffer goes straight back, timed for
    `seconds` after one untimed rollout (process start-up); closes the sampler."""
    try:
        sampler.release(sampler.get()[0])
        t0, rollouts, waited = time.perf_counter(), 0, 0.0
        while time.perf_counter() - t0 < seconds:
            i, info = sampler.get()
            sampler.release(i)
            rollouts, waited = rollouts + 1, waited + info["sampler_wait"]
        elapsed = time.perf_counter() - t0
    finally:
        sampler.close()
    return {"steps_per_s": rollouts * steps_per_rollout / elapsed, "rollouts": rollouts,
            "seconds": elapsed, "sampler_wait_share": waited / elapsed}


def scalar_series(run_dir: Path, tags) -> dict[str, dict[int, float]]:
    """A run's TensorBoard scalars: {tag: {global step: value}} for those of `tags` it logged."""
    series, _ = scalars(run_dir)
    return {t: {step: v for _, step, v in series[t]} for t in tags if t in series}


def fmt(x: float | None) -> str:
    return "n/a" if x is None else f"{x:,.0f}"


def table(rows: list[tuple[str, ...]], res: dict, notes: str = ".") -> str:
    """The markdown table of rows (a header, then the measurements), then the hardware line;
    notes follow the device, so they start with their own punctuation."""
    header, *body = rows
    lines = [header, ("-",) * len(header), *body]
    return ("\n".join("| " + " | ".join(row) + " |" for row in lines)
            + f"\n\nHardware: {res['hardware']['line']}; device {res['device']}{notes}")


def e2e_shares(e: dict) -> str:
    """An end-to-end run's phase shares, as 'env 4%, inference 7%, ...'."""
    return ", ".join(f"{k} {100 * v:.0f}%" for k, v in (e.get("phase_share") or {}).items())
