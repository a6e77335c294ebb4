"""Categorical DQN (C51) on Atari at batch 2048, synchronous and data-parallel over GPUs.

Distributional Q-learning (Bellemare, Dabney & Munos 2017): a distribution over --num-atoms
returns per action, trained by cross-entropy against the projected target (their Algorithm 1).
As run in "Accelerated Methods for Deep Reinforcement Learning" (Stooke & Abbeel 2018, Table 2:
CatDQN-2K) with dqn_multigpu.py's sampler and replay; Rainbow's --n-step, --double, --dueling,
--prioritized. Presets and sources: docs/q-learning.md.

Launch:
    python algos/cat_dqn.py --env-id Breakout-v5                          # one process
    python algos/cat_dqn.py --preset c51-nature                           # the 2017 settings
    torchrun --standalone --nproc_per_node 8 algos/cat_dqn.py             # 8 GPUs, one machine
    python algos/cat_dqn.py --no-cuda --async-sampling --sampler-cores 0  # 2 CPU cores
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
from common import async_sampler, dist, evaluation, gpu
from common import replay_feed, replay_shard
from common.exploration import epsilon_greedy, epsilons
from common.grad_step import AllReduceStep
from common.replay_feed import ReplayArgs
from common.run import Run


@dataclass
class Args(ReplayArgs):  # the flags every script and the DQN family share: common/
    num_envs: int = 16
    """environments per rank; 16 x --num-steps 16 = 256 steps per iteration, one update at 2048"""

    preset: Literal["c51-nature", "catdqn-2k"] = "catdqn-2k"
    """documented configuration that sets the defaults below (docs/q-learning.md); flags win"""
    num_atoms: int = 51
    """atoms of each action's return distribution (C51: 51)"""
    v_min: float = -10.0
    """smallest return on the support (C51: -10; rewards are clipped to [-1, 1])"""
    v_max: float = 10.0
    """largest return on the support (C51: 10)"""
    num_steps: int = 16
    """steps per environment per iteration, between rounds of updates"""
    batch_size: int = 2048
    """transitions per update per rank; the global batch is ranks x this (paper: 2048)"""
    target_update_interval: int = 40_000
    """global steps between target network copies (Nature, C51: 10,000 updates x 4 steps)"""
    gamma: float = 0.99
    """discount factor (Nature, C51)"""
    n_step: int = 1
    """steps of reward summed before bootstrapping (1 is C51's one-step target; Rainbow: 3)"""
    double: bool = False
    """double Q-learning: the online network's expected values pick the next action"""
    dueling: bool = False
    """dueling heads per atom: logits = V + A - mean_a(A) (Rainbow, Hessel et al. 2018)"""
    prioritized: bool = False
    """proportional prioritized replay, the cross-entropy as priority (Rainbow)"""
    optimizer: Literal["adam", "rmsprop"] = "adam"
    """adam (C51), or rmsprop as in Nature DQN (centered, squared-gradient decay 0.95)"""
    learning_rate: float = 2.5e-4
    """learning rate (C51's, not scaled with the batch: docs/q-learning.md)"""
    adam_eps: float = 0.01 / 2048
    """Adam epsilon (C51: 0.01/32; the authors' code: 0.01/batch)"""
    max_grad_norm: float = 10.0
    """global gradient-norm clip after averaging over ranks (rlpyt's DQN: 10); 0 turns it off"""
    eps_schedule: Literal["linear", "apex"] = "linear"
    """exploration: one annealed epsilon, or fixed per-environment epsilons (as dqn_multigpu)"""
    eps_end: float = 0.01
    """linear schedule's final epsilon (C51: 0.01)"""
    eps_decay_steps: int = 250_000
    """global steps of the linear decay (Nature, C51: 1M frames)"""


PRESETS = {  # sources: docs/q-learning.md
    "c51-nature": dict(batch_size=32, optimizer="adam", learning_rate=2.5e-4, adam_eps=0.01 / 32,
                       target_update_interval=40_000, learning_starts=50_000, eps_end=0.01,
                       eps_decay_steps=250_000, eval_epsilon=0.001, n_step=1, double=False,
                       dueling=False, prioritized=False, num_atoms=51, v_min=-10.0, v_max=10.0),
    "catdqn-2k": {},  # Args' own defaults
}


