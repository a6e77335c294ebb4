"""A training run's life, in the calls every script makes in this order:

    run = Run(Args)                      # flags, the process group, the run to start or continue
    global_step = run.restore(model=m)   # the run directory, the checkpoint's state (or 0)
    run.begin(global_step, global_batch, checkpoint=..., policy=..., eval_env=...)
    while ...:                           # the algorithm: sampling and learning
        run.record(stats)
        if run.end_iteration(global_step, ...):   # logs, evaluates, checkpoints; True: stop
            break
    run.close(global_step, ...)          # last checkpoint, final evaluation, summary.json

How and why: docs/internals.md#commonrunpy.
"""

from __future__ import annotations

import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Literal

import torch

from common import checkpoint, cli, dist, evaluation, runs
from common.logger import Logger, PhaseClock
from common.video import VideoRecorder


@dataclass
class RunArgs:
    env_id: str = "Pong-v5"
    """Atari game as Gymnasium spells it (Pong-v5, ALE/Pong-v5, PongNoFrameskip-v4), or any
    Gymnasium id (also 'module:Name-v0') with uint8 (4, 84, 84) observations and discrete actions"""
    seed: int = 1
    """seed for parameters, exploration and environments (each rank and environment gets its own)"""
    total_timesteps: int = 10_000_000
    """environment steps over all ranks (frames are 4x this); 10M is CleanRL's Atari budget, the
    paper's DQN runs took 50M"""
    cuda: bool = True
    """use cuda:LOCAL_RANK with NCCL when a GPU exists; --no-cuda forces the CPU with gloo"""
    backend: Literal["auto", "nccl", "gloo"] = "auto"
    """auto: NCCL on GPUs, gloo on CPUs; gloo also lets several ranks share one GPU"""
    track: bool = False
    """send the TensorBoard scalars, the flags and any videos to Weights & Biases (CleanRL's
    flag; `pip install wandb` first; WANDB_MODE=offline keeps the run on disk for `wandb sync`)"""
    wandb_project_name: str = "accelrl"
    """the Weights & Biases project of --track"""
    wandb_entity: str | None = None
    """the Weights & Biases team or user of --track; None: wandb's default entity"""
    capture_video: bool = False
    """record the first game of evaluations 0, 1, 8, 27, ... (Gymnasium's RecordVideo schedule,
    then every 1,000th) and of the final one into <run_dir>/videos/ (rank 0, Atari games)"""
    torch_deterministic: bool = False
    """deterministic algorithms, no cuDNN autotuning, no TF32 (CleanRL's flag): a synchronous run
    repeats bit for bit on the same machine; off by default, as the GPU switches are faster
    (docs/flags.md says what stays non-deterministic)"""
    compile: bool = False
    """torch.compile the sampling step's network and the learner's minibatch loss (CUDA graphs on
    a GPU); compilation (10-60 s) is counted in the run's time (docs/results.md)"""
    precision: Literal["fp32", "bf16"] = "fp32"
    """the network's arithmetic in learning and sampling: bf16 autocast for the torso and hidden
    layers; output layers, losses, targets and optimizer state in float32 (docs/results.md: PPO's
    learner 2x faster on a bf16 CPU)"""
    channels_last: Literal["auto", "on", "off"] = "auto"
    """convolutions in channels-last memory format; auto: on a CPU (each learner 1.26-1.43x
    faster there, docs/results.md), not on a GPU (not yet measured there)"""
    run_dir: str | None = None
    """output directory; default runs/<env>__<script>__<seed>__<unix time>"""
    alternate: bool = False
    """alternating sampler: two env groups, one simulates while the other's actions are inferred"""
    checkpoint_interval: int = 0
    """global steps between checkpoints; 0 means none by steps (--checkpoint-minutes still saves)"""
    checkpoint_minutes: float = 10.0
    """wall-clock minutes between checkpoints, the most a crash or a lost machine costs; 0: none"""
    resume: str | None = None
    """checkpoint file or run directory to continue, up to --total-timesteps; 'auto': continue
    --run-dir's newest checkpoint if it has one, else start the run there"""
    keep_checkpoints: int = 3
    """newest checkpoints to keep (older ones are deleted once a new one is safely written); 0
    keeps all"""
    collective_timeout: float = 600.0
    """seconds a rank waits for the others in a collective before it gives up: a hung or dead
    rank then ends the run (and `torchrun --max-restarts` restarts it) instead of hanging it"""
    episodic_life: bool = True
    """end the learner's episode at each life loss, the game going on (paper: on)"""
    sticky_actions: bool = False
    """repeat the previous action with probability 0.25, as ALE v5 (paper: off)"""
    clip_rewards: bool = True
    """learn from sign(reward) (Nature DQN; the paper, all algorithms); episode statistics always
    report the raw score"""
    fire_reset: bool = True
    """press FIRE at every game start and after every lost life, in games that have it (Breakout
    serves the ball only then; common/envs.py); --no-fire-reset leaves it to the agent"""
    eval_interval: int = 250_000
    """global steps between evaluations on separate environments (common/evaluation.py); 0: only
    the final one at the end of the run"""
    eval_episodes: int = 8
    """games each rank plays per evaluation, cut ones included; 0 turns evaluation off"""
    eval_envs: int = 4
    """evaluation environments per rank, separate from the training ones"""
    eval_max_steps: int = 4_500
    """steps after which an evaluation game is cut and scored as it stands (18,000 frames, the
    5-minute cap of Machado et al. 2018)"""


