"""Batched-inference rollout collection (paper Sec. 3.1), plain or alternating.

How and why: docs/internals.md#commonsamplerpy.
"""

from __future__ import annotations

import time
from typing import Callable

import numpy as np
import torch

from common.envs import Envs

# policy(obs uint8 [n, 4, 84, 84], cols: the n environment columns obs holds, a slice of B)
#   -> (actions long [n], extras {name: float tensor [n]})
Policy = Callable[[torch.Tensor, slice], tuple[torch.Tensor, dict[str, torch.Tensor]]]


class Sampler:
    def __init__(self, envs: list[Envs], num_steps: int, device: torch.device,
                 extras: tuple[str, ...] = (), clip_rewards: bool = True):
        assert len(envs) in (1, 2), "one group (plain) or two (alternating)"
        self.envs, self.T, self.device, self.clip_rewards = envs, num_steps, device, clip_rewards
        self.n = envs[0].num_envs
        self.B = self.n * len(envs)
        T, B = num_steps, self.B
        self.buf = {"obs": torch.zeros((T, B, 4, 84, 84), dtype=torch.uint8, device=device),
                    "actions": torch.zeros((T, B), dtype=torch.long, device=device),
                    "final_values": torch.zeros((T, B), device=device),
                    **{k: torch.zeros((T, B), device=device) for k in extras}}
        # Per-step outcomes are small: keep them in host arrays and move them to the device once
        # per rollout, not once per step (on the CPU, the tensors share the arrays' memory).
        self.host = {"rewards": np.zeros((T, B), np.float32),
                     "terminated": np.zeros((T, B), bool), "truncated": np.zeros((T, B), bool)}
        self.next_obs = torch.zeros((B, 4, 84, 84), dtype=torch.uint8, device=device)
        # A GPU's observations arrive through pinned memory, so the upload is an asynchronous
        # copy; the next write to a group's part waits for that group's inference (actions.cpu()).
        self.stage = torch.zeros((B, 4, 84, 84), dtype=torch.uint8,
                                 pin_memory=True) if device.type == "cuda" else None
        self.time_env = self.time_inference = 0.0

    def reset(self, seeds: np.ndarray) -> None:
        """Reset all environments, environment b with seeds[b] (see envs.env_seeds)."""
        for g, e in enumerate(self.envs):
            cols = self._cols(g)
            self.next_obs[cols] = torch.from_numpy(e.reset(seeds[cols])).to(self.device)

    def pop_episodes(self) -> list[tuple[float, int]]:
        """Finished games since the last call: (true return, length in agent steps)."""
        out = [ep for e in self.envs for ep in e.episodes]
        for e in self.envs:
            e.episodes.clear()
        return out

    def _cols(self, g: int) -> slice:
        return slice(g * self.n, (g + 1) * self.n)

    @torch.no_grad()
    def _act(self, policy: Policy, t: int, g: int) -> None:
        """Infer group g's actions for step t from obs[t] and hand them to its simulators."""
        t0 = time.perf_counter()
        cols, b = self._cols(g), self.buf
        actions, extras = policy(b["obs"][t, cols], cols)
        b["actions"][t, cols] = actions
        for k, v in extras.items():
            b[k][t, cols] = v
        actions = actions.cpu().numpy()  # waits for the device: inference time is complete here
        self.time_inference += time.perf_counter() - t0
        self.envs[g].send(actions)

    @torch.no_grad()
    def _store(self, t: int, g: int, value_fn: Callable | None) -> None:
        """Wait for group g's step t and record its outcome; one copy puts the new observation in
        obs[t + 1] (next_obs after the last step)."""
        t0 = time.perf_counter()
        obs, reward, terminated, truncated, final_obs = self.envs[g].recv()
        self.time_env += time.perf_counter() - t0
        cols, b, h = self._cols(g), self.buf, self.host
        # clip for learning only; the episode statistics already saw the raw reward
        h["rewards"][t, cols] = np.sign(reward) if self.clip_rewards else reward
        h["terminated"][t, cols] = terminated
        h["truncated"][t, cols] = truncated
        if final_obs is not None and value_fn is not None:  # rare: a time limit was hit
            idx = torch.from_numpy(np.flatnonzero(truncated)).to(self.device) + cols.start
            final_obs = torch.from_numpy(final_obs).to(self.device)
            b["final_values"][t, idx] = value_fn(final_obs).float()
        dest = self.next_obs[cols] if t + 1 == self.T else b["obs"][t + 1, cols]
        # numpy's copy: torch's wakes its OpenMP threads for 225 KB, 4x slower on a CPU
        np.copyto((dest if self.stage is None else self.stage[cols]).numpy(), obs)
        if self.stage is not None:
            dest.copy_(self.stage[cols], non_blocking=True)

    def collect(self, policy: Policy, value_fn: Callable | None = None) -> dict[str, torch.Tensor]:
        """Run T steps of every environment; returns the rollout buffers (reused next call).
        value_fn(obs) -> [k] values, only to bootstrap truncated episodes."""
        G = len(self.envs)
        self.buf["obs"][0] = self.next_obs
        self.buf["final_values"].zero_()
        for g in range(G):  # with two groups, group 1's inference overlaps group 0's simulation
            self._act(policy, 0, g)
        for t in range(self.T):
            for g in range(G):
                self._store(t, g, value_fn)
                if t + 1 < self.T:
                    self._act(policy, t + 1, g)
        for k, v in self.host.items():
            self.buf[k] = torch.from_numpy(v).to(self.device)
        return self.buf