class C51Network(nn.Module):
    """Nature-DQN torso (Mnih et al. 2015) with atom logits for every action (as C51 used it)."""

    def __init__(self, num_actions: int, support: torch.Tensor, dueling: bool = False,
                 precision: str = "fp32", channels_last: str = "auto"):
        super().__init__()
        self.precision = precision
        self.channels_last = channels_last
        self.A, self.K, self.dueling = num_actions, len(support), dueling
        self.register_buffer("support", support.clone())  # z [K], saved in checkpoints
        self.torso = nn.Sequential(
            nn.Conv2d(4, 32, 8, stride=4), nn.ReLU(), nn.Conv2d(32, 64, 4, stride=2), nn.ReLU(),
            nn.Conv2d(64, 64, 3, stride=1), nn.ReLU(), nn.Flatten())
        self.head = nn.Sequential(nn.Linear(3136, 512), nn.ReLU(),
                                  nn.Linear(512, num_actions * self.K))
        if dueling:
            self.value = nn.Sequential(nn.Linear(3136, 512), nn.ReLU(), nn.Linear(512, self.K))

    @gpu.in_modes
    def forward(self, obs: torch.Tensor) -> torch.Tensor:
        """obs uint8 [N, 4, 84, 84] -> atom logits [N, A, K] (float32; softmax over K)."""
        h = self.torso(obs.float() / 255.0)
        logits = gpu.float32(self.head[-1], self.head[:-1](h)).view(-1, self.A, self.K)
        if not self.dueling:
            return logits
        # Rainbow's distributional dueling: the advantage's mean over actions is removed per atom
        value = gpu.float32(self.value[-1], self.value[:-1](h))  # [N, K]
        return value[:, None] + logits - logits.mean(1, keepdim=True)

    def q_values(self, obs: torch.Tensor) -> torch.Tensor:
        """Expected returns Q(s, a) = sum_k z_k p_k(s, a) [N, A]."""
        return (self(obs).softmax(-1) * self.support).sum(-1)


def project(probs: torch.Tensor, returns: torch.Tensor, discounts: torch.Tensor,
            support: torch.Tensor) -> torch.Tensor:
    """C51's Algorithm 1, batched: returns + discounts x Z (probs [N, K] on support [K]) projected
    onto the atoms [N, K]. l = min(floor(b), K - 2) and l + 1 always share the mass, so the
    l == u case of Algorithm 1, where the mass would vanish, cannot arise (docs/q-learning.md)."""
    K = len(support)
    dz = (support[-1] - support[0]) / (K - 1)
    tz = (returns[:, None] + discounts[:, None] * support[None]).clamp(support[0], support[-1])
    b = (tz - support[0]) / dz  # [N, K], in [0, K - 1]
    lower = b.floor().clamp(max=K - 2)  # [N, K]
    upper_w = (b - lower).clamp(0.0, 1.0)  # fraction of the mass that goes to l + 1
    out = torch.zeros_like(probs)
    out.scatter_add_(1, lower.long(), probs * (1.0 - upper_w))
    out.scatter_add_(1, lower.long() + 1, probs * upper_w)
    return out


def target_distribution(model: C51Network, target: C51Network, batch: dict[str, torch.Tensor],
                        double: bool) -> torch.Tensor:
    """Projected target [N, K] of R(n) + discount x Z_target(s', a'), a' = argmax E[Z_target]
    (C51) or argmax E[Z_online] with --double (Rainbow)."""
    with torch.no_grad():
        p_next = target(batch["next_obs"]).softmax(-1)  # [N, A, K]
        q_next = model.q_values(batch["next_obs"]) if double else (p_next * target.support).sum(-1)
        a_next = q_next.argmax(1)  # [N]
        p = p_next[torch.arange(len(a_next), device=a_next.device), a_next]  # [N, K]
        return project(p, batch["returns"], batch["discounts"], target.support)


