"""Replay memory for the DQN family: each 84x84 frame stored once, on the rank's device.

How and why: docs/internals.md#commonreplaypy.
"""

from __future__ import annotations

import torch

from common.gpu import Upload

TERM, TRUNC = 1, 2  # flags bits 0 and 1; bits 2-3: what the stack held before the newest frame
HISTORY, ZEROS, REPEAT = 0, 1, 2


class SumTree:
    """Leaves hold priorities p^alpha; each inner node holds the sum of its two children."""

    def __init__(self, size: int, device: torch.device):
        self.depth = max(1, (size - 1).bit_length())
        self.leaves = 1 << self.depth
        self.tree = torch.zeros(2 * self.leaves, dtype=torch.float64, device=device)  # sums of 1M

    def set(self, idx: torch.Tensor, values: torch.Tensor) -> None:
        """Set leaves idx [N] to values [N], then their ancestors level by level: recomputed from
        the children, not added to, so repeated indices are harmless."""
        i = idx + self.leaves
        self.tree[i] = values.to(torch.float64)
        for _ in range(self.depth):
            i = i // 2
            self.tree[i] = self.tree[2 * i] + self.tree[2 * i + 1]

    def total(self) -> torch.Tensor:
        return self.tree[1]

    def find(self, u: torch.Tensor) -> torch.Tensor:
        """Leaf index for each prefix-sum target u [N] in [0, total). A child whose sum is 0 is
        never entered, so rounding at the edges cannot select an empty (unsampleable) leaf."""
        i = torch.ones_like(u, dtype=torch.long)
        for _ in range(self.depth):
            left, right = self.tree[2 * i], self.tree[2 * i + 1]
            go_right = ((u >= left) & (right > 0)) | (left <= 0)
            u = torch.where(go_right, u - left, u)
            i = 2 * i + go_right.long()
        return i - self.leaves


