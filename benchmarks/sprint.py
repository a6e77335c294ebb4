"""Pong in minutes: a script's sprint recipe trained for a wall-clock budget, and when it got there.

    python benchmarks/sprint.py --minutes 3                      # one GPU: PPO on Pong
    python benchmarks/sprint.py --minutes 60 --no-cuda           # a CPU: the same recipe
    python benchmarks/sprint.py --algo appo --minutes 30 --no-cuda   # APPO, A2C, A3C: their own
    python benchmarks/sprint.py --env-id tests.catch_env:Catch-v0 --minutes 0.5 --no-cuda \
        --targets 0 0.9 --window 20 --extra "--num-steps 32 --learning-rate 1e-3"

More: docs/benchmarks.md, `benchmarks/sprint.py`.
"""

from __future__ import annotations

import csv
import json
import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import tyro

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchmarks import outputs  # noqa: E402
from benchmarks.errors import UserError, fail  # noqa: E402
from benchmarks.training import Training, as_typed, command, phase_shares  # noqa: E402
from common.flag_ranges import out_of_range  # noqa: E402

BATCH = 6_144  # samples per iteration (rl_games' ppo_pong_envpool.yaml: 24 actors x 256 steps)
MIN_ENVS = 24  # rl_games' actors
MINIBATCHES = 8  # per epoch (rl_games: minibatches of 768 from 6,144)
EVAL_MAX_STEPS = 27_000  # 108,000 frames: games that long are cut, none shorter
STOP_GRACE = 120.0  # seconds the run gets to checkpoint and stop after SIGTERM
A3C_RANKS = 2  # A3C's ranks, each with half of A2C's environments, on one central RMSProp/Adam


@dataclass
class Args:
    algo: Literal["ppo", "appo", "a2c", "a3c"] = "ppo"
    """the script and its recipe: ppo_multigpu.py, appo_async.py, a2c_multigpu.py, or
    a2c_multigpu.py --asynchronous on 2 ranks (docs/results.md, Pong in minutes)"""
    minutes: float = 5.0
    """wall-clock budget from the training run's launch, start-up included"""
    env_id: str = "Pong-v5"
    """the game (any id the scripts take)"""
    cuda: bool = True
    """train on the GPU when one is visible; --no-cuda: on the CPU"""
    envs_per_core: int = 4
    """environments per CPU core (at least 24 in all, rl_games' actors)"""
    cores: int | None = None
    """cores to size the recipe for; default: those this process may run on"""
    targets: tuple[float, ...] = (18.0, 20.0)
    """mean game scores to time"""
    window: int = 100
    """games in the running mean the targets are read from"""
    eval_episodes: int = 16
    """whole games in the final evaluation; 0: none"""
    seed: int = 1
    """the run's seed"""
    speed_mode: bool = True
    """add the fastest mode measured on the device (speed_flags(): bf16 and compiled on a CPU with
    bf16 units); --no-speed-mode: the script's defaults, for budgets too short to win back ~10 s
    of compilation"""
    extra: str = ""
    """more flags of the script as one string, after the recipe's (so they win)"""
    out: str | None = None
    """output folder, which must not exist; default runs/benchmarks/sprint-<host>-<device>"""


def num_envs(cores: int, envs_per_core: int) -> int:
    return max(MIN_ENVS, envs_per_core * cores)


