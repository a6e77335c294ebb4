"""Clean stops and checkpoints on the clock, decided where the ranks meet.

SIGTERM or SIGINT (Ctrl-C) on any rank stops every rank at the same iteration, which then
checkpoints and exits 0, printing the command that continues the run; a second Ctrl-C kills at
once. --checkpoint-minutes of wall-clock time since the last such checkpoint (or the launch)
make a checkpoint due on every rank at the same iteration, so a crash or a lost machine loses at
most that much, whatever the hardware's speed.
"""

from __future__ import annotations

import signal
import time

import torch

from common import dist, runs


class StopRequest:
    """SIGTERM / SIGINT set a flag that all ranks check together where they meet (a signal to
    one stops all); `args`: the script's flags (the run directory, --checkpoint-minutes)."""

    def __init__(self, args):
        self.args, self.signal = args, None
        self.every, self.last = args.checkpoint_minutes * 60, time.monotonic()
        self.checkpoint_due = False  # set by each call: all ranks agree
        for s in (signal.SIGTERM, signal.SIGINT):
            signal.signal(s, self._handle)

    def _handle(self, signum, frame):
        self.signal = signum
        signal.signal(signum, signal.SIG_DFL)  # a second Ctrl-C kills at once

    def __call__(self, world: dist.World, global_step: int) -> bool:
        """Whether to stop (rank 0 then prints how to continue); one all-reduce, which also
        agrees on `checkpoint_due`: --checkpoint-minutes have passed on some rank's clock."""
        due = self.every > 0 and time.monotonic() - self.last >= self.every
        flags = torch.tensor([1.0 if self.signal else 0.0, 1.0 if due else 0.0],
                             device=world.device)
        stop, self.checkpoint_due = (dist.all_reduce_mean(flags) > 0).tolist()
        if self.checkpoint_due:
            self.last = time.monotonic()
        if stop and world.is_main:
            print(f"\nstopped by signal at step {global_step:,}; continue with:\n  "
                  f"{runs.continue_command(self.args)}", flush=True)
        return stop
