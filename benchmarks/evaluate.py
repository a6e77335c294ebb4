"""Score trained checkpoints on fresh games, and optionally watch a first game as an MP4.

    python benchmarks/evaluate.py RUN_DIR_OR_CHECKPOINT [...] [--episodes 10] [--epsilon E]
                                  [--greedy] [--video PATH.mp4] [--seed S] [--envs N] [--no-cuda]

More: docs/benchmarks.md, `benchmarks/evaluate.py`.
"""

from __future__ import annotations

import dataclasses
import json
import os
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch loads: see algos/*.py
import numpy as np  # noqa: E402
import torch  # noqa: E402
import tyro  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchmarks import atari_scores, outputs  # noqa: E402
from benchmarks.errors import UserError, fail  # noqa: E402
from common import envs, evaluation  # noqa: E402
from common.flag_ranges import out_of_range  # noqa: E402
from common.trained import CheckpointError, load  # noqa: E402
from common.video import FPS, VideoRecorder  # noqa: E402
SEED_TAG = 2 * 10**6  # training's evaluations use 10^6 (common/evaluation.py)


@dataclass
class Args:
    paths: Annotated[tuple[str, ...], tyro.conf.Positional,
                     tyro.conf.arg(metavar="RUN_DIR_OR_CHECKPOINT")]
    """run directories (each its newest good checkpoint) or checkpoint files (step_<N>.pt); with
    several, each is evaluated in turn and gets one line"""
    episodes: int = 10
    """whole games to play, cut ones included"""
    epsilon: float | None = None
    """DQN family: exploration rate while playing; default the run's --eval-epsilon"""
    greedy: bool = False
    """policy-gradient scripts: the most likely action instead of a sample; DQN family: epsilon 0"""
    video: str | None = None
    """record the first game's RGB screen to this new .mp4 file (Atari games only; one run)"""
    seed: int | None = None
    """seed of the games and of the action sampling; default the run's --seed"""
    envs: int | None = None
    """evaluation environments played side by side; default the run's --eval-envs"""
    cuda: bool = True
    """run the network on the GPU when there is one; --no-cuda forces the CPU"""


def next_free(folder: Path, stem: str = "eval", suffix: str = ".json") -> tuple[Path, object]:
    """eval.json, else eval-2.json, eval-3.json, ... (outputs.unused), created here exclusively,
    so two evaluations at once cannot take the same name; returns (path, open file)."""
    while True:
        path = Path(f"{outputs.unused(folder / stem, (suffix,))}{suffix}")
        try:
            return path, open(path, "x")
        except FileExistsError:  # taken between the check and the creation: the next one
            continue


def table(returns: list[float], lengths: list[int], hns: float | None) -> str:
    cols = ["mean", "std", "median", "min", "max", "games", "mean length", "human-normalised"]
    r = np.asarray(returns, float)
    vals = [f"{r.mean():.2f}", f"{r.std():.2f}", f"{np.median(r):.2f}", f"{r.min():.2f}",
            f"{r.max():.2f}", str(len(r)), f"{np.mean(lengths):.1f}",
            "n/a" if hns is None else f"{hns:.3f}"]
    return "\n".join(["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols),
                      "| " + " | ".join(vals) + " |"])


def check_flags(args: Args) -> None:
    if problem := out_of_range(args):
        raise UserError(problem)
    if args.video is not None:
        if len(args.paths) > 1:
            raise UserError(f"--video records one run's game; {len(args.paths)} runs given")
        video = Path(args.video)
        if video.suffix.lower() != ".mp4":
            raise UserError(f"--video writes an MP4: the name must end in .mp4, got {video}")
        if video.exists():
            raise UserError(f"{video} exists; choose another --video name")
        if not video.parent.is_dir():
            raise UserError(f"--video: no such folder {video.parent}")


def evaluate(args: Args, path: str, brief: bool = False) -> dict:
    """Play `path`'s checkpoint; print its table (`brief`: one line) and write its eval.json."""
    device = torch.device("cuda" if args.cuda and torch.cuda.is_available() else "cpu")
    agent = load(path, device)  # the same call a user's own script makes
    ckpt, script, kind, run = agent.checkpoint, agent.script, agent.kind, agent.args
    if kind == "pg" and args.epsilon is not None:
        raise UserError(f"--epsilon is the DQN family's; {script} samples from its policy "
                        "(--greedy plays its most likely action)")
    if kind != "pg" and args.greedy and args.epsilon is not None:
        raise UserError("--greedy is epsilon 0: give --greedy or --epsilon, not both")
    epsilon = None if kind == "pg" else (
        0.0 if args.greedy else run.eval_epsilon if args.epsilon is None else args.epsilon)
    game = envs.ale_game(run.env_id)  # load() made one: the id is good
    if args.video and game is None:
        raise UserError(f"--video records Atari games; {run.env_id} is not one")
    if not os.access(ckpt.parent, os.W_OK):  # before any game is played, not after
        raise UserError(f"cannot write eval.json: {ckpt.parent} is not writable")

    seed = run.seed if args.seed is None else args.seed
    num_envs = min(args.envs or run.eval_envs, args.episodes)
    run = dataclasses.replace(run, eval_envs=num_envs, eval_episodes=args.episodes)
    env = agent.make_envs(num_envs)
    policy = agent.policy(args.greedy, epsilon)

    torch.manual_seed(seed)
    seeds = envs.env_seeds(seed + SEED_TAG, 0, num_envs)
    recorder = VideoRecorder(env, run, Path(args.video)) if args.video else None
    t0 = time.time()
    try:
        returns, lengths = evaluation.play(policy, recorder or env, args.episodes, seeds, device)
        if recorder:
            try:
                recorder.finish()
            except FileExistsError as e:
                raise UserError(str(e)) from None
    finally:
        if recorder:
            recorder.close()
        env.close()
    wall = time.time() - t0

    mean = statistics.fmean(returns)
    hns = atari_scores.human_normalised(run.env_id, mean) if game else None
    policy_name = ("greedy" if args.greedy else "sampled") if kind == "pg" else "epsilon-greedy"
    if not brief:
        print(f"{ckpt} ({script}, step {agent.global_step:,}) on {run.env_id}: "
              f"{len(returns)} game{'s' * (len(returns) != 1)}, {policy_name}"
              + (f" (epsilon {epsilon:g})" if epsilon is not None else "")
              + f", cap {run.eval_max_steps:,} steps, {wall:.1f} s on {device}")
        print(table(returns, lengths, hns))
    result = {
        "checkpoint": str(ckpt), "script": script, "env_id": run.env_id,
        "global_step": agent.global_step, "episodes": len(returns),
        "returns": returns, "lengths": lengths, "mean_return": mean,
        "std_return": float(np.std(returns)), "median_return": float(np.median(returns)),
        "min_return": min(returns), "max_return": max(returns),
        "mean_length": statistics.fmean(lengths), "human_normalized": hns,
        "policy": policy_name, "epsilon": epsilon, "seed": seed, "envs": num_envs,
        "eval_max_steps": run.eval_max_steps, "fire_reset": run.fire_reset,
        "sticky_actions": run.sticky_actions, "device": str(device), "wall_seconds": wall,
        "video": args.video,
    }
    if recorder:
        result["video_frames"] = recorder.frames
        result["video_return"], result["video_length"] = recorder.score, recorder.length
        if (recorder.score, recorder.length) != (returns[0], lengths[0]):
            print(f"warning: the video's game (score {recorder.score:g}, {recorder.length} steps) "
                  f"is not the first evaluated game (score {returns[0]:g}, {lengths[0]} steps): "
                  "the recording environment fell out of step", file=sys.stderr)
        print(f"video: {args.video} ({recorder.frames} frames, {recorder.frames / FPS:.1f} s)")
    try:
        out, f = next_free(ckpt.parent)
        with f:
            json.dump(result, f, indent=2)
    except OSError as e:
        raise UserError(f"cannot write the results beside {ckpt}: {e}") from None
    if brief:
        print(f"{ckpt} ({script}, step {agent.global_step:,}, {run.env_id}): mean "
              f"{mean:.2f} +- {np.std(returns):.2f} over {len(returns)} games, {policy_name}"
              + ("" if hns is None else f", human-normalised {hns:.3f}") + f"; wrote {out}")
    else:
        print(f"wrote {out}")
    return result


def main() -> None:
    args = tyro.cli(Args)
    try:
        check_flags(args)
        for path in args.paths:
            evaluate(args, path, brief=len(args.paths) > 1)
    except (UserError, CheckpointError) as e:
        fail(str(e))


if __name__ == "__main__":
    main()
