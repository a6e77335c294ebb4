"""Learning-curve experiments of the paper: named sweeps of configurations x games x seeds.

    python benchmarks/experiments.py NAME [--games ...] [--seeds ...] [--parallel N]
                                          [--print-commands] [--only CONFIG ...]

More: docs/benchmarks.md, `benchmarks/experiments.py`.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from queue import Queue
from typing import Annotated

import tyro

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchmarks import atari_scores, registry  # noqa: E402
from benchmarks.errors import checked, fail, stop_on_sigterm  # noqa: E402
from benchmarks.training import Training, command  # noqa: E402

PAPER_GAMES = ("BeamRider-v5", "Breakout-v5", "Pong-v5", "Qbert-v5", "Seaquest-v5",
               "SpaceInvaders-v5")
CATCH = "tests.catch_env:Catch-v0"


@dataclass(frozen=True)
class Config:
    label: str  # one line in the plots
    algo: str  # a key of registry.ALGOS
    flags: tuple[str, ...] = ()  # on top of the registry's flags


def _q_eps(batch: int) -> tuple[str, ...]:  # the authors' Adam epsilon rule: 0.01 / batch
    return ("--batch-size", str(batch), "--adam-eps", repr(0.01 / batch))


MANY_ENVS = (Config("ppo-8env", "ppo"), Config("ppo-64env", "ppo", ("--num-envs", "64")),
             Config("a2c-16env", "a2c"), Config("a2c-256env", "a2c", ("--num-envs", "256")))
BATCH_SIZE = (Config("dqn-32", "dqn-512", _q_eps(32)), Config("dqn-512", "dqn-512"),
              Config("catdqn-2048", "catdqn-2048"))
SYNC_VS_ASYNC = (Config("a2c", "a2c"), Config("a3c", "a3c"), Config("ppo", "ppo"),
                 Config("appo", "appo"), Config("dqn-512", "dqn-512"),
                 Config("dqn-512-async", "dqn-512-async"))
# Tiny versions of the above: the registry's smoke flags come first, these win over them.
SMOKE = (Config("ppo-4env", "ppo"), Config("ppo-16env", "ppo", ("--num-envs", "16")),
         Config("a2c-4env", "a2c"), Config("a2c-16env", "a2c", ("--num-envs", "16")),
         Config("dqn-32", "dqn-512", _q_eps(32)), Config("dqn-512", "dqn-512"),
         Config("catdqn-2048", "catdqn-2048"), Config("appo", "appo"))


@dataclass(frozen=True)
class Experiment:
    configs: tuple[Config, ...]
    games: tuple[str, ...] = PAPER_GAMES
    seeds: tuple[int, ...] = (1, 2, 3)
    total_timesteps: int | None = None  # None: the smoke flags' own totals
    smoke: bool = False


EXPERIMENTS = {
    "many-envs": Experiment(MANY_ENVS, total_timesteps=25_000_000),
    "batch-size": Experiment(BATCH_SIZE, total_timesteps=50_000_000),
    "sync-vs-async": Experiment(SYNC_VS_ASYNC, total_timesteps=25_000_000),
    "smoke": Experiment(SMOKE, games=(CATCH,), seeds=(1,), smoke=True),
}


@dataclass
class Args:
    name: Annotated[str, tyro.conf.Positional, tyro.conf.arg(metavar="NAME")]
    """experiment: many-envs, batch-size, sync-vs-async or smoke"""
    games: tuple[str, ...] | None = None
    """games (Pong, Pong-v5, or any id the scripts accept; atari49: the paper's 49 games,
    atari57: all 57); default: the experiment's"""
    seeds: tuple[int, ...] | None = None
    """seeds; default: the experiment's"""
    only: tuple[str, ...] | None = None
    """run only these configurations of the experiment (labels, as in the plots)"""
    parallel: int = 1
    """runs at a time; with GPUs each gets its own (--ranks of them) through CUDA_VISIBLE_DEVICES"""
    ranks: int = 1
    """ranks per run: above 1 each run is launched under torchrun"""
    total_timesteps: int | None = None
    """override every run's --total-timesteps"""
    runs: str = "runs/experiments"
    """root folder: runs go to RUNS/NAME/<game>/<config>/seed<k>"""
    print_commands: bool = False
    """print one shell command per unfinished run and exit"""