def recipe(cores: int, envs_per_core: int = 4) -> list[str]:
    """ppo_multigpu.py's flags for the sprint on this many cores (sources: docs/results.md)."""
    envs = num_envs(cores, envs_per_core)
    steps = -(-BATCH // (envs * MINIBATCHES)) * MINIBATCHES  # so 8 minibatches divide the batch
    return ["--num-envs", str(envs), "--num-steps", str(steps),
            "--num-minibatches", str(MINIBATCHES), "--update-epochs", "3",
            "--clip-coef", "0.2", "--no-clip-vloss", "--learning-rate", "3e-4",
            "--kl-threshold", "0.01", "--gamma", "0.999", "--vf-coef", "1",
            "--max-grad-norm", "10", "--normalize-value", "--normalize-input",
            "--activation", "elu"]


def appo_recipe(cores: int, envs_per_core: int = 4) -> list[str]:
    """appo_async.py's flags: PPO's recipe, whose loss APPO shares (with the lag correction)."""
    return recipe(cores, envs_per_core)


A2C_ENVS, A2C_STEPS = 32, 4  # 128 transitions per update in 4-step rollouts (Lapan, ch. 12)


def a2c_recipe(ranks: int = 1) -> list[str]:
    """a2c_multigpu.py's flags, each rank's (ranks > 1: A3C, the environments split between
    them), whatever the cores: a larger batch per update would be a new recipe. A3C takes Lapan's
    A3C rate, 1e-3: each rank steps on its own half of the batch, so the central parameters take
    twice A2C's steps per transition, and at A2C's 3e-3 the network's features went constant
    (docs/results.md)."""
    lr = "3e-3" if ranks == 1 else "1e-3"
    return ["--num-envs", str(A2C_ENVS // ranks), "--num-steps", str(A2C_STEPS),
            "--optimizer", "adam", "--learning-rate", lr, "--adam-eps", "1e-3",
            "--no-anneal-lr", "--max-grad-norm", "0.1", "--vf-coef", "2",
            *(["--asynchronous"] if ranks > 1 else [])]


def algo_recipe(algo: str, cores: int, envs_per_core: int = 4) -> tuple[str, int | None, list]:
    """(script, ranks under torchrun or None, flags) of a sprint's --algo."""
    if algo == "ppo":
        return "ppo_multigpu", None, recipe(cores, envs_per_core)
    if algo == "appo":
        return "appo_async", None, appo_recipe(cores, envs_per_core)
    if algo == "a2c":
        return "a2c_multigpu", None, a2c_recipe()
    return "a2c_multigpu", A3C_RANKS, a2c_recipe(A3C_RANKS)


def speed_flags(device: str) -> list[str]:
    """The recipe's speed mode on this device (docs/benchmarks.md)."""
    if device != "cpu":
        return []
    try:
        flags = re.search(r"^flags\s*:(.*)$", Path("/proc/cpuinfo").read_text(), re.M)
    except OSError:
        return []
    bf16 = flags and {"avx512_bf16", "amx_bf16"} & set(flags.group(1).split())
    return ["--precision", "bf16", "--compile"] if bf16 else []


def time_to(games: list[tuple[float, int, float]], target: float, window: int) -> dict | None:
    """The first game after which the mean of the last `window` games (a full window) is at
    least `target`: its seconds, step and index; None when no such game exists.
    games: (seconds since launch, env step, score), in the order they were logged."""
    total = 0.0
    for i, (_, _, score) in enumerate(games):
        total += score
        if i >= window:
            total -= games[i - window][2]
        if i + 1 >= window and total / window >= target - 1e-9:
            seconds, step, _ = games[i]
            return {"seconds": seconds, "step": step, "games": i + 1,
                    "mean": total / window}
    return None


def running_means(scores: list[float], window: int) -> list[float]:
    """The mean of the last `window` scores at each game (fewer at the start)."""
    from benchmarks.plot import running_mean
    import numpy as np

    return running_mean(np.asarray(scores, dtype=float), window).tolist() if scores else []


def out_folder(args: Args, device: str) -> Path:
    if args.out:
        folder = Path(args.out).resolve()
        if folder.exists():
            raise UserError(f"--out {folder} exists; name a new folder (nothing is overwritten)")
    else:
        folder = outputs.unused(outputs.RUNS / f"sprint-{outputs.host()}-{device}")
    try:
        folder.mkdir(parents=True)
    except OSError as e:
        raise UserError(f"cannot create --out {folder}: {e.strerror or e}") from None
    return folder


def check(args: Args) -> int:
    """The cores to size for, after refusing input no run could use."""
    cores = args.cores if args.cores is not None else len(os.sched_getaffinity(0))
    if problem := out_of_range(args):
        raise UserError(problem)
    if not args.targets:
        raise UserError("--targets needs at least one score")
    try:
        shlex.split(args.extra)
    except ValueError as e:
        raise UserError(f"--extra is not a valid flag string: {e}") from None
    return cores


def evaluate(run_dir: Path, episodes: int, cuda: bool, log: Path) -> dict:
    """benchmarks/evaluate.py on the run's newest checkpoint; its eval.json's figures."""
    cmd = [sys.executable, str(ROOT / "benchmarks" / "evaluate.py"), str(run_dir),
           "--episodes", str(episodes), "--envs", str(min(episodes, 8)),
           *([] if cuda else ["--no-cuda"])]
    with open(log, "a") as f:
        f.write(f"\n$ {shlex.join(cmd)}\n")
        f.flush()
        rc = subprocess.run(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT).returncode
    found = sorted((run_dir / "checkpoints").glob("eval*.json"), key=lambda p: p.stat().st_mtime)
    if rc or not found:
        return {"error": f"evaluate.py exited {rc}; see {log}"}
    e = json.loads(found[-1].read_text())
    cut = sum(n >= EVAL_MAX_STEPS for n in e["lengths"])
    return {"mean": e["mean_return"], "std": e["std_return"], "games": len(e["returns"]),
            "cut_games": cut, "returns": e["returns"], "lengths": e["lengths"]}


def plot(path: Path, games: list[tuple[float, int, float]], means: list[float],
         report: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    # the mean as it stood after each log call (the games of one call share its time and step)
    ends = [i for i in range(len(games)) if i + 1 == len(games) or games[i + 1][1] != games[i][1]]
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, k, scale, label in ((axes[0], 0, 1 / 60, "wall-clock minutes from launch"),
                                (axes[1], 1, 1, "environment steps")):
        ax.plot([g[k] * scale for g in games], [g[2] for g in games], ".", ms=2, alpha=0.3,
                color="gray", label="games")
        ax.plot([games[i][k] * scale for i in ends], [means[i] for i in ends], "-",
                label=f"mean of last {report['window']} games")
        for t in report["targets"]:
            ax.axhline(t["target"], ls=":", color="k", lw=0.8)
        ax.set_xlabel(label)
        ax.set_ylabel("game score")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    reached = ", ".join(f"{t['target']:g} in {t['minutes']:.1f} min" if t["minutes"] is not None
                        else f"{t['target']:g} not reached" for t in report["targets"])
    fig.suptitle(f"{report['env_id']} sprint of {report['script']}"
                 + (f" on {report['ranks']} ranks" if report["ranks"] > 1 else "")
                 + f", {report['minutes']:g} min budget: {reached}\n"
                 f"{report['hardware']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def markdown(r: dict) -> str:
    sized = (f" ({r['cores']} cores, {r['envs_per_core']} per core, at least {MIN_ENVS})"
             if r["algo"] in ("ppo", "appo") else "")
    ranks = f" on {r['ranks']} ranks" if r["ranks"] > 1 else ""
    lines = [f"{r['env_id']} sprint of {r['script']}{ranks}, {r['minutes']:g}-minute budget, "
             f"{r['envs']} envs{sized}; {r['hardware']}", "",
             "| target | time from launch | steps | games |", "|---|---|---|---|"]
    for t in r["targets"]:
        lines.append(f"| {t['target']:g} (mean of last {r['window']}) | "
                     + (f"{t['minutes']:.2f} min | {t['step']:,} | {t['games']:,} |"
                        if t["minutes"] is not None else "not reached | | |"))
    ev = r["final_eval"]
    lines += ["", f"- steps used: {r['steps']:,} in {r['train_seconds']:.0f} s "
                  f"({r['steps_per_s_overall']:,.0f} steps/s over the budget, "
                  f"{r['steps_per_s_training']:,.0f} in training, summary.json)",
              "- where the time went (shares of the run's wall time; a sampler process's "
              "overlap the learner's): " + ", ".join(
                  f"{k} {v:.0%}" for k, v in (r["phase_shares"] or {}).items()),
              f"- games played: {r['games']:,}; last mean of {r['window']}: "
              + ("n/a" if r["last_mean"] is None else f"{r['last_mean']:.2f}"),
              "- final evaluation: " + ("not run" if ev is None else ev["error"] if "error" in ev
                                        else f"{ev['mean']:.2f} +- {ev['std']:.2f} over "
                                             f"{ev['games']} games ({ev['cut_games']} cut)")]
    return "\n".join(lines) + "\n"


def main() -> None:
    args = tyro.cli(Args, description=__doc__.split("\n\n")[0])
    try:
        cores = check(args)
        import torch

        device = "cuda" if args.cuda and torch.cuda.is_available() else "cpu"
        hw_line = outputs.hardware(torch.device(device))["line"]
        folder = out_folder(args, device)
    except UserError as e:
        fail(str(e))
    run_dir, log = folder / "run", folder / "train.log"
    script, ranks, flags = algo_recipe(args.algo, cores, args.envs_per_core)
    flags += speed_flags(device) if args.speed_mode else []
    cmd = command(script, [
        "--env-id", args.env_id, "--seed", str(args.seed), *flags, "--total-timesteps",
        str(10**10), "--eval-episodes", "0", "--eval-max-steps", str(EVAL_MAX_STEPS),
        "--run-dir", str(run_dir), *([] if device == "cuda" else ["--no-cuda"]),
        *shlex.split(args.extra)], ranks=ranks)
    print(f"{hw_line}\n$ {shlex.join(cmd)}\ntraining for {args.minutes:g} min; log {log}",
          flush=True)
    run = Training(cmd, log).run(limit=args.minutes * 60, grace=STOP_GRACE)
    launched, seconds, stopped = run.launched_at, run.seconds, run.stopped
    if run.returncode != 0 or not (run_dir / "summary.json").is_file():
        print(f"error: training exited {run.returncode}: {run.tail(1)} (log {log})",
              file=sys.stderr)
        sys.exit(1)

    from benchmarks.plot import load_run

    data = load_run(run_dir)
    offset = data.started - launched  # the first event's time after launch
    games = [(h * 3600 + offset, step, score) for step, h, score in data.episodes]
    means = running_means([g[2] for g in games], args.window)
    summary = json.loads((run_dir / "summary.json").read_text())
    steps = summary["global_step"]
    report = {
        "algo": args.algo, "script": script, "ranks": ranks or 1,
        "env_id": args.env_id, "minutes": args.minutes, "hardware": hw_line, "device": device,
        "cores": cores, "envs_per_core": args.envs_per_core,
        "envs": summary["args"]["num_envs"] * summary["world_size"], "recipe": flags,
        "sprint_command": as_typed([sys.executable, __file__, *sys.argv[1:]], folder),
        "command": as_typed(cmd, folder),
        "stopped_by_budget": stopped, "train_seconds": seconds, "steps": steps,
        "steps_per_s_overall": steps / seconds, "steps_per_s_training": summary.get("sps"),
        "phase_shares": phase_shares(summary.get("phase_seconds", {}), summary["wall_seconds"]),
        "games": len(games), "window": args.window,
        "last_mean": means[-1] if len(games) >= args.window else None,
        "targets": [], "final_eval": None}
    for target in args.targets:
        hit = time_to(games, target, args.window)
        report["targets"].append({"target": target, **(
            {"minutes": hit["seconds"] / 60, "seconds": hit["seconds"], "step": hit["step"],
             "games": hit["games"]} if hit else
            {"minutes": None, "seconds": None, "step": None, "games": None})})
    if args.eval_episodes:
        print(f"final evaluation: {args.eval_episodes} whole games ...", flush=True)
        report["final_eval"] = evaluate(run_dir, args.eval_episodes, device == "cuda", log)

    with open(folder / "sprint.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["game", "seconds", "step", "score", f"mean_last_{args.window}"])
        for i, ((s, step, score), m) in enumerate(zip(games, means), 1):
            w.writerow([i, f"{s:.2f}", step, score, f"{m:.4f}"])
    plot(folder / "sprint.png", games, means, report)
    report["table_markdown"] = markdown(report)
    (folder / "sprint.json").write_text(json.dumps(report, indent=2))
    print("\n" + report["table_markdown"] + f"\nwrote sprint.json, sprint.csv, sprint.png in "
          f"{folder}", flush=True)


if __name__ == "__main__":
    main()
