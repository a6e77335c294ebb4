"""Learning curves and human-normalised scores from run directories.

    python benchmarks/plot.py runs/experiments/many-envs [more folders ...] [--out DIR]
    python benchmarks/plot.py RUN_DIR [RUN_DIR ...] [--out DIR]

More: docs/benchmarks.md, `benchmarks/plot.py`.
"""

from __future__ import annotations

import csv
import json
import os
import re
import statistics
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated

import numpy as np
import tyro

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchmarks import atari_scores, outputs, registry  # noqa: E402
from benchmarks.errors import checked  # noqa: E402
from benchmarks.training import scalars  # noqa: E402


@dataclass
class Args:
    paths: Annotated[tuple[str, ...], tyro.conf.Positional,
                     tyro.conf.arg(metavar="PATH", help_behavior_hint="(required: one or more)")]
    """run directories, or folders to search for them"""
    out: str | None = None
    """output folder. Folders searched: written as given (overwriting); default <first
    path>/plots, beside the runs (under runs/ for experiments.py's), or the next free one.
    Run directories: default runs/plots/ of the checkout; runs.* there or runs-2.*, never over
    a file"""
    window: int = 100
    """games in each run's running mean"""
    points: int = 200
    """points per plotted line"""


@dataclass
class RunData:
    path: Path
    game: str
    config: str
    seed: int
    score: float | None  # mean_return_last100
    # (env steps, hours since the first event, true game score) per finished game
    episodes: list[tuple[int, float, float]] = field(default_factory=list)
    # (env steps, hours since the first event, mean score of the evaluation's games)
    evals: list[tuple[int, float, float]] = field(default_factory=list)
    last_step: int | None = None  # the run's last logged step, finished game or not
    started: float = 0.0  # Unix time of the run's first event, where "hours" count from
    state: str = "finished"  # or how it ended early (run_state)

    @property
    def hns(self) -> float | None:
        return atari_scores.human_normalised(self.game, self.score)


def config_label(run_dir: Path) -> str:
    if re.fullmatch(r"seed\d+", run_dir.name):
        return run_dir.parent.name
    parts = run_dir.name.split("__")
    return parts[1] if len(parts) == 4 else run_dir.name


def find_runs(paths: list[Path]) -> list[Path]:
    found = set()
    for p in paths:
        for f in [*p.rglob("summary.json"), *p.rglob("events.out.tfevents.*")]:
            if "checkpoints" not in f.parts:
                found.add(f.parent)
    return sorted(found)


def load_run(run_dir: Path) -> RunData:
    summary_path, args_path = run_dir / "summary.json", run_dir / "args.json"
    summary = json.loads(summary_path.read_text()) if summary_path.is_file() else {}
    run_args = summary.get("args") or (json.loads(args_path.read_text())
                                       if args_path.is_file() else {})
    series, t0 = scalars(run_dir)
    t0 = t0 or 0.0
    events, evals = series.get("charts/episodic_return", []), series.get("charts/eval_return", [])
    steps = [step for _, step, _ in series.get("charts/SPS", [])]  # every log call, games or not
    # Games logged in one call share its step; give them one time too (the call's last).
    logged = {}
    for wall, step, _ in events:
        logged[step] = max(logged.get(step, 0.0), wall)
    events = sorted(events, key=lambda e: (e[1], e[0]))  # the order the games were logged in
    episodes = [(step, (logged[step] - t0) / 3600, v) for _, step, v in events]
    evals = sorted((step, (wall - t0) / 3600, v) for wall, step, v in evals)
    last = max([summary.get("global_step") or 0, *steps, *(e[0] for e in episodes),
                *(e[0] for e in evals)]) if (summary or steps or episodes or evals) else None
    return RunData(run_dir, run_args.get("env_id", "?"), config_label(run_dir),
                   int(run_args.get("seed", 0)), summary.get("mean_return_last100"), episodes,
                   evals, last, t0, run_state(summary, run_args, last))


def run_state(summary: dict, run_args: dict, last: int | None) -> str:
    """"finished", or how a run ended before its --total-timesteps: a run writes summary.json
    when it ends or is stopped by a signal, not when it crashes or is killed."""
    total = run_args.get("total_timesteps")
    if not summary:
        return (f"no summary.json: crashed, killed or running (last log at step {last:,})"
                if last is not None else "no summary.json: crashed, killed or running")
    step = summary.get("global_step")
    if step is not None and total is not None and step < total:
        return f"stopped at step {step:,} of {total:,}"
    return "finished"


