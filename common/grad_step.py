"""One optimizer step on a loss, synchronous or asynchronous: the choice is made once, here.

An update function calls `step(loss)` and never asks which kind it holds (paper Sec. 3.2):
- `AllReduceStep`: every rank's gradient is averaged in one flat all-reduce (common/dist.py),
  then clipped and stepped, so every rank holds the same parameters.
- `CentralStep` (--asynchronous; APPO always): the rank's own clipped gradient goes into the
  machine's central optimizer (common/central_optim.py), whose new parameters, other ranks'
  steps included, the rank then pulls. No rank waits for another's gradient.
Both count the steps schedules follow, checkpoint their optimizer state and close the same way.
Both give every parameter its gradient buffer before the first backward: autograd then adds each
backward's gradients into it. Without one, autograd keeps the first backward's output as `.grad`,
and under --compile on a GPU that output is CUDA-graph memory, overwritten at the next step.
A script with both modes gets its step from common/central_optim.py's make_step.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from common import dist


def own_grads(model: nn.Module) -> None:
    """A zeroed `.grad` of the model's own for every trainable parameter that has none."""
    for p in model.parameters():
        if p.requires_grad and p.grad is None:
            p.grad = torch.zeros_like(p)


class AllReduceStep:
    """Average gradients over ranks, clip them to `max_grad_norm` (0: no clip), step."""

    independent = False  # ranks meet inside every step: all take the same updates

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, max_grad_norm: float):
        self.model, self.optimizer, self.max_grad_norm = model, optimizer, max_grad_norm
        own_grads(model)

    @property
    def lr(self) -> float:
        return self.optimizer.param_groups[0]["lr"]

    @lr.setter
    def lr(self, value: float) -> None:
        self.optimizer.param_groups[0]["lr"] = value

    def __call__(self, loss: torch.Tensor) -> tuple[torch.Tensor | None, float]:
        """Backward and step; returns (gradient norm before clipping or None, seconds
        communicating). Nothing here waits for the device."""
        self.optimizer.zero_grad(set_to_none=False)
        loss.backward()
        comm = dist.all_reduce_grads(self.model)
        norm = self._clip()
        self.optimizer.step()
        return norm, comm

    def _clip(self) -> torch.Tensor | None:
        return (nn.utils.clip_grad_norm_(self.model.parameters(), self.max_grad_norm)
                if self.max_grad_norm > 0 else None)

    def count(self, rank_steps: int, global_step: int) -> int:
        """The step schedules follow after this rank's `rank_steps` new ones: the global step."""
        return global_step

    def refresh(self) -> None:
        """The model's parameters are everyone's newest already."""

    def state_dict(self) -> dict:
        return self.optimizer.state_dict()

    def summary(self) -> dict:
        return {}

    def close(self) -> None:
        pass


class CentralStep(AllReduceStep):
    """Clip this rank's own gradient, apply it to `central` (common/central_optim.py) chunk by
    chunk, whichever chunk is free first, and pull the result; communication is the wait for
    chunks other ranks held."""

    independent = True  # ranks meet only at the logging cadence

    def __init__(self, model: nn.Module, central, lr: float,
                 max_grad_norm: float):
        self.model, self.central, self.max_grad_norm = model, central, max_grad_norm
        self._lr = lr
        own_grads(model)

    @property
    def lr(self) -> float:
        return self._lr

    @lr.setter
    def lr(self, value: float) -> None:
        self._lr = value

    def __call__(self, loss: torch.Tensor) -> tuple[torch.Tensor | None, float]:
        self.model.zero_grad(set_to_none=False)
        loss.backward()
        norm = self._clip()
        waited = self.central.step(self._lr)
        self.central.pull()
        return norm, waited

    def count(self, rank_steps: int, global_step: int) -> int:
        """The machine's step count, other ranks' steps included. Ranks meet only to log, so
        a dead one is looked for here, each iteration."""
        self.central.check_peers()
        return self.central.add_steps(rank_steps)

    def refresh(self) -> None:
        """Take the central parameters: other ranks' steps since this rank's last one."""
        self.central.pull()

    def state_dict(self) -> dict:
        """Called by all ranks: once each is between updates, the central copy is whole."""
        dist.all_gather(None)
        self.central.pull()
        return self.central.state_dict()

    def summary(self) -> dict:
        """The machine's step count and how many updates every chunk took."""
        return {"central_step": self.central.add_steps(0),
                "central_updates": int(self.central.steps[0])}

    def close(self) -> None:
        self.central.close()

