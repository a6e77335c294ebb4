"""Throughput of accelrl's parts on this machine, and how close end-to-end training gets to them.

Measured in one run, each part warmed up first, then timed for `--seconds`:
  1. raw env      - AtariVectorEnv send/recv with random actions (common.envs.make_envs, 1 group)
  2. sampler      - Sampler.collect with a trivial policy (random actions, no network), timed in
                    one-rollout blocks interleaved with 1. on the same environments
  3. sampler+net  - Sampler.collect with PPO's network and policy, plain and alternating
  4. learner      - PPO's ppo_update on a random batch of num_envs x num_steps samples
  5. end to end   - algos/ppo_multigpu.py (num_envs, num_steps as here) and, if it exists,
                    algos/a2c_multigpu.py (its defaults, --a2c-num-envs), each plain and
                    --alternate, run as subprocesses.

Run:
    python benchmarks/throughput.py            # about 4 minutes on a 2-core CPU
    python benchmarks/throughput.py --cuda     # on a GPU machine (--cuda is the default anyway)
    python benchmarks/throughput.py --seconds 1 --e2e-seconds 5 --no-a2c   # a quick check

End to end, each script trains with a huge --total-timesteps and gets SIGINT (its clean stop)
--e2e-seconds after its first progress line. Steady-state steps/s is timed between progress
lines (one per iteration, or per log interval), so start-up and the first iteration (imports,
emulator start, warm-up) are left out; summary.json's sps also counts them and the final
checkpoint. Phase shares are summary.json's phase_seconds over its wall_seconds.

Targets:
  sampler(trivial) / raw >= 0.95  the sampler's bookkeeping costs under 5% of the simulation.
  PPO e2e / bound >= 0.85  bound = 1 / (1/sampler_net + epochs/learner), learner in
      epoch-samples/s, so epochs/learner is the learning seconds per environment step: sampling
      then learning back to back, nothing else. With --alternate, the alternating sampler's rate.
  A2C: the largest phase (env: waiting on simulation; inference; learn; comm) is what limits it.

Threads: emulators get make_envs' choice (min(envs per group, cores)); torch keeps its default
(all cores), as the training scripts do; --torch-threads N sets it here and, as OMP_NUM_THREADS,
in the subprocesses. OMP_WAIT_POLICY defaults to PASSIVE, as in the training scripts (spinning
OpenMP threads starve the emulator threads); `OMP_WAIT_POLICY=ACTIVE python benchmarks/...` shows
the difference. The hardware line lists the OMP_* variables in force.
"""

from __future__ import annotations

import importlib.util
import json
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
from dataclasses import asdict, dataclass
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as the training scripts set it
import numpy as np  # noqa: E402
import torch  # noqa: E402
import tyro  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from common import envs  # noqa: E402
from common.sampler import Sampler  # noqa: E402

PROGRESS = re.compile(r"step\s+([\d,]+)/")  # common.logger's per-iteration progress line


@dataclass
class Args:
    env_id: str = "Pong-v5"
    """game to measure"""
    num_envs: int = 8
    """environments for the raw, sampler, learner and PPO measurements (PPO paper: 8 per GPU)"""
    num_steps: int = 128
    """steps per environment per rollout (PPO's default); the learner batch is num_envs x this"""
    seconds: float = 5.0
    """timed seconds per in-process measurement, after its warm-up (at least one rollout/update)"""
    e2e_seconds: float = 20.0
    """seconds each end-to-end run trains after its first iteration before it is stopped"""
    a2c_num_envs: int = 16
    """environments for the A2C end-to-end runs (paper: 16 per GPU)"""
    cuda: bool = True
    """use the GPU when one exists (inference, learning, end-to-end runs); --no-cuda forces CPU"""
    torch_threads: int = 0
    """torch CPU threads; 0 keeps torch's default, like the training scripts"""
    seed: int = 1
    """seed for environments, actions, parameters and the random learner batch"""
    out: str | None = None
    """JSON output; default benchmarks/results/throughput-<host>-<device>.json"""
    raw: bool = True
    """measure raw environment steps/s and the trivial-policy sampler, interleaved (--no-raw)"""
    sampler: bool = True
    """measure the sampler with PPO's network, plain and alternating (--no-sampler skips)"""
    learner: bool = True
    """measure PPO's update on random data (--no-learner skips)"""
    ppo: bool = True
    """run PPO end to end, plain and alternating (--no-ppo skips)"""
    a2c: bool = True
    """run A2C end to end if algos/a2c_multigpu.py exists (--no-a2c skips)"""


