"""Epsilon-greedy exploration for the DQN family (dqn_multigpu.py, cat_dqn.py).

How and why: docs/internals.md#commonexplorationpy.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from common import gpu


def epsilons(args, global_step: int, rank: int, world_size: int) -> torch.Tensor:
    """Exploration rate of each of this rank's environments [num_envs] (docs/internals.md)."""
    if args.eps_schedule == "apex":
        n = world_size * args.num_envs
        i = rank * args.num_envs + torch.arange(args.num_envs, dtype=torch.float64)
        return (0.4 ** (1 + 7 * i / max(n - 1, 1))).float()
    frac = min(1.0, max(0.0, global_step - args.learning_starts) / max(args.eps_decay_steps, 1))
    return torch.full((args.num_envs,), args.eps_start + frac * (args.eps_end - args.eps_start))


def epsilon_greedy(q: torch.Tensor, eps: torch.Tensor) -> torch.Tensor:
    """Actions [n] from Q values [n, A]: uniformly random with probability eps [n], else argmax."""
    n, num_actions = q.shape
    explore = torch.rand(n, device=q.device) < eps
    return torch.where(explore, torch.randint(num_actions, (n,), device=q.device), q.argmax(1))


class Explorer(nn.Module):
    """The sampler's policy: epsilon-greedy on `net`'s Q values [n, A] (its method `q`: "forward",
    or C51's "q_values"), one epsilon per environment column. The epsilons [num_envs] are a
    buffer, so they travel with the parameters to an asynchronous sampler's copy
    (common/async_sampler.py publishes both)."""

    def __init__(self, net: nn.Module, num_envs: int, q: str = "forward", compile: bool = False):
        super().__init__()
        self.net = net
        self.q_fn = gpu.compiled(getattr(net, q), compile)
        self.register_buffer("eps", torch.ones(num_envs))

    def forward(self, obs: torch.Tensor, cols: slice):
        """Actions [n] for obs [n, 4, 84, 84] of the environment columns `cols`."""
        return epsilon_greedy(self.q_fn(obs), self.eps[cols]), {}


def act(explorer: Explorer, obs: torch.Tensor, cols: slice):
    """AsyncSampler's policy function: the explorer's epsilon-greedy actions."""
    return explorer(obs, cols)


def status(eps: torch.Tensor, learn_from: int, global_step: int) -> str:
    """The progress line's note: the mean epsilon, and when learning starts if it has not."""
    note = f"eps {eps.mean().item():.3f}"
    return note + (f" | learning from step {learn_from:,}" if global_step < learn_from else "")
