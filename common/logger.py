"""Rank-0 logging: TensorBoard (CleanRL-compatible tags), a live progress line, summary.json.

Episode statistics are gathered from every rank at each log call, so `charts/episodic_return`
and `mean_return_last100` cover all environments of the run, not only rank 0's.
"""

from __future__ import annotations

import collections
import contextlib
import json
import re
import sys
import time
from dataclasses import asdict
from pathlib import Path

import torch

from common import dist, gpu

PHASES = ("env", "inference", "learn", "comm")


class PhaseClock:
    """Seconds per phase since the last log call, as Logger.log takes them: a sampler's own
    `time_env` / `time_inference` counters, and what `with phases("learn"):` times with the
    device clock (a GPU's queued work belongs to the phase that queued it). Time a phase only
    when it runs: on a GPU each reading waits for the device."""

    def __init__(self, device: torch.device, sampler=None):
        self.device, self.sampler, self.times = device, sampler, {}
        self.base = (sampler.time_env, sampler.time_inference) if sampler is not None else None
        self.pop()

    @contextlib.contextmanager
    def __call__(self, phase: str):
        t0 = gpu.clock(self.device)
        yield
        self.add(phase, gpu.clock(self.device) - t0)

    def add(self, phase: str, seconds: float, taken_from: str | None = None) -> None:
        """`seconds` to `phase`; `taken_from`: the timed phase they were part of (the
        all-reduce measured inside learning is communication, not learning)."""
        self.times[phase] = self.times.get(phase, 0.0) + seconds
        if taken_from:
            self.times[taken_from] -= seconds

    def pop(self) -> dict[str, float]:
        """The phases since the last pop, and a new start."""
        out = self.times
        if self.sampler is not None:
            out["env"] = self.sampler.time_env - self.base[0]
            out["inference"] = self.sampler.time_inference - self.base[1]
            self.base = (self.sampler.time_env, self.sampler.time_inference)
        self.times = {"learn": 0.0, "comm": 0.0, "eval": 0.0}
        return out