def load_algo(name: str):
    """algos/<name>.py as a module (the scripts are launched by path, not installed)."""
    spec = importlib.util.spec_from_file_location(name, ROOT / "algos" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses resolve string annotations through sys.modules
    spec.loader.exec_module(module)
    return module


def hardware(device: torch.device) -> dict:
    cpu = platform.processor() or platform.machine()
    try:
        names = re.findall(r"^model name\s*:\s*(.+)$", Path("/proc/cpuinfo").read_text(), re.M)
        cpu = names[0].strip() if names else cpu
    except OSError:
        pass
    import ale_py

    hw = {"host": socket.gethostname(), "cpu": cpu, "cores": os.cpu_count(),
          "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
          "torch": torch.__version__, "ale_py": ale_py.__version__,
          "torch_threads": torch.get_num_threads(),
          "env_vars": {k: os.environ[k] for k in ("OMP_NUM_THREADS", "OMP_WAIT_POLICY",
                                                   "MKL_NUM_THREADS") if k in os.environ}}
    hw["line"] = (f"{hw['cpu']}, {hw['cores']} cores" + (f", {hw['gpu']}" if hw["gpu"] else "")
                  + f"; torch {hw['torch']} ({hw['torch_threads']} threads), ale-py {hw['ale_py']}"
                  + "".join(f", {k}={v}" for k, v in hw["env_vars"].items()))
    return hw


def timed(fn, steps_per_call: int, seconds: float, device: torch.device, warmup: int = 1) -> dict:
    """Call fn `warmup` times untimed, then until `seconds` have passed; steps/s over the calls."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for _ in range(warmup):
        fn()
    sync()
    t0, calls = time.perf_counter(), 0
    while True:
        fn()
        calls += 1
        if time.perf_counter() - t0 >= seconds:
            break
    sync()
    elapsed = time.perf_counter() - t0
    return {"steps_per_s": calls * steps_per_call / elapsed, "steps": calls * steps_per_call,
            "seconds": elapsed}


def bench_raw_and_sampler(args: Args, device: torch.device, num_actions: int) -> dict:
    """Raw env steps/s and the trivial-policy sampler's, on the same environments, in
    interleaved one-rollout blocks: a shared VM's speed drifts by 20% within seconds, so two
    separate timings would compare different machines. Rates use each side's median block."""
    env_groups = envs.make_envs(args.env_id, args.num_envs)
    e, T, n = env_groups[0], args.num_steps, args.num_envs
    sampler = Sampler(env_groups, T, device)
    sampler.reset(envs.env_seeds(args.seed, 0, n))
    rng = np.random.default_rng(args.seed)

    def raw():  # the sampler's next_obs goes stale meanwhile: harmless for a throughput test
        for _ in range(T):
            e.send(rng.integers(0, num_actions, n, dtype=np.int64))
            e.recv()

    def trivial():  # random actions, no network
        sampler.collect(lambda obs: (torch.randint(num_actions, (obs.shape[0],), device=device),
                                     {}))

    raw(), trivial()  # warm-up
    times = {"raw": [], "trivial": []}
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < 2 * args.seconds or len(times["raw"]) < 5:
        order = (("raw", raw), ("trivial", trivial))
        for name, fn in order if len(times["raw"]) % 2 else order[::-1]:
            t = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t)
    e.close()
    raw_s, triv_s = (float(np.median(times[k])) for k in ("raw", "trivial"))
    ratios = np.array(times["raw"]) / np.array(times["trivial"])
    return {"raw_env": {"steps_per_s": T * n / raw_s, "blocks": len(times["raw"])},
            "sampler_trivial": {"steps_per_s": T * n / triv_s, "blocks": len(times["trivial"]),
                                "paired_ratio_median": float(np.median(ratios)),
                                "paired_ratio_quartiles": np.percentile(ratios, [25, 75]).tolist()}}


def bench_sampler(args: Args, device: torch.device, groups: int, policy, value_fn=None,
                  extras: tuple[str, ...] = ()) -> dict:
    """Sampler.collect steps/s over num_envs environments in `groups` groups."""
    env_groups = envs.make_envs(args.env_id, args.num_envs, groups=groups)
    sampler = Sampler(env_groups, args.num_steps, device, extras=extras)
    sampler.reset(envs.env_seeds(args.seed, 0, args.num_envs))
    r = timed(lambda: sampler.collect(policy, value_fn), args.num_steps * args.num_envs,
              args.seconds, device)
    for e in env_groups:
        e.close()
    return {**r, "groups": groups}


def ppo_policy(ppo, num_actions: int, device: torch.device, seed: int):
    """(policy, value_fn, extras) with PPO's network and its own act()."""
    torch.manual_seed(seed)
    agent = ppo.Agent(num_actions).to(device)
    return (lambda obs: ppo.act(agent, obs)), (lambda o: agent(o)[1]), ("logprob", "value")


