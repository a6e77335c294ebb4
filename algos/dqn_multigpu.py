"""DQN and its variants on Atari at large batch, synchronous and data-parallel over GPUs.

Deep Q-learning (Mnih et al. 2015) with --double, --dueling, --prioritized and --n-step, as run
in "Accelerated Methods for Deep Reinforcement Learning" (Stooke & Abbeel 2018, Table 2: DQN-512,
eps-Rainbow-512): batched epsilon-greedy inference over many emulators, a replay shard per GPU,
updates on gradients averaged over GPUs; --asynchronous: the paper's asynchronous DQN (central
Adam, one machine). Presets, schedules, modes: docs/q-learning.md.

Launch:
    python algos/dqn_multigpu.py --env-id Breakout-v5                     # one process
    python algos/dqn_multigpu.py --preset eps-rainbow-512                 # a documented preset
    torchrun --standalone --nproc_per_node 8 algos/dqn_multigpu.py        # 8 GPUs, one machine
    torchrun --standalone --nproc_per_node 4 algos/dqn_multigpu.py --asynchronous
    python algos/dqn_multigpu.py --no-cuda --async-sampling --sampler-cores 0   # 2 CPU cores
    (several machines: README, Launching)
"""

from __future__ import annotations

import copy
import math
import os
import sys
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Literal

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch starts OpenMP; docs/results.md
import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout, no install
from common import async_sampler, central_optim, dist, evaluation, gpu, grad_step
from common import replay_feed, replay_shard
from common.exploration import epsilon_greedy, epsilons
from common.replay_feed import ReplayArgs
from common.run import Run


@dataclass
class Args(ReplayArgs):  # the flags every script and the DQN family share: common/
    num_envs: int = 16
    """environments per rank; 16 x --num-steps 4 = 64 steps per iteration, one update at 512"""

    preset: Literal["dqn-nature", "dqn-512", "eps-rainbow-512"] = "dqn-512"
    """documented configuration that sets the defaults below (docs/q-learning.md); flags win"""
    num_steps: int = 4
    """steps per environment per iteration, between rounds of updates"""
    batch_size: int = 512
    """transitions per update per rank; the global batch is ranks x this (paper: 512)"""
    target_update_interval: int = 40_000
    """global steps between target network copies (Nature: 10,000 updates x 4 steps)"""
    gamma: float = 0.99
    """discount factor (Nature)"""
    n_step: int = 1
    """steps of reward summed before bootstrapping (1 is Nature's one-step target)"""
    double: bool = False
    """double Q-learning: the online network picks the next action, the target values it"""
    dueling: bool = False
    """dueling heads: Q = V + A - mean(A) (Wang et al. 2016, eq. 9)"""
    prioritized: bool = False
    """proportional prioritized replay (Schaul et al. 2016)"""
    optimizer: Literal["adam", "rmsprop"] = "adam"
    """adam, or rmsprop as in Nature (centered, squared-gradient decay 0.95)"""
    learning_rate: float = 2.5e-4
    """learning rate (Nature's, not scaled with the batch: docs/q-learning.md)"""
    adam_eps: float = 0.01 / 512
    """Adam epsilon (the authors' code: 0.01/batch for C51, 0.005/batch for eps-Rainbow)"""
    max_grad_norm: float = 10.0
    """global gradient-norm clip after averaging over ranks (rlpyt's DQN: 10); 0 turns it off"""
    asynchronous: bool = False
    """asynchronous multi-GPU optimisation (paper Sec. 3.2): each rank applies its own gradients to
    central parameters and optimizer state in this machine's shared memory
    (common/central_optim.py), with no all-reduce; one machine only"""
    num_chunks: int = 3
    """chunks of the central parameters, each under its own lock (paper: 3)"""
    eps_schedule: Literal["linear", "apex"] = "linear"
    """exploration: one annealed epsilon, or fixed per-environment epsilons (docs/q-learning.md)"""
    eps_end: float = 0.1
    """linear schedule's final epsilon (Nature: 0.1; Rainbow: 0.01)"""
    eps_decay_steps: int = 250_000
    """global steps of the linear decay (Nature: 1M frames)"""


