"""Clean stops: SIGTERM or SIGINT (Ctrl-C) on any rank stops every rank at the same iteration,
which then checkpoints and exits 0; a second Ctrl-C kills at once."""

from __future__ import annotations

import signal

import torch

from common import dist


class StopRequest:
    """SIGTERM / SIGINT set a flag that all ranks check together between iterations (a signal to
    one stops all); the script then checkpoints and exits cleanly."""

    def __init__(self):
        self.signal: int | None = None
        for s in (signal.SIGTERM, signal.SIGINT):
            signal.signal(s, self._handle)

    def _handle(self, signum, frame):
        self.signal = signum
        signal.signal(signum, signal.SIG_DFL)  # a second Ctrl-C kills at once

    def __call__(self, device: torch.device) -> bool:
        flag = torch.tensor([1.0 if self.signal else 0.0], device=device)
        return bool(dist.all_reduce_mean(flag).item() > 0)