class Run:
    """One run of one script on every rank. Attributes: `args`, `world`, `device`, and after
    `restore` `run_dir`, `state` (the checkpoint resumed, or None) and `start_step`."""

    def __init__(self, args_cls, ranges: dict[str, str] | None = None,
                 presets: dict[str, dict] | None = None):
        """Parse `args_cls` (common/cli.py), join the process group, choose the run."""
        self.args, self.world = cli.parse_args(args_cls, ranges=ranges, presets=presets)
        self.device = self.world.device
        self.script = Path(sys.modules[args_cls.__module__].__file__).stem
        self.state, self.signalled = None, False

    def restore(self, check: Callable[[dict], str | None] | None = None, **modules) -> int:
        """Make or reuse the run directory, load the checkpoint into `modules` (model=, target=,
        optimizer=) and give every rank rank 0's parameters; returns the global step (0 for a new
        run). `check(state)`: the script's reason to refuse a checkpoint, or None. From here on a
        signal stops the run cleanly."""
        args, world = self.args, self.world
        self.run_dir, self.state = runs.prepare_run(args, self.script, world, check)
        self.start_step = checkpoint.restore(self.state, world, **modules)
        for module in modules.values():
            if isinstance(module, torch.nn.Module):
                dist.broadcast_params(module)
        self.stopper = StopRequest(args)
        return self.start_step

    def begin(self, global_step: int, global_batch: int, checkpoint: Callable[[], dict],
              policy=None, eval_env=None, sampler=None, log_every: int = 1,
              rank_state: Callable[[], dict] | None = None) -> None:
        """Start logging and timing. `checkpoint()`: what a checkpoint holds besides the step,
        the logger's state and the script's name; `rank_state()`: each rank's own part (DQN's
        replay shard); `policy(obs) -> actions`: what evaluation plays on `eval_env`; `sampler`:
        whose env and inference times the phases read; `log_every`: iterations per log call,
        where the ranks meet (stop checks, evaluation)."""
        self.global_batch, self.log_every = global_batch, log_every
        self.to_save, self.rank_state = checkpoint, rank_state
        self.policy, self.eval_env = policy, eval_env
        self.logger = Logger(self.run_dir, self.world, self.args, self.state, global_batch)
        self.phases = PhaseClock(self.device, sampler)  # `with run.phases("learn"):`
        self.saved_at = self.logged_at = global_step
        self.iteration, self.last_eval, self.sums, self.count = 0, None, {}, 0
        self.evaluations = 0  # in this launch: the video schedule counts them

    def record(self, stats: dict[str, torch.Tensor | float]) -> None:
        """Statistics of one iteration (device tensors need no host sync), averaged over the
        iterations of the next log call."""
        for k, v in stats.items():
            self.sums[k] = self.sums.get(k, 0.0) + v
        self.count += 1

    def end_iteration(self, global_step: int, scalars: Callable[[], dict] | dict,
                      episodes: Callable[[], list], status: Callable[[], str] | None = None,
                      warmup_until: int = 0) -> bool:
        """After each iteration: every `log_every` iterations (and at the end) the evaluation
        when due and the log call (the recorded means, `scalars()`, `episodes()`: the games
        finished since); a checkpoint every --checkpoint-interval steps; at the log calls the
        stop check and the --checkpoint-minutes checkpoint. Returns whether to stop (a signal;
        all ranks agree)."""
        args = self.args
        self.iteration += 1
        meet = not self.iteration % self.log_every or global_step >= args.total_timesteps
        if meet:
            self._log(global_step, scalars, episodes, status, warmup_until)
        if crossed(args.checkpoint_interval, global_step, global_step - self.global_batch):
            self._save(global_step)
        if not meet:
            return False
        if self.stopper(self.world, global_step):  # rank 0 says how to continue
            self.signalled = True
            return True
        if self.stopper.checkpoint_due and self.saved_at != global_step:
            self._save(global_step)
        return False

    @property
    def stop_requested(self) -> bool:
        """A signal reached this rank and the ranks have not met since (asynchronous ranks skip
        their updates then, to reach the meeting within torchrun's grace)."""
        return self.stopper.signal is not None

    def close(self, global_step: int, *closables, **summary) -> None:
        """The last checkpoint, the final evaluation (not after a signal: the job must end
        quickly), summary.json with `summary`'s entries; then close `closables` (environments,
        samplers, the step) and leave the group."""
        if self.saved_at != global_step:
            path = self._save(global_step)
            if self.world.is_main:
                print(f"\ncheckpoint: {path}", flush=True)
        last = self.last_eval
        if self.eval_env and not self.signalled and (last is None
                                                     or last["global_step"] != global_step):
            self._evaluate(global_step, final=True)
        self.logger.summary(global_step, self.last_eval, **summary)
        self.logger.close()
        for c in closables:
            if c is not None:
                c.close()
        dist.finish()

    def _log(self, global_step, scalars, episodes, status, warmup_until) -> None:
        if self.eval_env and crossed(self.args.eval_interval, global_step, self.logged_at):
            with self.phases("eval"):
                self._evaluate(global_step, final=global_step >= self.args.total_timesteps)
        out = scalars() if callable(scalars) else dict(scalars)
        if self.count:  # one host sync for all the recorded statistics
            means = torch.stack([torch.as_tensor(v, dtype=torch.float32, device=self.device)
                                 for v in self.sums.values()]) / self.count
            out = {**{f"losses/{k}": m for k, m in zip(self.sums, means.tolist())}, **out}
        self.logger.log(global_step, out, episodes(), self.phases.pop(),
                        status=status() if status else "", warmup_until=warmup_until)
        self.logged_at, self.sums, self.count = global_step, {}, 0

    def _evaluate(self, global_step: int, final: bool = False) -> None:
        env, video = self.eval_env, None
        if self.args.capture_video and self.world.is_main and (final or on_video_schedule(
                self.evaluations)):
            video = self.run_dir / "videos" / f"eval-step{global_step}.mp4"
            video.parent.mkdir(exist_ok=True)
            env = VideoRecorder(env, self.args, video)
        try:
            result = evaluation.evaluate(self.policy, env, self.args, self.world, global_step)
            if video:
                env.finish()
                self.logger.video(video, global_step)
        finally:
            if video:
                env.close()
        self.evaluations += 1
        self.last_eval = self.logger.eval(global_step, result)

    def _save(self, global_step: int):
        self.saved_at = global_step
        state = {**self.to_save(), "logger": self.logger.state(), "env_id": self.args.env_id,
                 "script": self.script}
        return checkpoint.save(self.run_dir, self.world, global_step, self.args.keep_checkpoints,
                               state, rank_state=self.rank_state() if self.rank_state else None)