def running_mean(values: np.ndarray, window: int) -> np.ndarray:
    c = np.cumsum(np.insert(values, 0, 0.0))
    idx = np.arange(1, len(values) + 1)
    lo = np.maximum(idx - window, 0)
    return (c[idx] - c[lo]) / (idx - lo)


def curves(runs: list[RunData], window: int, points: int) -> list[dict]:
    """Mean, min and max over seeds per (game, config, axis), as rows for the CSV."""
    rows = []
    groups: dict[tuple[str, str], list[RunData]] = {}
    for r in runs:
        if r.episodes:
            groups.setdefault((r.game, r.config), []).append(r)
    for (game, config), members in sorted(groups.items()):
        for axis, col in (("env_steps", 0), ("hours", 1)):
            xs = [np.array([e[col] for e in r.episodes], float) for r in members]
            ys = [running_mean(np.array([e[2] for e in r.episodes], float), window)
                  for r in members]
            lo, hi = min(x[0] for x in xs), min(x[-1] for x in xs)
            grid = np.unique(np.concatenate(xs))  # the points the runs have, thinned
            grid = grid[(grid >= lo) & (grid <= hi)]
            if len(grid) > points:
                grid = grid[np.linspace(0, len(grid) - 1, points).round().astype(int)]
            # np.interp needs increasing x: repeated steps (games ending in one logging
            # interval) keep their last value, which is the running mean after all of them.
            stack = []
            for x, y in zip(xs, ys):
                ux, last = np.unique(x[::-1], return_index=True)
                stack.append(np.interp(grid, ux, y[::-1][last]))
            stack = np.array(stack)
            for i, x in enumerate(grid):
                rows.append({"game": game, "config": config, "axis": axis,
                             "x": round(float(x), 6), "mean": round(float(stack[:, i].mean()), 4),
                             "min": round(float(stack[:, i].min()), 4),
                             "max": round(float(stack[:, i].max()), 4), "seeds": len(members)})
    return rows


def plot_games(rows: list[dict], out: Path, window: int) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    for game in sorted({r["game"] for r in rows}):
        fig, axes = plt.subplots(1, 2, figsize=(10, 4))
        for ax, axis, label in ((axes[0], "env_steps", "environment steps"),
                                (axes[1], "hours", "wall-clock hours")):
            for config in sorted({r["config"] for r in rows if r["game"] == game}):
                pts = [r for r in rows
                       if (r["game"], r["config"], r["axis"]) == (game, config, axis)]
                x = [p["x"] for p in pts]
                seeds = pts[0]["seeds"]
                line, = ax.plot(x, [p["mean"] for p in pts], "o-" if len(pts) == 1 else "-",
                                label=f"{config} ({seeds} seed{'s' * (seeds > 1)})")
                ax.fill_between(x, [p["min"] for p in pts], [p["max"] for p in pts],
                                color=line.get_color(), alpha=0.2)
            ax.set_xlabel(label)
            ax.set_ylabel(f"game score (mean of last {window} games)")
            ax.grid(alpha=0.3)
        axes[0].legend(fontsize=8)
        fig.suptitle(f"{game}: mean over seeds, band = min to max over seeds", fontsize=10)
        fig.tight_layout()
        path = out / f"{re.sub(r'[^A-Za-z0-9_.-]', '_', game)}.png"
        fig.savefig(path, dpi=80)
        plt.close(fig)
        written.append(path)
    return written


