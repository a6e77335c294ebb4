"""Sampling into the DQN family's replay (dqn_multigpu.py, cat_dqn.py): each iteration one rollout
of the rank's --num-envs environments for --num-steps steps, epsilon-greedy with one epsilon per
environment (common/exploration.py), appended to the rank's replay with the true last
observations of episodes cut at a time limit (a truncated transition bootstraps from its own
last frame, not from the next episode's first).

How and why: docs/internals.md#commonreplay_feedpy.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from functools import partial
from typing import Literal

import numpy as np
import torch

from common import dist, envs, replay_shard
from common.async_sampler import AsyncSampler, SamplerDied
from common.exploration import Explorer, act, epsilons, status
from common.gpu import Upload
from common.run import RunArgs
from common.sampler import Sampler

@dataclass
class ReplayArgs(RunArgs):  # the DQN family's replay and sampling flags; each Args extends it
    replay_size: int = 1_000_000
    """replay capacity in transitions over all ranks, each rank holding 1/ranks (Nature: 1M)"""
    replay_ratio: float = 8.0
    """transitions replayed per transition generated (Nature: batch 32 every 4 steps = 8)"""
    replay_device: Literal["auto", "cpu"] = "auto"
    """where the replay lives: auto = the rank's device (a GPU's memory), or cpu"""
    save_replay: bool = False
    """put each rank's replay shard in the checkpoints; without it a resume refills first"""
    learning_starts: int = 50_000
    """global steps before the first update, and again after a resume without --save-replay"""
    priority_alpha: float = 0.5
    """priority exponent (Rainbow: 0.5)"""
    priority_beta: float = 0.4
    """initial importance-sampling exponent, annealed linearly to 1 over --total-timesteps"""
    async_sampling: bool = False
    """step the environments in a sampler process while this one learns (common/replay_feed.py);
    a rollout then acts with parameters --num-buffers - 1 rounds of updates older"""
    num_buffers: int = 2
    """shared-memory rollout buffers per rank: 2 lets the sampler fill one while the learner
    trains on the other; more absorb jitter at the price of older rollouts"""
    sampler_cores: tuple[int, ...] = ()
    """CPU cores for the sampler processes (emulators and inference), dealt out to the ranks of
    the machine (local rank r of n takes every n-th from the r-th); the learners run on the
    other cores. Empty: no pinning, everything shares the cores"""
    eps_start: float = 1.0
    """linear schedule's first epsilon (Nature)"""
    eval_epsilon: float = 0.001
    """exploration during evaluation (Rainbow: 0.001; Nature: 0.05)"""


KEYS = ("obs", "actions", "rewards", "terminated", "truncated", "next_obs")  # Replay.add's order


def make_explorer(make_net, num_envs: int, q: str, compile: bool) -> Explorer:
    """The sampler process's explorer (AsyncSampler's make_model, bound with partial)."""
    return Explorer(make_net(), num_envs, q, compile)


def make(args, world, net: torch.nn.Module, make_net, q: str, global_step: int,
         cores: list[int]) -> ReplayFeed:
    """The rank's feed, chosen once: sampling in this process, or (--async-sampling) in a sampler
    process. `net`: the learner's Q-network; `make_net()` builds a copy for a sampler process (a
    module-level class or partial); `q`: net's method giving Q values [n, A]; `cores`: the
    sampler's (common.async_sampler.pin)."""
    if args.async_sampling:
        return AsyncReplayFeed(args, world, net, make_net, q, global_step, cores)
    return ReplayFeed(args, world, net, q, global_step)


def explorer(args, world, net: torch.nn.Module, q: str, global_step: int, compile: bool):
    """The rank's explorer, with the epsilons its first rollouts act with (a resume's, or
    apex's, not 1)."""
    out = Explorer(net, args.num_envs, q, compile).to(world.device)
    out.eps.copy_(epsilons(args, global_step, world.rank, world.world_size))
    return out


def env_kwargs(args) -> dict:
    return dict(env_id=args.env_id, num_envs=args.num_envs, groups=2 if args.alternate else 1,
                episodic_life=args.episodic_life, sticky_actions=args.sticky_actions,
                fire_reset=args.fire_reset)


