"""What every part of benchmarks/throughput.py shares: the hardware line, timing that waits for
the GPU at its edges, the end-to-end runner and the markdown table."""

from __future__ import annotations

import json
import math
import os
import platform
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as the training scripts set it
import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from common.trained import load_algo  # noqa: E402,F401  # the throughput parts' loader

ROOT = Path(__file__).resolve().parents[2]
PROGRESS = re.compile(r"step\s+([\d,]+)/")  # common.logger's per-iteration progress line


def hardware(device: torch.device) -> dict:
    """The machine a measurement runs on, with the one-line summary every benchmark writes
    beside its numbers (the load average too: other work on the machine slows every number)."""
    cpu = platform.processor() or platform.machine()
    try:
        names = re.findall(r"^model name\s*:\s*(.+)$", Path("/proc/cpuinfo").read_text(), re.M)
        cpu = names[0].strip() if names else cpu
    except OSError:
        pass
    import ale_py

    gpus = ([torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
            if device.type == "cuda" else [])
    hw = {"host": socket.gethostname(), "cpu": cpu, "cores": os.cpu_count(),
          "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
          "gpus": gpus, "torch": torch.__version__, "ale_py": ale_py.__version__,
          "torch_threads": torch.get_num_threads(), "load_average_1min": os.getloadavg()[0],
          "env_vars": {k: os.environ[k] for k in ("OMP_NUM_THREADS", "OMP_WAIT_POLICY",
                                                   "MKL_NUM_THREADS") if k in os.environ}}
    hw["line"] = (f"{hw['cpu']}, {hw['cores']} cores"
                  + (f", {len(gpus)} x {hw['gpu']}" if gpus else ", no GPU used")
                  + f"; torch {hw['torch']} ({hw['torch_threads']} threads), ale-py {hw['ale_py']}"
                  + "".join(f", {k}={v}" for k, v in hw["env_vars"].items())
                  + f"; load average {hw['load_average_1min']:.1f} at the start")
    return hw


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
    first progress line, then SIGINT it (its clean stop).

    Steady-state steps/s is timed between progress lines (one per iteration, or per log
    interval), so start-up and the first iteration are left out; summary.json's sps also counts
    them and the final checkpoint. Phase shares are summary.json's phase_seconds over its
    wall_seconds."""
    cmd = [sys.executable, str(ROOT / "algos" / f"{script}.py"), "--env-id", a.env_id,
           "--seed", str(a.seed), "--total-timesteps", str(10**12), "--run-dir", str(run_dir),
           "--cuda" if use_cuda else "--no-cuda", *flags]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    if a.torch_threads:
        env["OMP_NUM_THREADS"] = str(a.torch_threads)
    lines, start = [], time.perf_counter()  # (seconds since start, global step) per iteration
    with tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=err,
                                text=True)
        watchdog = threading.Timer(a.e2e_seconds + 600, proc.kill)  # never hang the benchmark
        watchdog.start()
        stop = None  # started at the first progress line
        for line in proc.stdout:
            m = PROGRESS.search(line)
            if m:
                lines.append((time.perf_counter() - start, int(m.group(1).replace(",", ""))))
                if stop is None:
                    stop = threading.Timer(a.e2e_seconds, proc.send_signal, [signal.SIGINT])
                    stop.start()
        proc.wait()
        for timer in filter(None, (watchdog, stop)):
            timer.cancel()
        err.seek(0)
        stderr = err.read()
    out = {"cmd": " ".join(cmd[1:]), "returncode": proc.returncode, "iterations": len(lines),
           "first_iteration_done_s": lines[0][0] if lines else None, "steady_sps": None}
    if len(lines) >= 2:  # iteration 2 onwards: no start-up, no first-iteration warm-up
        (t0, s0), (t1, s1) = lines[0], lines[-1]
        out.update(steady_sps=(s1 - s0) / (t1 - t0), steady_seconds=t1 - t0, steady_steps=s1 - s0)
    if len(lines) < 2 or proc.returncode != 0:
        out["error"] = stderr.strip()[-2000:] or "fewer than 2 progress lines"
    summary_path = run_dir / "summary.json"
    if summary_path.is_file():
        s = json.loads(summary_path.read_text())
        out["summary"] = {k: s.get(k) for k in ("global_step", "wall_seconds", "sps",
                                                "phase_seconds")}
        out["phase_share"] = phase_shares(s)
    return out


SAMPLER_PHASES = ("env", "inference", "sampler_wait")  # a sampler process's, when it has one


def phase_shares(summary: dict) -> dict | None:
    """summary.json's phase_seconds over its wall_seconds, and "other": the wall time no phase
    took. With a sampler process (APPO, --async-sampling: it logs sampler_wait) its phases
    overlap the learner's, so "other" is what the learner's phases leave."""
    wall, phases = summary.get("wall_seconds"), summary.get("phase_seconds") or {}
    if not wall:
        return None
    own = [v for k, v in phases.items()
           if "sampler_wait" not in phases or k not in SAMPLER_PHASES]
    return {**{k: v / wall for k, v in phases.items()}, "other": 1 - sum(own) / wall}


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
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    series: dict[str, dict[int, float]] = {}
    for f in run_dir.glob("events.out.tfevents.*"):
        acc = EventAccumulator(str(f))
        acc.Reload()
        for tag in tags:
            if tag in acc.Tags()["scalars"]:
                series.setdefault(tag, {}).update({e.step: e.value for e in acc.Scalars(tag)})
    return series


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
