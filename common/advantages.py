"""Advantages for the policy-gradient scripts (PPO, A2C, APPO): one GAE, so the three agree on
episode boundaries by construction."""

from __future__ import annotations

import torch


def gae(rewards, values, terminated, truncated, final_values, next_value, gamma, lam):
    """Generalised advantage estimation (Schulman et al. 2016, eq. 16) over a [T, B] rollout of
    rewards and values; returns the advantages [T, B].

    At a termination the next state's value is 0. At a truncation it is the value of the true
    last observation (final_values), since the episode would have gone on. Either way the
    recursion does not cross into the next episode. next_value [B] bootstraps the last step.
    """
    T = rewards.shape[0]
    advantages = torch.zeros_like(rewards)
    running = torch.zeros_like(next_value)
    for t in reversed(range(T)):
        v_next = next_value if t == T - 1 else values[t + 1]
        v_next = torch.where(truncated[t], final_values[t], v_next)
        v_next = torch.where(terminated[t], torch.zeros_like(v_next), v_next)
        delta = rewards[t] + gamma * v_next - values[t]
        running = delta + gamma * lam * running * ~(terminated[t] | truncated[t])
        advantages[t] = running
    return advantages