class Logger:
    """`state`: the checkpoint a run resumes from (or None). The episode statistics continue from
    it, and TensorBoard hides any events an interrupted attempt wrote after its step."""

    def __init__(self, run_dir: Path, world: dist.World, args, state: dict | None = None,
                 global_batch: int = 0):
        saved = (state or {}).get("logger", {})
        start_step = state["global_step"] if state else 0
        self.world, self.args, self.run_dir = world, args, run_dir
        self.start_step, self.start_time = start_step, time.time()
        self.last_step, self.last_time = start_step, self.start_time
        self.returns = collections.deque(saved.get("returns", []), maxlen=100)
        self.episodes = saved.get("episodes", 0)
        self.restarts = saved.get("restarts", 0) + 1 if state else 0  # resumes of this run
        self.phase_total: dict[str, float] = dict.fromkeys(PHASES, 0.0)
        self.tty = sys.stdout.isatty()
        self.writer = self.tracked = None
        self.end = args.total_timesteps  # where the run stops: whole iterations (_plan)
        if world.is_main:
            from torch.utils.tensorboard import SummaryWriter

            self.tracked = track(args, run_dir) if args.track else None  # before the writer
            self.writer = SummaryWriter(str(run_dir), purge_step=start_step + 1 if state else None)
            if state is None:
                table = "\n".join(f"|{k}|{v}|" for k, v in asdict(args).items())
                self.writer.add_text("hyperparameters", f"|param|value|\n|-|-|\n{table}")
            self._plan(global_batch)

    def _plan(self, global_batch: int) -> None:
        """Say where the run goes and what it really takes: the budget rounded up to whole
        iterations of the global batch (all ranks' steps per iteration)."""
        total, left = self.args.total_timesteps, self.args.total_timesteps - self.start_step
        print(f"run directory: {self.run_dir}", flush=True)
        if global_batch > 0 and left > 0:
            iters = -(-left // global_batch)
            end = self.end = self.start_step + iters * global_batch  # the progress line's total
            note = "" if end == total else (f" (--total-timesteps {total:,} rounded up to whole "
                                             f"iterations)")
            print(f"training to step {end:,}: {iters:,} iterations of {global_batch:,} steps "
                  f"over {self.world.world_size} rank(s) on {self.world.device}{note}", flush=True)

    def state(self) -> dict:
        """What a checkpoint keeps so that summary.json counts the episodes before a resume."""
        return {"episodes": self.episodes, "returns": list(self.returns), "restarts": self.restarts}

    def log(self, global_step: int, scalars: dict[str, float], episodes: list[tuple[float, int]],
            phases: dict[str, float], status: str = "", warmup_until: int = 0) -> None:
        """Called by every rank together. `phases`: seconds per phase since the last call;
        `status`: a note for the progress line (the DQN family's epsilon); `warmup_until`: the
        step where learning starts (the DQN family's), before which steps cost a fraction of
        what they will and the progress line gives no ETA."""
        all_episodes = [ep for eps in dist.all_gather(episodes) for ep in eps]
        if not self.world.is_main:
            return
        w, now = self.writer, time.time()
        for ret, length in all_episodes:
            w.add_scalar("charts/episodic_return", ret, global_step)
            w.add_scalar("charts/episodic_length", length, global_step)
            self.returns.append(ret)
        self.episodes += len(all_episodes)
        sps = (global_step - self.last_step) / max(now - self.last_time, 1e-9)
        w.add_scalar("charts/SPS", sps, global_step)
        for k, v in scalars.items():
            w.add_scalar(k, v, global_step)
        for k, v in phases.items():
            w.add_scalar(f"time/{k}", v, global_step)
            self.phase_total[k] = self.phase_total.get(k, 0.0) + v
        self.last_step, self.last_time = global_step, now
        self._progress(global_step, sps, status, warmup_until)

    def eval(self, global_step: int, result: dict) -> dict:
        """Record an evaluation (common/evaluation.py) at `global_step`; return it with its step."""
        result = {**result, "global_step": global_step}
        if self.writer is not None and result["episodes"]:
            self.writer.add_scalar("charts/eval_return", result["mean_return"], global_step)
            self.writer.add_scalar("charts/eval_episodes", result["episodes"], global_step)
            self.writer.add_scalar("charts/eval_length",
                                   sum(result["lengths"]) / result["episodes"], global_step)
            print(f"{chr(10) if self.tty else ''}eval at step {global_step:,}: mean return "
                  f"{result['mean_return']:.2f} over {result['episodes']} "
                  f"game{'s' * (result['episodes'] != 1)}", flush=True)
        return result

    def _progress(self, step: int, sps: float, status: str = "", warmup_until: int = 0) -> None:
        total = self.end
        recent = f"{sum(self.returns) / len(self.returns):8.2f}" if self.returns else "     n/a"
        left = max(0.0, (total - step) / sps) if sps > 0 else 0.0  # the last batch may overshoot
        eta = ("after warm-up" if step < warmup_until else
               f"{int(left // 3600)}:{int(left % 3600 // 60):02d}:{int(left % 60):02d}")
        line = (f"step {step:>11,}/{total:,} ({100 * step / total:5.1f}%) | SPS {sps:8,.0f} | "
                f"return(last 100) {recent} | episodes {self.episodes:,} | eta {eta}"
                + (f" | {status}" if status else ""))
        print(("\r" + line) if self.tty else line, end="" if self.tty else "\n", flush=True)

    def summary(self, global_step: int, evaluation: dict | None = None, **extra) -> dict:
        """Write summary.json (rank 0); SPS counts this process's steps only (not a resumed past).
        `evaluation`: the last one (the final evaluation at the end of a run)."""
        if not self.world.is_main:
            return {}
        wall = time.time() - self.start_time
        ev = evaluation or {}
        out = {
            "global_step": global_step,
            "wall_seconds": wall,
            "sps": (global_step - self.start_step) / max(wall, 1e-9),
            "episodes": self.episodes,
            "restarts": self.restarts,
            "mean_return_last100": sum(self.returns) / len(self.returns) if self.returns else None,
            "world_size": self.world.world_size,
            "device": str(self.world.device),
            "gpu": self.world.device.type == "cuda",
            "phase_seconds": self.phase_total,
            "switches": gpu.switches(self.world.device),  # the GPU habits, --compile
            "gpu_memory_bytes": torch.cuda.max_memory_allocated(self.world.device)
            if self.world.device.type == "cuda" else None,
            "eval_return": ev.get("mean_return"),
            "eval_episodes": ev.get("episodes", 0),
            "eval_step": ev.get("global_step"),
            "eval_returns": ev.get("returns", []),
            "eval_lengths": ev.get("lengths", []),
            **extra,
            # the flag, renamed so that it is not read as where the run ran (that is "device")
            "args": {("cuda_requested" if k == "cuda" else k): v
                     for k, v in asdict(self.args).items()},
        }
        (self.run_dir / "summary.json").write_text(json.dumps(out, indent=2, default=str))
        if self.tracked is not None:
            self.tracked.summary.update({k: out[k] for k in (
                "global_step", "sps", "episodes", "mean_return_last100", "eval_return")})
        return out

    def video(self, path: Path, global_step: int) -> None:
        """A recorded game (--capture-video), uploaded with --track."""
        if self.tracked is not None:
            import wandb
            self.tracked.log({"videos/game": wandb.Video(str(path), format="mp4"),
                              "global_step": global_step})

    def close(self) -> None:
        if self.writer is not None:
            if self.tty:
                print()
            self.writer.close()
        if self.tracked is not None:
            self.tracked.finish()


def track(args, run_dir: Path):
    """--track (CleanRL's flags): a Weights & Biases run named after the run directory, its id
    too (a resumed run continues it), the flags as its config, and TensorBoard's scalars synced
    from the run's own writer (logged once, read by W&B). WANDB_MODE=offline keeps it in
    run_dir/wandb/ for `wandb sync`. The events file is not copied into the W&B run
    (sync_tensorboard=True would): W&B watches the run directory, its own folder inside, and
    with the run directory under the working directory (the default runs/...) it copied its
    copies, link by link, syncing every scalar again each time."""
    import wandb

    wandb.tensorboard.patch(root_logdir=str(run_dir), save=False)
    return wandb.init(project=args.wandb_project_name, entity=args.wandb_entity,
                      name=run_dir.name, id=re.sub(r"[^A-Za-z0-9_-]", "-", run_dir.name)[-64:],
                      resume="allow", dir=str(run_dir), config=asdict(args), save_code=False)