def c51_loss(model: C51Network, target: C51Network, batch: dict[str, torch.Tensor], args: Args
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Importance-weighted cross-entropy against the projected target m (Algorithm 1's last
    line) -> (loss, cross-entropies [N], log p(s, a) [N, K])."""
    m = target_distribution(model, target, batch, args.double)  # [N, K]
    logits = model(batch["obs"])  # [N, A, K]
    chosen = logits[torch.arange(len(m), device=m.device), batch["actions"]]  # [N, K]
    log_p = F.log_softmax(chosen, -1)
    ce = -(m * log_p).sum(1)  # [N]
    return (batch["weights"] * ce).mean(), ce, log_p


def c51_update(model: C51Network, target: C51Network, step: AllReduceStep,
               batch: dict[str, torch.Tensor], args: Args):
    """One step on gradients averaged over ranks; returns (stats, cross-entropies [N]: the
    priorities, as Rainbow's KL up to the target's entropy, comm seconds)."""
    loss, ce, log_p = gpu.compiled(c51_loss, args.compile)(model, target, batch, args)
    comm = step(loss)[1]
    q = (log_p.detach().exp() * model.support).sum(1)  # E[Z(s, a)] of the taken actions [N]
    return {"loss": loss.detach(), "q_values": q.mean()}, ce.detach(), comm


def make_optimizer(model: C51Network, args: Args) -> torch.optim.Optimizer:
    if args.optimizer == "adam":
        return gpu.adam(model.parameters(), lr=args.learning_rate, eps=args.adam_eps)
    # Nature's RMSProp: centered, decay 0.95, 0.01 inside the root (docs/policy-gradient.md)
    return torch.optim.RMSprop(model.parameters(), lr=args.learning_rate, alpha=0.95,
                               eps=math.sqrt(0.01), centered=True)


def main() -> None:
    run = Run(Args, presets=PRESETS)
    args, world, device = run.args, run.world, run.device
    if not args.v_min < args.v_max:
        dist.fail(f"--v-min must be below --v-max, got [{args.v_min}, {args.v_max}]")
    cores = async_sampler.pin(args, world)

    # ---- set-up: model, optimizer, replay, resume ----
    num_actions, eval_env = evaluation.probe(args)
    new_replay = replay_shard.make(args, world)  # its size checked before anything is written
    support = torch.linspace(args.v_min, args.v_max, args.num_atoms)  # z [K]
    torch.manual_seed(args.seed)  # same initial parameters on every rank (broadcast too)
    model = C51Network(num_actions, support, args.dueling, args.precision,
                       args.channels_last).to(device)
    target = copy.deepcopy(model)
    optimizer = make_optimizer(model, args)
    torch.manual_seed(args.seed * 1000 + world.rank)  # per-rank exploration and replay sampling
    np.random.seed(args.seed * 1000 + world.rank)
    global_step = run.restore(model=model, target=target, optimizer=optimizer)
    if not torch.equal(model.support.cpu(), support):  # the atoms came from the checkpoint
        dist.fail(f"the checkpoint's support [{model.support[0]:g}, {model.support[-1]:g}] "
                  f"differs from --v-min {args.v_min:g} --v-max {args.v_max:g}: a run keeps "
                  "its atoms")
    step = AllReduceStep(model, optimizer, args.max_grad_norm)
    counters = replay_shard.counters(args, run.state)
    replay = replay_shard.restore_or_refill(new_replay, run.state, run.run_dir, world, args,
                                            counters)

    global_batch = args.num_steps * args.num_envs * world.world_size
    feed = replay_feed.make(args, world, model, partial(C51Network, num_actions, support,
                                                        args.dueling, args.precision,
                                                        args.channels_last),
                            "q_values", global_step, cores)
    eval_eps = torch.full((args.eval_envs,), args.eval_epsilon, device=device)
    run.begin(global_step, global_batch, eval_env=eval_env,
              log_every=max(1, 2048 // (args.num_steps * args.num_envs)),
              policy=lambda obs: epsilon_greedy(model.q_values(obs), eval_eps[:len(obs)]),
              checkpoint=lambda: {"model": model.state_dict(), "target": target.state_dict(),
                                  "optimizer": step.state_dict(), "counters": dict(counters)},
              rank_state=(lambda: {"replay": replay.state_dict()}) if args.save_replay else None)

    while global_step < args.total_timesteps:
        # ---- sampling: T steps of B envs, epsilon-greedy, then into this rank's replay ----
        eps = epsilons(args, global_step, world.rank, world.world_size).to(device)
        acted = feed.collect(eps, replay, run.phases)
        global_step += global_batch

        # ---- learning: as many updates as the replay ratio implies, on averaged gradients ----
        seconds = 0.0  # communicating
        with run.phases("learn"):
            if global_step >= counters["learn_from"] and replay.num_valid() > 0:  # on all ranks
                beta = args.priority_beta + (1 - args.priority_beta) * min(
                    1.0, global_step / args.total_timesteps)
                for _ in range(replay_shard.updates_due(counters, args, global_batch,
                                                        world.world_size)):
                    batch = replay.sample(args.batch_size, beta, device)
                    stats, ce, c = c51_update(model, target, step, batch, args)
                    replay.update_priorities(batch["indices"], ce)
                    seconds += c
                    run.record(stats)
            interval = args.target_update_interval  # in global steps (Nature, C51: in updates)
            if global_step // interval > (global_step - global_batch) // interval:
                target.load_state_dict(model.state_dict())
            feed.publish()  # --async-sampling: to the sampler process
        run.phases.add("comm", seconds, taken_from="learn")

        # ---- logging, evaluation, checkpoints, stop ----
        if feed.end_iteration(run, global_step, acted, counters):
            break
    run.close(global_step, feed, eval_env, updates=counters["updates"],
              replay_bytes_per_transition=replay.bytes_per_transition())


if __name__ == "__main__":
    main()
