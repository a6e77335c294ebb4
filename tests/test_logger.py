"""The progress line (common/logger.py): an ETA from the current speed, and none during the DQN
family's warm-up, whose steps cost a fraction of what learning steps will."""

from types import SimpleNamespace

import torch

from common.dist import World
from common.logger import Logger


def test_the_eta_comes_after_the_warm_up(tmp_path, capsys):
    world = World(rank=1, local_rank=1, world_size=2, device=torch.device("cpu"))  # no writer
    logger = Logger(tmp_path, world, SimpleNamespace(total_timesteps=1_000_000))
    logger._progress(10_000, 5_000.0, warmup_until=50_000)  # warm-up: fast, no learning yet
    logger._progress(60_000, 100.0, warmup_until=50_000)  # 940,000 steps left at 100 per second
    logger._progress(60_000, 100.0)  # the policy-gradient scripts have no warm-up
    lines = capsys.readouterr().out.splitlines()
    assert "| eta after warm-up" in lines[0] and "SPS    5,000" in lines[0]
    assert lines[1].endswith("| eta 2:36:40") and lines[2].endswith("| eta 2:36:40")