def score_tables(runs: list[RunData]) -> tuple[str, dict[str, float | None]]:
    """Markdown: per run (named by its folder, with how it ended), then per configuration the
    median over games of the seed-mean HNS."""
    lines = ["| configuration | game | seed | score (last 100 games) | human-normalised | run | "
             "ended |", "|---|---|---|---|---|---|---|"]
    labels = dict(zip((r.path for r in runs), run_labels(runs)))
    for r in sorted(runs, key=lambda r: (r.config, r.game, r.seed, str(r.path))):
        score = "n/a" if r.score is None else f"{r.score:.2f}"
        lines.append(f"| {r.config} | {r.game} | {r.seed} | {score} | "
                     + ("n/a" if r.hns is None else f"{r.hns:.3f}")
                     + f" | {labels[r.path]} | {r.state} |")
    medians: dict[str, float | None] = {}
    lines += ["", "| configuration | games with reference scores | median human-normalised | "
              "paper |", "|---|---|---|---|"]
    for config in sorted({r.config for r in runs}):
        per_game: dict[str, list[float]] = {}
        for r in runs:
            if r.config == config and r.hns is not None:
                per_game.setdefault(r.game, []).append(r.hns)
        means = [statistics.fmean(v) for v in per_game.values()]
        medians[config] = statistics.median(means) if means else None
        algo = registry.ALGOS.get(config)
        paper = algo.paper_median if algo and algo.paper_median is not None else "-"
        lines.append(f"| {config} | {len(means)} | "
                     + ("n/a" if medians[config] is None else f"{medians[config]:.3f}")
                     + f" | {paper} |")
    return "\n".join(lines) + "\n", medians


def is_run(path: Path) -> bool:
    return path.is_dir() and ((path / "summary.json").is_file()
                              or any(path.glob("events.out.tfevents.*")))


def run_labels(runs: list[RunData]) -> list[str]:
    """Each run's folder name, or its path below the runs' common folder where names repeat
    (experiments.py's seed1, seed2... under several configurations)."""
    names = [r.path.name for r in runs]
    if len(set(names)) == len(names):
        return names
    common = Path(os.path.commonpath([str(r.path.resolve()) for r in runs]))
    return [str(r.path.resolve().relative_to(common)) or r.path.name for r in runs]


def train_curve(run: RunData, window: int) -> list[tuple[int, float, float]]:
    """(env steps, hours, running mean over `window` games) at each step that logged games: the
    games of one log call share its step and time, and the point is the mean after all of them."""
    means = running_mean(np.array([e[2] for e in run.episodes], float), window)
    last = {}
    for (step, hours, _), mean in zip(run.episodes, means):  # sorted by step: the last one wins
        last[step] = (step, hours, float(mean))
    return list(last.values())


def run_points(runs: list[RunData], labels: list[str], window: int) -> list[dict]:
    """Every point of the ordinary-runs figure: training (running mean) and evaluation scores."""
    rows = []
    for r, label in zip(runs, labels):
        for curve, points in (("train", train_curve(r, window)), ("eval", r.evals)):
            for step, hours, score in points:
                rows.append({"run": label, "game": r.game, "curve": curve, "env_steps": step,
                             "hours": round(hours, 6), "score": round(score, 4)})
    return rows