PRESETS = {  # sources: docs/q-learning.md
    "dqn-nature": dict(batch_size=32, optimizer="rmsprop", learning_rate=2.5e-4,
                       target_update_interval=40_000, learning_starts=50_000, eps_end=0.1,
                       eps_decay_steps=250_000, eval_epsilon=0.05, n_step=1, double=False,
                       dueling=False, prioritized=False),
    "dqn-512": {},  # Args' own defaults
    "eps-rainbow-512": dict(batch_size=512, optimizer="adam", learning_rate=6.25e-5,
                            adam_eps=0.005 / 512, target_update_interval=8_000,
                            learning_starts=20_000, eps_end=0.01, eps_decay_steps=62_500,
                            n_step=3, double=True, dueling=True, prioritized=True,
                            priority_alpha=0.5, priority_beta=0.4),
}


class QNetwork(nn.Module):
    """Nature-DQN torso (Mnih et al. 2015) with a Q head, or dueling value and advantage heads."""

    def __init__(self, num_actions: int, dueling: bool = False, precision: str = "fp32",
                 channels_last: str = "auto"):
        super().__init__()
        self.precision = precision
        self.channels_last = channels_last
        self.torso = nn.Sequential(
            nn.Conv2d(4, 32, 8, stride=4), nn.ReLU(), nn.Conv2d(32, 64, 4, stride=2), nn.ReLU(),
            nn.Conv2d(64, 64, 3, stride=1), nn.ReLU(), nn.Flatten())
        self.dueling = dueling
        self.head = nn.Sequential(nn.Linear(3136, 512), nn.ReLU(), nn.Linear(512, num_actions))
        if dueling:
            self.value = nn.Sequential(nn.Linear(3136, 512), nn.ReLU(), nn.Linear(512, 1))

    @gpu.in_modes
    def forward(self, obs: torch.Tensor) -> torch.Tensor:
        """obs uint8 [N, 4, 84, 84] -> Q values [N, A] (float32)."""
        h = self.torso(obs.float() / 255.0)
        q = gpu.float32(self.head[-1], self.head[:-1](h))  # the advantages, if dueling
        if not self.dueling:
            return q
        value = gpu.float32(self.value[-1], self.value[:-1](h))  # [N, 1]
        return value + q - q.mean(1, keepdim=True)  # float32; Wang et al., eq. 9


def td_targets(model: QNetwork, target: QNetwork, batch: dict[str, torch.Tensor],
               double: bool) -> torch.Tensor:
    """y = R(n) + discount x Q_target(s', a') [N], discount = gamma^m, or 0 after a termination.
    a' = argmax Q_target(s') (Nature), or argmax Q_online(s') with --double (van Hasselt)."""
    with torch.no_grad():
        q_next = target(batch["next_obs"])  # [N, A]
        a_next = (model(batch["next_obs"]) if double else q_next).argmax(1)
        return batch["returns"] + batch["discounts"] * q_next.gather(1, a_next[:, None]).squeeze(1)