class ReplayFeed:
    """Synchronous: each collect steps the environments here, with the current parameters."""

    def __init__(self, args, world, net: torch.nn.Module, q: str, global_step: int):
        self.explorer = explorer(args, world, net, q, global_step, args.compile)
        self.sampler = Sampler(envs.make_envs(**env_kwargs(args)), args.num_steps, world.device,
                               clip_rewards=args.clip_rewards)
        self.sampler.reset(envs.env_seeds(args.seed, world.rank, args.num_envs, offset=global_step))

    def collect(self, eps: torch.Tensor, replay, phases) -> torch.Tensor:
        """One rollout of T x B steps into `replay`, with epsilons eps [B]; its sampling times go
        to `phases` (common.logger.PhaseClock). Returns the epsilons [B] the rollout acted with."""
        self.explorer.eps.copy_(eps)
        finals = []  # the truncated episodes' last observations, in the order met

        def keep_final(obs):  # the sampler's value_fn hook, called only at time limits
            finals.append(obs)
            return torch.zeros(len(obs), device=obs.device)

        s, env0, inf0 = self.sampler, self.sampler.time_env, self.sampler.time_inference
        rollout = {**s.collect(self.explorer, value_fn=keep_final), "next_obs": s.next_obs}
        replay.add(*(rollout[k] for k in KEYS), torch.cat(finals) if finals else None)
        phases.add("env", s.time_env - env0)
        phases.add("inference", s.time_inference - inf0)
        return eps

    def publish(self) -> None:
        """After the updates (asynchronous: to the sampler process); nothing to do here."""

    def end_iteration(self, run, global_step: int, acted: torch.Tensor, counters: dict) -> bool:
        """`run.end_iteration` with the DQN family's log: the mean epsilon the rollout acted
        with (`acted` [B]), the replay ratio so far, its games, and no ETA before learning
        starts; True to stop."""
        learn_from = counters["learn_from"]
        return run.end_iteration(
            global_step, lambda: {"charts/epsilon": acted.mean().item(), "charts/replay_ratio":
                                  replay_shard.ratio(counters, run.args, run.world.world_size)},
            self.pop_episodes, warmup_until=learn_from,
            status=lambda: status(acted, learn_from, global_step))

    def pop_episodes(self) -> list[tuple[float, int]]:
        """Games finished since the last call: (true return, length in agent steps)."""
        return self.sampler.pop_episodes()

    def close(self) -> None:
        for e in self.sampler.envs:
            e.close()


class AsyncReplayFeed(ReplayFeed):
    """--async-sampling: a sampler process steps the environments while this one learns; a
    rollout acts with the parameters and epsilons published --num-buffers - 1 rounds before."""

    def __init__(self, args, world, net: torch.nn.Module, make_net, q: str, global_step: int,
                 cores: list[int]):
        self.rank, self.episodes, self.version = world.rank, [], 0
        self.explorer = explorer(args, world, net, q, global_step, compile=False)
        self.acted = {0: self.explorer.eps.clone()}  # published version -> its epsilons [B]
        seed = np.random.SeedSequence([args.seed, world.rank, global_step]).generate_state(1)
        self.sampler = AsyncSampler(
            partial(make_explorer, make_net, args.num_envs, q, args.compile), act, None,
            {**env_kwargs(args), "num_threads": len(cores)}, args.num_steps,
            envs.env_seeds(args.seed, world.rank, args.num_envs, offset=global_step),
            self.explorer, world.device, clip_rewards=args.clip_rewards,
            num_buffers=args.num_buffers, seed=int(seed[0]), cores=cores,
            threads=max(1, len(cores)), final_obs=True)
        self.upload, self.held = None, None  # held: the last rollout's buffer index

    def collect(self, eps: torch.Tensor, replay, phases) -> torch.Tensor:
        """One rollout from the sampler process into `replay`; returns the epsilons [B] of the
        parameters it was sampled with (--num-buffers - 1 publishes older than eps [B])."""
        self.explorer.eps.copy_(eps)
        i, info = self._watch(self.sampler.get)
        rollout = self.sampler.rollout(i)  # CPU tensors in shared memory
        k = int(rollout["truncated"].sum())  # no device sync: the mask is in host memory
        parts = {key: rollout[key] for key in KEYS}
        if k:
            parts["final_obs"] = rollout["final_obs"][:k]
        if self.upload is None:
            self.upload = Upload(replay.device)  # one pinned copy to a GPU's replay
        parts = self.upload(parts)
        replay.add(*(parts[key] for key in KEYS), parts.get("final_obs"))
        self.held = i  # handed back by publish(): the sampler stays one rollout ahead
        self.episodes += info["episodes"]
        for phase, key in (("env", "time_env"), ("inference", "time_inference"),
                           ("sampler_wait", "sampler_wait"), ("learner_wait", "learner_wait")):
            phases.add(phase, info[key])  # the sampler's own, overlapping learning
        self.acted = {v: e for v, e in self.acted.items() if v >= info["version"]}
        return self.acted[info["version"]]

    def publish(self) -> None:
        """After the updates: the sampler process's next rollouts act with the new parameters and
        the epsilons of the last collect."""
        self.version += 1
        self.acted[self.version] = self.explorer.eps.clone()
        self._watch(self.sampler.publish, self.explorer, self.version)
        self.sampler.release(self.held)

    def _watch(self, call, *args):
        """A dead sampler process ends this rank with one line, as APPO's learner ends."""
        try:
            return call(*args)
        except SamplerDied as e:
            print(f"error: rank {self.rank}: {e}; ending the run", file=sys.stderr, flush=True)
            self.sampler.close()
            dist.finish(1)  # leaves the group (NCCL peers fail at once); no return

    def pop_episodes(self) -> list[tuple[float, int]]:
        out, self.episodes = self.episodes, []
        return out

    def close(self) -> None:
        self.sampler.close()
