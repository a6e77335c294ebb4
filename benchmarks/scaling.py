"""Scaling: the paper's Table 2 (hours for 50M steps on 1, 2, 4, 8 GPUs) measured on this machine.

More: docs/benchmarks.md, `benchmarks/scaling.py`.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import tyro

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchmarks import outputs, registry  # noqa: E402
from benchmarks.errors import checked, fail, stop_on_sigterm  # noqa: E402
from benchmarks.training import (Training, as_typed, command, phase_shares,  # noqa: E402
                                 scalars, summary, typed_path)

STEPS_50M = 50_000_000


@dataclass
class Args:
    algos: tuple[str, ...] = tuple(registry.ALGOS)
    """configurations to measure (benchmarks/registry.py); those whose script is missing are
    skipped"""
    ranks: tuple[int, ...] = (1, 2, 4, 8)
    """rank counts (torchrun --nproc_per_node); counts that do not fit the machine are skipped"""
    env_id: str = "Pong-v5"
    """game every run plays"""
    warmup: float = 60.0
    """seconds after a run's first progress line before measuring (replay: also until learning)"""
    seconds: float = 120.0
    """measured seconds after the warm-up; the run stops at its next logging interval after that"""
    stop_timeout: float = 600.0
    """seconds a run may take to stop after SIGTERM before it is killed (and reported failed)"""
    cuda: bool = True
    """GPUs (one per rank, NCCL) when present; --no-cuda: CPU ranks with gloo"""
    seed: int = 1
    """seed of every run"""
    flags: str = ""
    """extra flags for every run, e.g. --flags='--num-envs 32' (one string, split on spaces)"""
    out: str | None = None
    """output prefix, written as given (overwriting); default
    runs/benchmarks/scaling-<host>-<device>, or the next free one numbered -2, -3, ..."""
    keep_runs: str | None = None
    """keep the run directories under this folder (default: a temporary folder, deleted)"""


@dataclass
class Result:
    algo: str
    ranks: int
    cmd: str
    returncode: int | None = None
    steady_sps: float | None = None
    steady_seconds: float | None = None
    steady_steps: int | None = None
    hours_50m: float | None = None
    phase_share: dict = field(default_factory=dict)
    speedup: float | None = None
    efficiency: float | None = None
    summary: dict = field(default_factory=dict)
    load_average: float | None = None  # 1-minute load average when the measurement ended
    error: str | None = None


def steady_state(run_dir: Path, start_step: int) -> dict:
    """Steps/s and phase shares between the logging event at start_step and the last one."""
    series, _ = scalars(run_dir)
    marks = [(t, s) for t, s, _ in series.get("charts/SPS", []) if s >= start_step]
    if len(marks) < 2:
        raise ValueError("fewer than 2 logging intervals after the warm-up: raise --seconds")
    (t0, s0), (t1, s1) = marks[0], marks[-1]
    spent = {tag[len("time/"):]: sum(v for _, s, v in events if s0 < s <= s1)
             for tag, events in series.items() if tag.startswith("time/")}
    return {"steady_sps": (s1 - s0) / (t1 - t0), "steady_seconds": t1 - t0,
            "steady_steps": s1 - s0, "phase_share": phase_shares(spent, t1 - t0) or {}}


