"""--capture-video: evaluation games on video on Gymnasium's RecordVideo schedule, the final one
too, uploaded with --track (offline here); refused in one line where it cannot record."""

import glob
import os
import subprocess
import sys

import pytest

from common.run import on_video_schedule
from tests.conftest import CHILD_ENV, ROOT, expect_error, read_summary

BREAKOUT = ("--env-id", "Breakout-v5", "--num-envs", "4", "--num-steps", "32",
            "--update-epochs", "1", "--num-minibatches", "1", "--total-timesteps", "512",
            "--eval-interval", "128", "--eval-episodes", "1", "--eval-envs", "1",
            "--eval-max-steps", "300", "--no-cuda")


def test_schedule_is_gymnasiums_capped_cubic():
    assert [k for k in range(1001) if on_video_schedule(k)] == [n ** 3 for n in range(10)] + [1000]
    assert on_video_schedule(3000) and not on_video_schedule(2500)


@pytest.mark.slow
def test_videos_of_scheduled_and_final_evaluations(tmp_path):
    import imageio_ffmpeg

    run_dir = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "algos" / "ppo_multigpu.py"), *BREAKOUT, "--capture-video",
         "--track", "--run-dir", str(run_dir)], cwd=ROOT, capture_output=True, text=True,
        timeout=600, env={**os.environ, **CHILD_ENV, "WANDB_MODE": "offline",
                          "WANDB_SILENT": "true"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    # evaluations at 128, 256, 384, 512: the 1st and 2nd (schedule 0, 1) and the last (final)
    videos = sorted((run_dir / "videos").iterdir())
    assert [v.name for v in videos] == ["eval-step128.mp4", "eval-step256.mp4",
                                        "eval-step512.mp4"]
    frames, seconds = imageio_ffmpeg.count_frames_and_secs(str(videos[-1]))
    length = read_summary(run_dir)["eval_lengths"][0]  # the final evaluation's one game
    assert frames == length + 1 and seconds == pytest.approx(frames / 15, abs=0.1)  # 15 fps
    uploaded = glob.glob(str(run_dir / "wandb" / "offline-run-*" / "files" / "media" / "videos"
                             / "**" / "*.mp4"), recursive=True)
    assert len(uploaded) == 3


@pytest.mark.parametrize("flags, message", [
    (("--env-id", "tests.catch_env:Catch-v0"),
     "--capture-video records evaluation games of Atari: tests.catch_env:Catch-v0 is not one"),
    (("--env-id", "Breakout-v5", "--eval-episodes", "0"),
     "--capture-video records evaluation games: give --eval-episodes > 0"),
])
def test_refused_in_one_line(flags, message):
    assert expect_error("ppo_multigpu", *flags, "--capture-video") == f"error: {message}"
