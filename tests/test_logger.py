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


def test_the_progress_line_counts_to_the_step_the_header_names(tmp_path, capsys):
    """--total-timesteps rounded up to whole iterations: the header and the progress line give
    the same total (10,002,432 for 10M steps of 8 x 128 x 3 ranks), the ETA runs to it."""
    from common.run import RunArgs
    args = RunArgs(total_timesteps=10_000_000)
    world = World(rank=0, local_rank=0, world_size=3, device=torch.device("cpu"))
    logger = Logger(tmp_path, world, args, global_batch=3072)
    logger._progress(9_997_312, 1_000.0)
    logger.close()
    header, line = (ln for ln in capsys.readouterr().out.splitlines() if "10,002,432" in ln)
    assert header.startswith("training to step 10,002,432: 3,256 iterations")
    assert "step   9,997,312/10,002,432 ( 99.9%)" in line and line.endswith("| eta 0:00:05")