@dataclass(frozen=True)
class Run:
    config: Config
    game: str
    seed: int
    run_dir: Path

    def finished(self, total: int | None) -> bool:
        """summary.json exists and its step reached the total (the run's own when None)."""
        try:
            s = json.loads((self.run_dir / "summary.json").read_text())
        except (OSError, ValueError):
            return False
        return s["global_step"] >= (total or s["args"]["total_timesteps"])

    def command(self, exp: Experiment, total: int | None, ranks: int) -> list[str]:
        algo = registry.ALGOS[self.config.algo]
        total = total or exp.total_timesteps
        return command(registry.script_path(algo), [
            *algo.flags, *(algo.smoke if exp.smoke else ()), *self.config.flags, "--env-id",
            self.game, "--seed", str(self.seed), *(("--total-timesteps", str(total)) if total
                                                   else ()),
            "--run-dir", str(self.run_dir), "--resume", "auto"], ranks if ranks > 1 else None)


def game_id(name: str) -> str:
    """Pong -> Pong-v5; ids with a version or a module are kept."""
    return name if (":" in name or "-v" in name) else f"{name}-v5"


def visible_gpus() -> list[str]:
    """The GPUs runs may use: those of an inherited CUDA_VISIBLE_DEVICES (a scheduler's or the
    user's choice, kept), else every GPU nvidia-smi lists."""
    if "CUDA_VISIBLE_DEVICES" in os.environ:
        return [g.strip() for g in os.environ["CUDA_VISIBLE_DEVICES"].split(",") if g.strip()]
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return []
    return [str(i) for i, line in enumerate(ln for ln in out.stdout.splitlines()
                                            if ln.startswith("GPU "))]


def gpu_slots(gpus: list[str], parallel: int, ranks: int) -> list[list[str]]:
    """One set of --ranks GPUs per parallel run, none shared (NCCL refuses two ranks on one
    GPU); on a CPU machine empty sets. Exits with one line when the GPUs do not suffice."""
    if not gpus:
        return [[] for _ in range(parallel)]
    if parallel * ranks > len(gpus):
        fail(f"--parallel {parallel} x --ranks {ranks} needs {parallel * ranks} GPUs, "
             f"{len(gpus)} visible ({','.join(gpus)}): lower --parallel or --ranks")
    return [gpus[i * ranks:(i + 1) * ranks] for i in range(parallel)]


def plan(args: Args) -> tuple[Experiment, list[Run], list[str]]:
    """The experiment, its runs, and one-line notes (skipped configurations); exits on errors."""
    exp = EXPERIMENTS.get(args.name)
    if exp is None:
        fail(f"unknown experiment {args.name!r}; choose from {', '.join(EXPERIMENTS)}")
    configs = list(exp.configs)
    if args.only:
        labels = [c.label for c in configs]
        if bad := [o for o in args.only if o not in labels]:
            fail(f"{args.name} has no configuration {', '.join(map(repr, bad))}; "
                 f"it has {', '.join(labels)}")
        configs = [c for c in configs if c.label in args.only]
    if args.parallel < 1 or args.ranks < 1:
        fail("--parallel and --ranks must be at least 1")
    sets = {"atari49": atari_scores.NATURE_49, "atari57": tuple(atari_scores.SCORES)}
    games = [game_id(g) for name in (args.games or exp.games) for g in sets.get(name, (name,))]
    from common import envs

    for g in games:
        try:
            envs.ale_game(g)
        except envs.EnvError as e:
            fail(str(e))
    notes, kept = [], []
    for c in configs:
        note = registry.missing_note(c.algo)
        if note:
            notes.append(note.replace(f"skipping {c.algo}", f"skipping {c.label}"))
        else:
            kept.append(c)
    root = Path(args.runs).resolve() / args.name
    runs = [Run(c, g, s, root / g.replace(":", "_").replace("/", "_") / c.label / f"seed{s}")
            for g in games for c in kept for s in (args.seeds or exp.seeds)]
    return exp, runs, notes


