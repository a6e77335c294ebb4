"""Run an algorithm script with a fault in its learner, as a bug or a CUDA out-of-memory would
strike: `python tests/inject_fault.py algos/<script>.py FLAGS`. Once the file named by
$ACCELRL_FAULT exists, rank 0's next optimizer step (torch's Adam or RMSprop, or the central
optimizer's) raises RuntimeError("fault injected into the learner")."""

import os
import runpy
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import torch  # noqa: E402

from common import central_optim  # noqa: E402


def armed(step):
    def run(*args, **kwargs):
        if os.environ.get("RANK", "0") == "0" and os.path.exists(os.environ["ACCELRL_FAULT"]):
            raise RuntimeError("fault injected into the learner")
        return step(*args, **kwargs)
    return run


for cls in (torch.optim.Adam, torch.optim.RMSprop, central_optim.CentralOptimizer):
    cls.step = armed(cls.step)
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