def plot_runs(runs: list[RunData], labels: list[str], path: Path, window: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    evaluated = any(r.evals for r in runs)
    fig, axes = plt.subplots(2 if evaluated else 1, 2, figsize=(10, 7.5 if evaluated else 4),
                             squeeze=False)
    for i, (r, label) in enumerate(zip(runs, labels)):
        color = f"C{i % 10}"  # one colour per run in every panel
        train = train_curve(r, window)
        for col in (0, 1):
            if train:
                axes[0, col].plot([p[col] for p in train], [p[2] for p in train],
                                  "o-" if len(train) == 1 else "-", color=color, label=label)
            if r.evals:
                axes[1, col].plot([e[col] for e in r.evals], [e[2] for e in r.evals], "o-",
                                  color=color, markersize=3, label=label)
    titles = [f"training: game score, mean of last {window} games"]
    if evaluated:
        titles.append("evaluation: mean game score (charts/eval_return)")
    for row, title in enumerate(titles):
        for col, xlabel in enumerate(("environment steps", "wall-clock hours")):
            ax = axes[row, col]
            ax.set_title(title, fontsize=9)
            ax.set_xlabel(xlabel)
            ax.set_ylabel("game score")
            ax.grid(alpha=0.3)
        if axes[row, 0].lines:
            axes[row, 0].legend(fontsize=7)
    games = sorted({r.game for r in runs})
    fig.suptitle(", ".join(games), fontsize=10)
    silent = [label for r, label in zip(runs, labels) if not r.episodes]
    bottom = 0.0
    if silent:  # a run without a curve is still part of the figure
        fig.text(0.01, 0.01, "no finished game yet (no training curve): " + ", ".join(silent),
                 fontsize=8, color="tab:red")
        bottom = 0.04
    fig.tight_layout(rect=(0, bottom, 1, 1))
    fig.savefig(path, dpi=80)
    plt.close(fig)


def run_table(runs: list[RunData], labels: list[str], window: int) -> str:
    """Markdown, one row per run; a run with no finished game says so."""
    fmt = lambda v, spec: "n/a" if v is None else format(v, spec)  # noqa: E731
    lines = [f"| run | game | steps | games | score (last {window} games) | human-normalised | "
             "last evaluation (step) | its human-normalised | ended |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r, label in zip(runs, labels):
        # the curve's last point; summary.json's last-100 mean if the events have no games
        score = statistics.fmean(e[2] for e in r.episodes[-window:]) if r.episodes else r.score
        ev = r.evals[-1] if r.evals else None
        lines.append(
            f"| {label} | {r.game} | {fmt(r.last_step, ',')} | {len(r.episodes)} | "
            + ("no finished game" if score is None else f"{score:.2f}") + " | "
            + fmt(atari_scores.human_normalised(r.game, score), ".3f") + " | "
            + ("none" if ev is None else f"{ev[2]:.2f} ({ev[0]:,})") + " | "
            + fmt(atari_scores.human_normalised(r.game, ev[2]) if ev else None, ".3f")
            + f" | {r.state} |")
    return "\n".join(lines) + "\n"


def plot_run_dirs(args: Args, paths: list[Path]) -> None:
    """Ordinary runs: one curve per run (docs/benchmarks.md)."""
    folder = Path(args.out) if args.out else ROOT / "runs" / "plots"
    folder.mkdir(parents=True, exist_ok=True)
    stem = outputs.unused(folder / "runs", (".png", ".csv", ".md"))
    runs = [load_run(p) for p in paths]
    labels = run_labels(runs)
    with open(f"{stem}.csv", "w", newline="") as f:
        w = csv.DictWriter(f, ["run", "game", "curve", "env_steps", "hours", "score"])
        w.writeheader()
        w.writerows(run_points(runs, labels, args.window))
    plot_runs(runs, labels, Path(f"{stem}.png"), args.window)
    table = run_table(runs, labels, args.window)
    Path(f"{stem}.md").write_text(table)
    print(table)
    silent = [label for r, label in zip(runs, labels) if not r.episodes]
    if silent:
        print(f"no finished game yet, so no training curve: {', '.join(silent)}")
    print(f"{len(runs)} runs; wrote {stem}.png, {stem}.csv, {stem}.md")


def output_dir(args: Args) -> Path:
    return Path(args.out) if args.out else outputs.unused(Path(args.paths[0]) / "plots")


def main() -> None:
    args = checked(tyro.cli(Args))
    paths = [Path(p) for p in args.paths]
    if not paths:
        print("error: give one or more run directories, or folders to search for them",
              file=sys.stderr)
        sys.exit(2)
    if missing := [str(p) for p in paths if not p.exists()]:
        print(f"error: no such path: {', '.join(missing)}", file=sys.stderr)
        sys.exit(2)
    if all(is_run(p) for p in paths):
        return plot_run_dirs(args, paths)
    run_dirs = find_runs(paths)
    if not run_dirs:
        print(f"error: no runs (summary.json or TensorBoard events) under "
              f"{', '.join(map(str, paths))}", file=sys.stderr)
        sys.exit(2)
    out = output_dir(args)
    out.mkdir(parents=True, exist_ok=True)
    runs = [load_run(d) for d in run_dirs]
    rows = curves(runs, args.window, args.points)
    with open(out / "curves.csv", "w", newline="") as f:
        w = csv.DictWriter(f, ["game", "config", "axis", "x", "mean", "min", "max", "seeds"])
        w.writeheader()
        w.writerows(rows)
    pngs = plot_games(rows, out, args.window)
    table, _ = score_tables(runs)
    (out / "scores.md").write_text(table)
    print(table)
    print(f"{len(runs)} runs; wrote {out / 'curves.csv'}, {out / 'scores.md'}, "
          + ", ".join(str(p) for p in pngs))


if __name__ == "__main__":
    main()