def bench_learner(args: Args, ppo, device: torch.device, num_actions: int) -> dict:
    pargs = ppo.Args(num_envs=args.num_envs, num_steps=args.num_steps)
    n = args.num_envs * args.num_steps
    torch.manual_seed(args.seed)
    agent = ppo.Agent(num_actions).to(device)
    optimizer = torch.optim.Adam(agent.parameters(), lr=pargs.learning_rate, eps=1e-5)
    batch = {"obs": torch.randint(0, 256, (n, 4, 84, 84), dtype=torch.uint8, device=device),
             "actions": torch.randint(num_actions, (n,), device=device),
             "logprob": torch.full((n,), -float(np.log(num_actions)), device=device),
             "value": torch.randn(n, device=device), "advantages": torch.randn(n, device=device),
             "returns": torch.randn(n, device=device)}
    r = timed(lambda: ppo.ppo_update(agent, optimizer, batch, pargs), n, args.seconds, device)
    return {"epoch_samples_per_s": r["steps_per_s"] * pargs.update_epochs,
            "batch_samples_per_s": r["steps_per_s"], "batch_size": n, "updates": r["steps"] // n,
            "seconds": r["seconds"], "epochs": pargs.update_epochs,
            "minibatches": pargs.num_minibatches}


def run_e2e(script: str, flags: list[str], args: Args, use_cuda: bool, run_dir: Path) -> dict:
    """Train algos/<script>.py for e2e_seconds after its first iteration, then SIGINT it."""
    cmd = [sys.executable, str(ROOT / "algos" / f"{script}.py"), "--env-id", args.env_id,
           "--seed", str(args.seed), "--total-timesteps", str(10**12), "--run-dir", str(run_dir),
           "--cuda" if use_cuda else "--no-cuda", *flags]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    if args.torch_threads:
        env["OMP_NUM_THREADS"] = str(args.torch_threads)
    lines, start = [], time.perf_counter()  # (seconds since start, global step) per iteration
    with tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=err,
                                text=True)
        watchdog = threading.Timer(args.e2e_seconds + 600, proc.kill)  # never hang the benchmark
        watchdog.start()
        stop = None  # started at the first progress line
        for line in proc.stdout:
            m = PROGRESS.search(line)
            if m:
                lines.append((time.perf_counter() - start, int(m.group(1).replace(",", ""))))
                if stop is None:
                    stop = threading.Timer(args.e2e_seconds, proc.send_signal, [signal.SIGINT])
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
        wall, phases = s["wall_seconds"], s.get("phase_seconds") or {}
        out["phase_share"] = {**{k: v / wall for k, v in phases.items()},
                              "other": 1 - sum(phases.values()) / wall}
    return out


def fmt(x: float | None) -> str:
    return "n/a" if x is None else f"{x:,.0f}"


def report(res: dict, args: Args) -> tuple[dict, str]:
    """Derived ratios, and the markdown table."""
    rate = {k: v["steps_per_s"] for k, v in res.items()
            if isinstance(v, dict) and "steps_per_s" in v}
    r, lr = {}, res.get("learner")
    if "sampler_trivial" in res:  # paired blocks: see bench_raw_and_sampler
        r["sampler_trivial_over_raw"] = res["sampler_trivial"]["paired_ratio_median"]
    for alt in ("plain", "alternating"):
        if lr and f"sampler_ppo_{alt}" in rate:  # learning seconds per step: epochs / learner
            r[f"ppo_bound_{alt}"] = 1 / (1 / rate[f"sampler_ppo_{alt}"]
                                         + lr["epochs"] / lr["epoch_samples_per_s"])
            if res.get(f"ppo_e2e_{alt}", {}).get("steady_sps"):
                r[f"ppo_e2e_over_bound_{alt}"] = (res[f"ppo_e2e_{alt}"]["steady_sps"]
                                                  / r[f"ppo_bound_{alt}"])
    n, q = args.num_envs, r.get("sampler_trivial_over_raw")
    rows = [("measurement", "steps/s", "ratio (target), notes"), ("-", "-", "-")]
    if "raw_env" in rate:
        rows.append((f"raw env, {n} envs, {res['env_threads']} threads, random actions",
                     fmt(rate["raw_env"]), ""))
    if "sampler_trivial" in rate:
        rows.append((f"sampler, trivial policy, {n} envs x {args.num_steps} steps",
                     fmt(rate["sampler_trivial"]), (f"sampler/raw = {q:.2f} (>= 0.95), median of paired blocks, quartiles "
                      "{:.2f}-{:.2f}".format(*res["sampler_trivial"]["paired_ratio_quartiles"])
                      if q else "")))
    for alt in ("plain", "alternating"):
        if f"sampler_ppo_{alt}" in rate:
            rows.append((f"sampler, PPO network, {alt}", fmt(rate[f"sampler_ppo_{alt}"]), ""))
    if lr:
        rows.append((f"learner, PPO update, batch {lr['batch_size']}, {lr['epochs']} epochs x "
                     f"{lr['minibatches']} minibatches", f"{fmt(lr['epoch_samples_per_s'])} "
                     f"epoch-samples/s ({fmt(lr['batch_samples_per_s'])} batch/s)", ""))
    for key, label in (("ppo", f"PPO, {n} envs"), ("a2c", f"A2C, {args.a2c_num_envs} envs")):
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
                notes.append("time: " + ", ".join(f"{k} {100 * v:.0f}%" for k, v in share.items())
                             + f"; limited by {top}")
            whole = e.get("summary", {}).get("sps")
            rows.append((f"{label}, end to end, {alt}", fmt(e["steady_sps"])
                         + (f" (summary.json {fmt(whole)})" if whole else ""), "; ".join(notes)))
    table = "\n".join("| " + " | ".join(row) + " |" for row in rows)
    table += (f"\n\nHardware: {res['hardware']['line']}; device {res['device']}. End-to-end "
              f"steps/s: steady state over iterations 2+ ({args.e2e_seconds:g} s); summary.json's "
              "sps also counts the first iteration and the final checkpoint.")
    return r, table