def run_one(name: str, ranks: int, args: Args, use_cuda: bool, run_dir: Path) -> Result:
    algo = registry.ALGOS[name]
    flags = [*algo.flags, *algo.scale, *(() if use_cuda else algo.cpu), *args.flags.split()]
    cmd = command(registry.script_path(algo), [
        "--env-id", args.env_id, "--seed", str(args.seed), "--total-timesteps", str(10**12),
        "--run-dir", str(run_dir), "--cuda" if use_cuda else "--no-cuda", *flags], ranks)
    folder = "<keep-runs>" if args.keep_runs else "<tmp>"  # as a user reads it, on any machine
    res = Result(name, ranks, " ".join(as_typed(cmd, run_dir.parent, folder)[1:]))
    env = None if use_cuda else {
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS",
                                          str(max(1, (os.cpu_count() or 1) // ranks)))}
    warm, start = None, None  # steps before steady state (the run's flags); its first step

    def measured(t: Training) -> bool:
        """Stop once --seconds have passed since the warm-up ended (or it never ends)."""
        nonlocal warm, start
        if start is None:
            if t.elapsed > args.warmup + args.stop_timeout:
                res.error = (f"no steady state within {args.warmup + args.stop_timeout:g} s "
                             "(no progress, or learning never started); stopped")
                return True
            if not t.progress:
                return False
            if warm is None:
                warm = registry.warm_steps(algo, json.loads((run_dir / "args.json").read_text()))
            first = t.progress[0][0]
            start = next(((s, at) for at, s in t.progress if at - first >= args.warmup
                          and s > warm), None)
            return False
        if t.elapsed >= start[1] + args.seconds:
            res.load_average = os.getloadavg()[0]
            return True
        return False

    t = Training(cmd, env=env).run(until=measured, grace=args.stop_timeout)
    # A clean stop: every rank checkpointed and exited 0, so torchrun exits 0, and rank 0
    # wrote summary.json.
    res.returncode = t.returncode
    if t.killed:
        res.error = f"did not stop within {args.stop_timeout:g} s of SIGTERM; killed"
    elif t.returncode != 0 and not res.error:
        res.error = f"torchrun exited {t.returncode}: " + t.tail(1)
    s = summary(run_dir)
    res.summary = {k: s.get(k) for k in ("global_step", "wall_seconds", "sps", "world_size",
                                         "device", "phase_seconds")} if s else {}
    if start is None:
        res.error = res.error or "exited before the warm-up ended: " + t.tail(1)
        return res
    try:
        res.__dict__.update(steady_state(run_dir, start[0]))
        res.hours_50m = STEPS_50M / res.steady_sps / 3600
    except ValueError as e:
        res.error = res.error or str(e)
    if not s and not res.error:
        res.error = "no summary.json: the run did not stop cleanly: " + t.tail(3)
    return res


def derived(results: list[Result]) -> None:
    """Speed-up and efficiency against each configuration's smallest measured rank count."""
    for name in {r.algo for r in results}:
        ok = sorted((r for r in results if r.algo == name and r.steady_sps), key=lambda r: r.ranks)
        for r in ok:
            base = ok[0]
            r.speedup = r.steady_sps / base.steady_sps
            r.efficiency = r.speedup / (r.ranks / base.ranks)


def markdown(results: list[Result], ranks: list[int], hw: dict, args: Args) -> str:
    by = {(r.algo, r.ranks): r for r in results}
    names = [n for n in registry.ALGOS if any(r.algo == n for r in results)]  # paper's order
    cols = sorted(set(ranks) | set(registry.PAPER_RANKS))
    out = [f"Hours for 50M steps (200M frames), {args.env_id}: ours (paper, DGX-1: P100 GPUs, "
           "5 CPU cores each)", "",
           "| algorithm | " + " | ".join(f"{c} rank{'s' * (c > 1)}" for c in cols) + " |",
           "|---" * (len(cols) + 1) + "|"]
    for n in names:
        paper = dict(zip(registry.PAPER_RANKS, registry.ALGOS[n].paper_hours))
        cells = []
        for c in cols:
            r = by.get((n, c))
            ours = f"{r.hours_50m:,.1f}" if r and r.hours_50m else ("failed" if r else "-")
            cells.append(f"{ours} ({paper[c] if paper.get(c) is not None else '-'})")
        out.append(f"| {n} | " + " | ".join(cells) + " |")
    phases = sorted({k for r in results for k in r.phase_share} - {"other"})
    phases += ["other"] * any("other" in r.phase_share for r in results)
    out += ["", "| algorithm | ranks | steps/s | hours/50M | speed-up | efficiency | "
            + " | ".join(phases) + " |", "|---" * (6 + len(phases)) + "|"]
    for n in names:
        for c in ranks:
            r = by.get((n, c))
            if r is None:
                continue
            if not r.steady_sps:
                out.append(f"| {n} | {c} | failed: {r.error} |")
                continue
            out.append(f"| {n} | {c} | {r.steady_sps:,.0f} | {r.hours_50m:,.1f} | "
                       f"{r.speedup:.2f} | {r.efficiency:.2f} | "
                       + " | ".join(f"{100 * r.phase_share[p]:.0f}%" if p in r.phase_share
                                    else "" for p in phases) + " |")
    out += ["", f"Hardware: {hw['line']}. Steady state: {args.seconds:g} s after a "
            f"{args.warmup:g} s warm-up, from the runs' TensorBoard events; phases: share of that "
            "wall time in each time/* scalar (APPO's env and inference run in its sampler "
            "process, beside the learner)."]
    return "\n".join(out) + "\n"


def plot(results: list[Result], path: Path, hw: dict, env_id: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4.5))
    for name in dict.fromkeys(r.algo for r in results):
        ok = sorted((r for r in results if r.algo == name and r.steady_sps), key=lambda r: r.ranks)
        if not ok:
            continue
        xs = [r.ranks for r in ok]
        line, = ax.plot(xs, [r.steady_sps for r in ok], "o-", label=name)
        ax.plot(xs, [ok[0].steady_sps * x / xs[0] for x in xs], "--", color=line.get_color(),
                alpha=0.5)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ticks = sorted({r.ranks for r in results})
    ax.set_xticks(ticks, [str(t) for t in ticks])
    ax.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
    ax.set_xlabel("ranks")
    ax.set_ylabel("steady-state steps/s")
    ax.set_title(f"Scaling on {env_id} (dashed: ideal, linear from the fewest ranks)", fontsize=9)
    ax.legend(fontsize=8)
    fig.text(0.01, 0.01, hw["line"], fontsize=6)
    fig.tight_layout(rect=(0, 0.03, 1, 1))
    fig.savefig(path, dpi=80)
    plt.close(fig)


def output_prefix(args: Args, use_cuda: bool) -> Path:
    """Where PREFIX.json, .md and .png go: --out as given, else a default that is free."""
    if args.out:
        return Path(args.out)
    device = "cuda" if use_cuda else "cpu"
    return outputs.unused(outputs.RUNS / f"scaling-{outputs.host()}-{device}",
                          (".json", ".md", ".png"))


def main() -> None:
    stop_on_sigterm()  # a SIGTERM stops the current run cleanly, as Ctrl-C does
    args = checked(tyro.cli(Args))
    if error := registry.check_names(args.algos):
        fail(error)
    if not args.ranks:
        fail("--ranks needs at least one number of ranks")
    from common import envs

    try:
        envs.ale_game(args.env_id)
    except envs.EnvError as e:
        fail(str(e))
    import torch

    use_cuda = args.cuda and torch.cuda.is_available()
    capacity, unit = ((torch.cuda.device_count(), "GPUs") if use_cuda
                      else (os.cpu_count() or 1, "CPU cores"))
    ranks = []
    for r in sorted(set(args.ranks)):
        if r > capacity:
            print(f"note: skipping {r} ranks: this machine has {capacity} {unit}")
        else:
            ranks.append(r)
    if not ranks:
        fail(f"no rank count fits this machine ({capacity} {unit})")
    names = []
    for n in args.algos:
        if note := registry.missing_note(n):
            print(note)
        else:
            names.append(n)
    if not names:
        fail("none of the chosen configurations has its script on disk")
    hw = outputs.hardware(torch.device("cuda" if use_cuda else "cpu"))
    print(f"hardware: {hw['line']}", flush=True)

    results: list[Result] = []
    keep = Path(args.keep_runs) if args.keep_runs else None
    interrupted = False
    with tempfile.TemporaryDirectory(prefix="accelrl-scaling-") as tmp:
        base = keep or Path(tmp)
        try:
            for n in names:
                for r in ranks:
                    run_dir = base / f"{n}__{r}ranks__{int(time.time())}"
                    print(f"measuring {n} on {r} rank{'s' * (r > 1)} ...", flush=True)
                    res = run_one(n, r, args, use_cuda, run_dir)
                    results.append(res)
                    print(f"  {res.steady_sps:,.0f} steps/s" if res.steady_sps
                          else f"  failed: {res.error}", flush=True)
        except KeyboardInterrupt:  # the current run was stopped cleanly; keep what was measured
            interrupted = True
            print("interrupted: writing the runs measured so far", file=sys.stderr)
    if not results:
        sys.exit(130)
    derived(results)
    table = markdown(results, ranks, hw, args)
    print("\n" + table)
    prefix = output_prefix(args, use_cuda)
    prefix.parent.mkdir(parents=True, exist_ok=True)
    rows = [{**asdict(r), "paper_hours": dict(zip(registry.PAPER_RANKS,
                                                  registry.ALGOS[r.algo].paper_hours))}
            for r in results]
    path = {ext: Path(f"{prefix}.{ext}") for ext in ("json", "md", "png")}  # host may hold dots
    record = {**asdict(args), "out": typed_path(args.out), "keep_runs": typed_path(args.keep_runs)}
    path["json"].write_text(json.dumps(
        {"hardware": hw, "args": record, "device": "cuda" if use_cuda else "cpu",
         "ranks": ranks, "results": rows, "table_markdown": table}, indent=2, default=str))
    path["md"].write_text(table)
    plot(results, path["png"], hw, args.env_id)
    print(f"wrote {prefix}.json, .md, .png")
    if interrupted:
        sys.exit(130)
    if any(r.steady_sps is None for r in results):
        sys.exit(1)


if __name__ == "__main__":
    main()
