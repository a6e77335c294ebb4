"""Running mean and variance of a stream of tensors, as a module whose statistics are buffers (so
they travel in the model's state_dict: checkpoints, resumes and loaded policies normalise alike).

What rl_games calls `normalize_input` and `normalize_value` (its RunningMeanStd): inputs become
`(x - mean) / sqrt(var + 1e-5)` clipped to +-5, element by element; value targets are learned in
units of their running standard deviation. The statistics are those of every sample seen since
the start (Chan et al. 1979's parallel update), each batch's moments averaged over ranks first, so
every rank holds the same statistics as its parameters.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from common import dist

EPS = 1e-5  # rl_games' epsilon: an element that never changes normalises to 0, not to nan
CLIP = 5.0  # rl_games clips normalised inputs to +-5 standard deviations


class RunningNorm(nn.Module):
    """Statistics of elements of shape `shape` over all batches given to `update`."""

    def __init__(self, shape: tuple[int, ...]):
        super().__init__()
        self.register_buffer("mean", torch.zeros(shape))
        self.register_buffer("var", torch.ones(shape))
        self.register_buffer("count", torch.zeros((), dtype=torch.float64))

    @torch.no_grad()
    def update(self, x: torch.Tensor, scale: float = 1.0, chunk: int = 1024) -> None:
        """Fold in the batch x [N, *shape] (times `scale`, e.g. 1/255 for uint8 frames), all ranks'
        batches alike (each rank must call this with a batch of the same N). Float64 moments, in
        chunks of `chunk` samples: a rollout of frames in float would take gigabytes."""
        total = torch.zeros((2, *self.mean.shape), dtype=torch.float64, device=x.device)
        for i in range(0, x.shape[0], chunk):
            c = x[i:i + chunk].to(torch.float64) * scale
            total[0] += c.sum(0)
            total[1] += (c * c).sum(0)
        moments = dist.all_reduce_mean(total / x.shape[0])
        b_mean = moments[0]
        b_var = (moments[1] - b_mean ** 2).clamp(min=0.0)
        ranks = torch.distributed.get_world_size() if dist.active() else 1
        b_count = float(x.shape[0] * ranks)
        count, mean = self.count.item(), self.mean.double()
        total_count = count + b_count
        delta = b_mean - mean
        m2 = (self.var.double() * count + b_var * b_count
              + delta ** 2 * count * b_count / total_count)
        self.mean.copy_(mean + delta * b_count / total_count)
        self.var.copy_(m2 / total_count)
        self.count.fill_(total_count)

    def std(self) -> torch.Tensor:
        return torch.sqrt(self.var + EPS)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x normalised element-wise and clipped to +-CLIP standard deviations."""
        return ((x - self.mean) / self.std()).clamp(-CLIP, CLIP)

    def denormalize(self, y: torch.Tensor) -> torch.Tensor:
        return y * self.std() + self.mean