def main() -> None:
    args = tyro.cli(Args)
    if args.torch_threads:
        torch.set_num_threads(args.torch_threads)
    device = torch.device("cuda" if args.cuda and torch.cuda.is_available() else "cpu")
    res: dict = {"hardware": hardware(device), "device": str(device), "args": asdict(args),
                 "env_threads": max(1, min(args.num_envs, os.cpu_count() or 1))}  # as make_envs
    print(f"hardware: {res['hardware']['line']}", flush=True)
    ppo = load_algo("ppo_multigpu")
    try:
        probe = envs.make_envs(args.env_id, 1)[0]
    except envs.EnvError as e:
        sys.exit(f"error: {e}")
    num_actions = probe.num_actions
    probe.close()

    def measure(name, fn, *a):
        print(f"measuring {name} ...", flush=True)
        res[name] = fn(*a)
        rate = res[name].get("steps_per_s") or res[name].get("steady_sps") or \
            res[name].get("epoch_samples_per_s")
        print(f"  {fmt(rate)}/s" + (f"  error: {res[name]['error']}" if "error" in res[name]
                                    else ""), flush=True)

    if args.raw:
        print("measuring raw_env and sampler_trivial (interleaved) ...", flush=True)
        res.update(bench_raw_and_sampler(args, device, num_actions))
        print(f"  raw {fmt(res['raw_env']['steps_per_s'])}/s, trivial sampler "
              f"{fmt(res['sampler_trivial']['steps_per_s'])}/s", flush=True)
    if args.sampler:
        for groups, name in ((1, "sampler_ppo_plain"), (2, "sampler_ppo_alternating")):
            measure(name, bench_sampler, args, device, groups,
                    *ppo_policy(ppo, num_actions, device, args.seed))
    if args.learner:
        measure("learner", bench_learner, args, ppo, device, num_actions)
    runs = {"ppo": ["--num-envs", str(args.num_envs), "--num-steps", str(args.num_steps)],
            "a2c": ["--num-envs", str(args.a2c_num_envs)]}
    with tempfile.TemporaryDirectory(prefix="accelrl-bench-") as tmp:
        for key, flags in runs.items():
            if not getattr(args, key):
                continue
            if not (ROOT / "algos" / f"{key}_multigpu.py").is_file():
                res[f"{key}_e2e"] = {"skipped": f"algos/{key}_multigpu.py does not exist"}
                continue
            for alt, flag in (("plain", "--no-alternate"), ("alternating", "--alternate")):
                measure(f"{key}_e2e_{alt}", run_e2e, f"{key}_multigpu", flags + [flag], args,
                        device.type == "cuda", Path(tmp) / f"{key}_{alt}")

    res["ratios"], res["table_markdown"] = report(res, args)
    print("\n" + res["table_markdown"])
    host = re.sub(r"[^A-Za-z0-9_.-]", "_", res["hardware"]["host"])
    out = Path(args.out or ROOT / f"benchmarks/results/throughput-{host}-{device.type}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=2, default=str))
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