def on_video_schedule(k: int) -> bool:
    """Gymnasium's RecordVideo default, capped_cubic_video_schedule (its module needs moviepy):
    0, 1, 8, 27, ... 729, then every 1,000th."""
    return round(k ** (1 / 3)) ** 3 == k if k < 1000 else k % 1000 == 0


def crossed(interval: int, step: int, previous: int) -> bool:
    """Whether `step` passed a multiple of `interval` (> 0) since `previous`."""
    return interval > 0 and step // interval > previous // interval


class StopRequest:
    """SIGTERM / SIGINT set a flag that all ranks check together where they meet (a signal to
    one stops all); `args`: the script's flags (the run directory, --checkpoint-minutes)."""

    def __init__(self, args):
        self.args, self.signal = args, None
        self.every, self.last = args.checkpoint_minutes * 60, time.monotonic()
        self.checkpoint_due = False  # set by each call: all ranks agree
        for s in (signal.SIGTERM, signal.SIGINT):
            signal.signal(s, self._handle)

    def _handle(self, signum, frame):
        self.signal = signum
        signal.signal(signum, signal.SIG_DFL)  # a second Ctrl-C kills at once

    def __call__(self, world: dist.World, global_step: int) -> bool:
        """Whether to stop (rank 0 then prints how to continue); one all-reduce, which also
        agrees on `checkpoint_due`: --checkpoint-minutes have passed on some rank's clock."""
        due = self.every > 0 and time.monotonic() - self.last >= self.every
        flags = torch.tensor([1.0 if self.signal else 0.0, 1.0 if due else 0.0],
                             device=world.device)
        stop, self.checkpoint_due = (dist.all_reduce_mean(flags) > 0).tolist()
        if self.checkpoint_due:
            self.last = time.monotonic()
        if stop and world.is_main:
            print(f"\nstopped by signal at step {global_step:,}; continue with:\n  "
                  f"{runs.continue_command(self.args)}", flush=True)
        return stop