class Replay:
    """A rank's shard: `capacity` transitions over `num_envs` columns of `capacity // num_envs`."""

    def __init__(self, capacity: int, num_envs: int, device: torch.device, n_step: int = 1,
                 gamma: float = 0.99, prioritized: bool = False, alpha: float = 0.5,
                 priority_eps: float = 1e-6):
        T, B = capacity // num_envs, num_envs
        if T < n_step + 5:
            raise ValueError(f"replay shard of {capacity} transitions gives {T} per environment, "
                             f"fewer than --n-step + 5 = {n_step + 5}")
        self.T, self.B, self.device, self.n, self.gamma = T, B, device, n_step, gamma
        self.frames = torch.zeros((T, B, 84, 84), dtype=torch.uint8, device=device)
        self.actions = torch.zeros((T, B), dtype=torch.int16, device=device)
        self.rewards = torch.zeros((T, B), dtype=torch.float32, device=device)
        self.flags = torch.zeros((T, B), dtype=torch.uint8, device=device)
        self.final_idx = torch.full((T, B), -1, dtype=torch.int32, device=device)
        self.final_frames = torch.zeros((0, 84, 84), dtype=torch.uint8, device=device)
        self.steps = 0  # complete rows ever added to each column
        self.alpha, self.priority_eps = alpha, priority_eps
        self.tree = SumTree(T * B, device) if prioritized else None
        self.max_priority = torch.ones((), dtype=torch.float64, device=device)
        self._pending: list = []  # priorities on their way from a GPU (update_priorities)
        self._upload = None
        self.mask_all = device.type == "cuda"  # sample(): patch truncations without a host sync

    def _valid(self) -> tuple[int, int]:
        """Range [lo, hi] of sampleable step numbers (row = step % T) in every column."""
        size = min(self.steps, self.T - 1)  # one row holds the pending next frame
        history = 3 if self.steps > self.T - 1 else 0  # the oldest rows' history is overwritten
        return self.steps - size + history, self.steps - self.n

    def num_valid(self) -> int:
        lo, hi = self._valid()
        return max(0, hi - lo + 1) * self.B

    def bytes_per_transition(self) -> float:
        extra = self.final_frames.numel() + (self.tree.tree.numel() * 8 if self.tree else 0)
        return 84 * 84 + sum(x.element_size() for x in (self.actions, self.rewards, self.flags,
                                                        self.final_idx)) + extra / (self.T * self.B)

    def _store_finals(self, rows: torch.Tensor, cols: torch.Tensor, frames: torch.Tensor) -> None:
        """Keep truncated episodes' final frames [k, 84, 84] for slots (rows, cols), reusing
        entries whose slot was overwritten; grow the store only when all are in use."""
        live = torch.zeros(len(self.final_frames) + 1, dtype=torch.bool, device=self.device)
        live[self.final_idx.flatten().long()] = True  # index -1 lands on the spare last entry
        free = torch.nonzero(~live[:-1]).flatten()
        if len(free) < len(frames):
            grow = max(len(self.final_frames), len(frames) - len(free), 16)
            self.final_frames = torch.cat([self.final_frames, torch.zeros(
                (grow, 84, 84), dtype=torch.uint8, device=self.device)])
            free = torch.cat([free, torch.arange(len(self.final_frames) - grow,
                                                 len(self.final_frames), device=self.device)])
        free = free[:len(frames)]
        self.final_frames[free] = frames
        self.final_idx[rows, cols] = free.int()

    def _set_priority(self, steps_lo: int, steps_hi: int, value: torch.Tensor | float) -> None:
        if self.tree is None or steps_hi < steps_lo:
            return
        rows = torch.arange(steps_lo, steps_hi + 1, device=self.device) % self.T
        leaves = (rows[:, None] * self.B + torch.arange(self.B, device=self.device)).flatten()
        self.tree.set(leaves, torch.as_tensor(value, device=self.device).expand(len(leaves)))

    @torch.no_grad()
    def add(self, obs, actions, rewards, terminated, truncated, next_obs, final_obs=None) -> None:
        """Append a [R, B] rollout: obs uint8 [R, B, 4, 84, 84], actions/rewards/terminated/
        truncated [R, B], next_obs [B, 4, 84, 84] (the observation after the last step), and
        final_obs [k, 4, 84, 84]: the true last observations of the k truncated steps, in
        row-major order of truncated.nonzero() (the order the Sampler values them in)."""
        R, dev = obs.shape[0], self.device
        if R + self.n + 4 > self.T:
            raise ValueError(f"a rollout of {R} steps does not fit a replay of {self.T} per env")
        lo_old, hi_old = self._valid()
        rows = (self.steps + torch.arange(R + 1, device=dev)) % self.T  # R steps + pending frame
        stacks = torch.cat([obs.to(dev), next_obs.to(dev)[None]])  # [R + 1, B, 4, 84, 84]
        older, newest = stacks[:, :, :3], stacks[:, :, 3:]
        kind = torch.where((older == 0).flatten(2).all(-1), ZEROS,
                           torch.where((older == newest).flatten(2).all(-1), REPEAT, HISTORY))
        done = terminated.to(dev).to(torch.uint8) * TERM + truncated.to(dev).to(torch.uint8) * TRUNC
        done = torch.cat([done, torch.zeros_like(done[:1])])  # the pending row has no outcome yet
        self.frames[rows] = newest[:, :, 0]
        self.flags[rows] = done | (kind.to(torch.uint8) << 2)
        self.actions[rows[:R]] = actions.to(dev).to(torch.int16)
        self.rewards[rows[:R]] = rewards.to(dev).float()
        self.final_idx[rows] = -1
        if final_obs is not None and len(final_obs):
            t, b = truncated.to(dev).nonzero(as_tuple=True)
            self._store_finals(rows[t], b, final_obs.to(dev)[:, -1])
        self.steps += R
        lo, hi = self._valid()
        # Priorities: 0 for overwritten and history-less rows, the running maximum for rows that
        # just became sampleable (new transitions are replayed at least once, Schaul et al.).
        self._set_priority(lo_old, lo - 1, 0.0)
        self._set_priority(self.steps - R, self.steps, 0.0)
        self._set_priority(max(hi_old + 1, lo), hi, self.max_priority ** self.alpha)

    def _stack(self, rows: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
        """Observation stacks uint8 [N, 4, 84, 84] ending at rows [N] of columns cols [N]."""
        r = (rows[:, None] - torch.arange(3, -1, -1, device=self.device)) % self.T  # [N, 4]
        kind = (self.flags[r[:, [3, 2, 1]], cols[:, None]] >> 2) & 3  # at rows t, t-1, t-2
        start = kind != HISTORY
        j = torch.where(start.any(1), start.int().argmax(1), 3)  # nearest episode start: row t-j
        pad = torch.arange(4, device=self.device)[None] < (3 - j)[:, None]  # frames before it
        # Padded positions read the episode's first frame (row t-j), then zeros are masked in:
        # one index_select over flat frames (7x faster than 2-D advanced indexing on a CPU).
        src = torch.where(pad, ((rows - j) % self.T)[:, None], r) * self.B + cols[:, None]
        x = self.frames.view(-1, 84, 84).index_select(0, src.flatten()).view(len(rows), 4, 84, 84)
        zero = pad & (kind.gather(1, j.clamp(max=2)[:, None]) == ZEROS)  # [N, 4]
        return x.mul_((~zero)[:, :, None, None].to(torch.uint8))

    @torch.no_grad()
    def sample(self, batch_size: int, beta: float = 0.4,
               device: torch.device | None = None) -> dict[str, torch.Tensor]:
        """n-step transitions on `device` (default: the replay's; indices stay there): obs, next_obs
        uint8 [N, 4, 84, 84]; actions long [N]; returns, discounts, weights float [N]; indices long
        [N]. weights: (N_valid * P(i))^-beta / max over the batch (Schaul et al. 2016, Sec. 3.4)."""
        self._flush()
        lo, hi = self._valid()
        if hi < lo:
            raise RuntimeError("replay has no sampleable transition yet")
        dev, N = self.device, batch_size
        if self.tree is None:
            step = torch.randint(lo, hi + 1, (N,), device=dev)
            idx = (step % self.T) * self.B + torch.randint(self.B, (N,), device=dev)
            weights = torch.ones(N, device=dev)
        else:  # stratified: one target in each of N equal slices of the total priority
            total = self.tree.total()
            u = (torch.arange(N, device=dev) + torch.rand(N, device=dev, dtype=torch.float64))
            idx = self.tree.find(u / N * total)
            prob = self.tree.tree[idx + self.tree.leaves] / total
            w = (self.num_valid() * prob) ** -beta
            weights = (w / w.max()).float()
        t, b = idx // self.B, idx % self.B

        k = torch.arange(self.n, device=dev)
        rows = (t[:, None] + k) % self.T  # [N, n]
        flags = self.flags[rows, b[:, None]]
        done = (flags & (TERM | TRUNC)) != 0
        live = (done.cumsum(1) - done.int()) == 0  # no episode end strictly before step k
        returns = (self.rewards[rows, b[:, None]] * self.gamma ** k * live).sum(1)
        ended = done.any(1)
        m = torch.where(ended, done.int().argmax(1), self.n)  # steps summed - 1, or n
        end_flags = flags.gather(1, m.clamp(max=self.n - 1)[:, None]).squeeze(1)
        terminal = ended & ((end_flags & TERM) != 0)
        truncated = ended & ~terminal
        discounts = torch.where(terminal, 0.0, self.gamma ** (m + ended.long()).double()).float()
        boot = (t + m) % self.T  # row t+n, or the row where the episode ended
        next_obs = self._stack(boot, b)
        # After a truncation the true last observation is [rows u-2..u, final frame]. Rare: on a
        # CPU only those rows are patched; on a GPU all rows are masked (asking .any() would sync).
        if len(self.final_frames) and (self.mask_all or truncated.any()):
            rows = slice(None) if self.mask_all else truncated
            fi = self.final_idx[boot[rows], b[rows]].long().clamp(min=0)
            fixed = torch.cat([next_obs[rows, 1:], self.final_frames[fi][:, None]], 1)
            next_obs[rows] = torch.where(truncated[rows, None, None, None], fixed, next_obs[rows])
        batch = {"obs": self._stack(t, b), "actions": self.actions[t, b].long(),
                 "returns": returns, "discounts": discounts, "next_obs": next_obs,
                 "weights": weights}
        if device is not None and device != self.device:
            self._upload = self._upload or Upload(device)
            batch = self._upload(batch)
        return {**batch, "indices": idx}

    @torch.no_grad()
    def update_priorities(self, indices: torch.Tensor, priorities: torch.Tensor) -> None:
        """Set sampled transitions' priorities (|TD error|) + priority_eps (none reaches 0), to the
        power alpha. A GPU learner's, for a CPU replay, are copied without waiting and applied at
        the next sample."""
        if self.tree is None:
            return
        p = priorities.detach()
        if p.device != self.device:
            host = torch.empty(p.shape, dtype=p.dtype, pin_memory=True)
            host.copy_(p, non_blocking=True)
            self._pending.append((indices.to(self.device), host, torch.cuda.Event()))
            self._pending[-1][2].record()
            return
        self._set_priorities(indices, p)

    def _set_priorities(self, indices: torch.Tensor, p: torch.Tensor) -> None:
        p = p.to(torch.float64).abs() + self.priority_eps
        self.max_priority = torch.maximum(self.max_priority, p.max())
        self.tree.set(indices, p ** self.alpha)

    def _flush(self) -> None:
        while self._pending:
            indices, host, copied = self._pending.pop(0)
            copied.synchronize()
            self._set_priorities(indices, host)

    def state_dict(self) -> dict:
        self._flush()
        state = {"frames": self.frames, "actions": self.actions, "rewards": self.rewards,
                 "flags": self.flags, "final_idx": self.final_idx,
                 "final_frames": self.final_frames, "steps": self.steps,
                 "max_priority": self.max_priority}
        if self.tree is not None:
            state["tree"] = self.tree.tree
        return state

    def load_state_dict(self, state: dict) -> None:
        """Restore a shard. Environments restart after a resume, so each column's open episode is
        closed as a truncation at the saved pending frame: it bootstraps from where the game was."""
        if tuple(state["frames"].shape) != tuple(self.frames.shape) or \
                ("tree" in state) != (self.tree is not None):
            raise ValueError(f"saved replay shard {tuple(state['frames'].shape)[:2]} "
                             f"(prioritized: {'tree' in state}) does not fit this run's "
                             f"{(self.T, self.B)} (prioritized: {self.tree is not None})")
        for name in ("frames", "actions", "rewards", "flags", "final_idx"):
            getattr(self, name).copy_(state[name])
        self.final_frames = state["final_frames"].to(self.device)
        self.steps = int(state["steps"])
        self.max_priority = state["max_priority"].to(self.device, torch.float64)
        if self.tree is not None:
            self.tree.tree.copy_(state["tree"])
        if self.steps:
            row, pending = (self.steps - 1) % self.T, self.steps % self.T
            open_ = torch.nonzero((self.flags[row] & (TERM | TRUNC)) == 0).flatten()
            if len(open_):
                self.flags[row, open_] |= TRUNC
                rows = torch.full_like(open_, row)
                self._store_finals(rows, open_, self.frames[pending, open_])