def dqn_loss(model: QNetwork, target: QNetwork, batch: dict[str, torch.Tensor], args: Args
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Huber loss (Nature's error clipping to [-1, 1]) weighted by the importance weights ->
    (loss, Q(s, a) [N], targets [N]); one graph under --compile."""
    y = td_targets(model, target, batch, args.double)
    q = model(batch["obs"]).gather(1, batch["actions"][:, None]).squeeze(1)  # [N]
    return (batch["weights"] * F.smooth_l1_loss(q, y, reduction="none")).mean(), q, y


def dqn_update(model: QNetwork, target: QNetwork, step: grad_step.AllReduceStep,
               batch: dict[str, torch.Tensor], args: Args):
    """One step (all-reduced or central: common/grad_step.py) on this rank's batch; returns
    (stats, |TD errors| [N], comm or wait seconds)."""
    loss, q, y = gpu.compiled(dqn_loss, args.compile)(model, target, batch, args)
    comm = step(loss)[1]
    return {"td_loss": loss.detach(), "q_values": q.detach().mean()}, (q - y).detach().abs(), comm


def make_optimizer(model: QNetwork, args: Args) -> torch.optim.Optimizer:
    if args.optimizer == "adam":
        return gpu.adam(model.parameters(), lr=args.learning_rate, eps=args.adam_eps)
    # Nature's RMSProp: centered, decay 0.95, 0.01 inside the root (docs/policy-gradient.md)
    return torch.optim.RMSprop(model.parameters(), lr=args.learning_rate, alpha=0.95,
                               eps=math.sqrt(0.01), centered=True)


def main() -> None:
    run = Run(Args, presets=PRESETS)
    args, world, device = run.args, run.world, run.device
    if args.asynchronous:
        central_optim.check(args, world)
        if args.optimizer != "adam":
            dist.fail("--asynchronous steps with the central Adam: Nature's centered RMSProp has "
                      "no central form here; use --optimizer adam")
    cores = async_sampler.pin(args, world)

    # ---- set-up: model, optimizer (all-reduced or central), replay, resume ----
    num_actions, eval_env = evaluation.probe(args)
    new_replay = replay_shard.make(args, world)  # its size checked before anything is written
    torch.manual_seed(args.seed)  # same initial parameters on every rank (broadcast too)
    model = QNetwork(num_actions, args.dueling, args.precision, args.channels_last).to(device)
    target = copy.deepcopy(model)
    optimizer = make_optimizer(model, args)
    torch.manual_seed(args.seed * 1000 + world.rank)  # per-rank exploration and replay sampling
    np.random.seed(args.seed * 1000 + world.rank)
    global_step = run.restore(partial(central_optim.refusal, args), model=model, target=target)
    step = central_optim.make_step(model, optimizer, run, asynchronous=args.asynchronous,
                                   max_grad_norm=args.max_grad_norm, num_chunks=args.num_chunks,
                                   eps=args.adam_eps)
    counters = replay_shard.counters(args, run.state)
    replay = replay_shard.restore_or_refill(new_replay, run.state, run.run_dir, world, args,
                                            counters)
    schedule_step = global_step  # asynchronous: the machine's step count at the last rollout

    global_batch = args.num_steps * args.num_envs * world.world_size
    feed = replay_feed.make(args, world, model, partial(QNetwork, num_actions, args.dueling,
                                                        args.precision, args.channels_last),
                            "forward", global_step, cores)
    eval_eps = torch.full((args.eval_envs,), args.eval_epsilon, device=device)
    run.begin(global_step, global_batch, eval_env=eval_env,
              log_every=max(1, 2048 // (args.num_steps * args.num_envs)),
              policy=lambda obs: epsilon_greedy(model(obs), eval_eps[:len(obs)]),  # evaluation
              checkpoint=lambda: {"model": model.state_dict(), "target": target.state_dict(),
                                  "optimizer": step.state_dict(), "counters": dict(counters),
                                  "asynchronous": args.asynchronous},
              rank_state=(lambda: {"replay": replay.state_dict()}) if args.save_replay else None)

    while global_step < args.total_timesteps:
        # ---- sampling: T steps of B envs, epsilon-greedy, then into this rank's replay ----
        eps = epsilons(args, schedule_step, world.rank, world.world_size).to(device)
        acted = feed.collect(eps, replay, run.phases)
        global_step += global_batch
        seen, schedule_step = schedule_step, step.count(args.num_steps * args.num_envs,
                                                        global_step)

        # ---- learning: as many updates as the replay ratio implies, on averaged gradients ----
        seconds = 0.0  # communicating
        with run.phases("learn"):
            # Independent (asynchronous) ranks meet only to log: one that got a signal skips its
            # updates (no step is credited) to reach the meeting within torchrun's 30 s grace.
            if global_step >= counters["learn_from"] and replay.num_valid() > 0 and not (
                    step.independent and run.stop_requested):  # the same on all ranks if not
                beta = args.priority_beta + (1 - args.priority_beta) * min(
                    1.0, schedule_step / args.total_timesteps)
                for _ in range(replay_shard.updates_due(counters, args, global_batch,
                                                        world.world_size)):
                    batch = replay.sample(args.batch_size, beta, device)
                    stats, td_abs, c = dqn_update(model, target, step, batch, args)
                    replay.update_priorities(batch["indices"], td_abs)
                    seconds += c
                    run.record(stats)
            interval = args.target_update_interval  # in global steps (Nature: in updates)
            if schedule_step // interval > seen // interval:  # asynchronous: each rank sees each
                step.refresh()  # asynchronous: the other ranks' updates too, even with none here
                target.load_state_dict(model.state_dict())
            feed.publish()  # --async-sampling: to the sampler process
        run.phases.add("comm", seconds, taken_from="learn")

        # ---- logging, evaluation, checkpoints, stop ----
        if feed.end_iteration(run, global_step, acted, counters):
            break
    run.close(global_step, feed, eval_env, step, updates=counters["updates"],
              replay_bytes_per_transition=replay.bytes_per_transition(), **step.summary())


if __name__ == "__main__":
    main()