def main() -> None:
    stop_on_sigterm()
    args = checked(tyro.cli(Args))
    exp, runs, notes = plan(args)
    todo = [r for r in runs if not r.finished(args.total_timesteps or exp.total_timesteps)]
    if args.print_commands:
        for note in notes:
            print(note, file=sys.stderr)
        for r in todo:
            print(shlex.join(r.command(exp, args.total_timesteps, args.ranks)))
        if len(todo) < len(runs):
            print(f"note: {len(runs) - len(todo)} finished runs left out", file=sys.stderr)
        return
    for note in notes:
        print(note)
    for r in runs:
        if r not in todo:
            print(f"skip {r.run_dir} (finished: summary.json exists)")
    if not todo:
        print("nothing to run")
        return
    slots: Queue = Queue()  # a slot is a set of GPUs (or nothing on a CPU machine)
    for slot in gpu_slots(visible_gpus(), args.parallel, args.ranks):
        slots.put(slot)
    logs = Path(args.runs).resolve() / args.name / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    running: set[Training] = set()
    stopping = threading.Event()

    def launch(i: int, r: Run) -> bool:
        if stopping.is_set():
            return False
        slot = slots.get()
        try:
            cmd = r.command(exp, args.total_timesteps, args.ranks)
            log = logs / f"{r.run_dir.parent.parent.name}__{r.config.label}__seed{r.seed}.log"
            print(f"[{i}/{len(todo)}] start {r.config.label} {r.game} seed {r.seed}"
                  + (f" on GPU {','.join(slot)}" if slot else ""), flush=True)
            t0 = time.time()
            # appended to: a resumed run's earlier attempts stay in its log
            run = Training(cmd, log, append=True,
                           env={"CUDA_VISIBLE_DEVICES": ",".join(slot)} if slot else None)
            running.add(run)
            code = run.run(grace=None).returncode
            running.discard(run)
            ok = code == 0 and r.finished(args.total_timesteps or exp.total_timesteps)
            if stopping.is_set() and not ok:
                print(f"[{i}/{len(todo)}] stopped: {r.config.label} {r.game} seed {r.seed}",
                      flush=True)
                return False
            print(f"[{i}/{len(todo)}] {'done' if ok else f'FAILED (exit {code}), see {log}'}: "
                  f"{r.config.label} {r.game} seed {r.seed}, {time.time() - t0:.0f} s",
                  flush=True)
            return ok
        finally:
            slots.put(slot)

    pool = ThreadPoolExecutor(args.parallel)
    try:
        ok = list(pool.map(launch, range(1, len(todo) + 1), todo))
    except KeyboardInterrupt:  # Ctrl-C or SIGTERM: every running run checkpoints and stops
        stopping.set()
        pool.shutdown(wait=False, cancel_futures=True)
        for run in list(running):  # each finishes its iteration and checkpoints
            threading.Thread(target=run.stop, args=(None,)).start()
        for run in list(running):
            run.proc.wait()
        print("interrupted: the same command continues the sweep", file=sys.stderr)
        sys.exit(130)
    pool.shutdown()
    print(f"{sum(ok)} of {len(todo)} runs finished; plot with: python benchmarks/plot.py "
          f"{Path(args.runs) / args.name}")
    if not all(ok):
        sys.exit(1)


if __name__ == "__main__":
    main()
