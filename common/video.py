"""Video of an agent's game: the MP4 writer of `benchmarks/evaluate.py --video` and of the
scripts' --capture-video.

How and why: docs/internals.md#commonvideopy.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from common import envs

FPS = 15  # 60 Hz emulator, one agent step per 4 frames


class VideoRecorder:
    """Stands in for the evaluation `Envs` in evaluation.play and records environment 0's first
    game from a second, RGB, full-size ALE environment stepped in lockstep (docs/internals.md).
    `run`: the run's flags (--fire-reset, --sticky-actions, --eval-max-steps)."""

    def __init__(self, env: envs.Envs, run, path: Path):
        import imageio_ffmpeg
        from ale_py.vector_env import AtariVectorEnv

        self.env, self.path = env, path
        # The evaluation environment's settings (common/envs.py, Envs with episodic lives off)
        self.venv = AtariVectorEnv(
            env.game, 1, num_threads=1, noop_max=30, use_fire_reset=run.fire_reset,
            episodic_life=False, life_loss_info=False, reward_clipping=False,
            repeat_action_probability=0.25 if run.sticky_actions else 0.0,
            autoreset_mode="SameStep", max_num_frames_per_episode=4 * run.eval_max_steps,
            grayscale=False, img_height=210, img_width=160, stack_num=1)
        # ffmpeg chooses the container from the name, so the temporary file ends in .mp4 too
        self.tmp = path.with_name(f".{path.stem}.{os.getpid()}.partial.mp4")
        self.writer = imageio_ffmpeg.write_frames(
            str(self.tmp), (160, 210), fps=FPS, codec="libx264", pix_fmt_out="yuv420p",
            macro_block_size=2)  # 210 x 160 is even, as yuv420p needs: no rescaling
        self.writer.send(None)  # starts ffmpeg
        self.recording, self.frames, self.score, self.length = True, 0, 0.0, 0
        self.lives, self.fire_next, self.keep = 0, False, False

    def __getattr__(self, name):  # num_envs, episodes, game_over...: the evaluation env's
        return getattr(self.env, name)

    def _frame(self, rgb: np.ndarray) -> None:
        self.writer.send(np.ascontiguousarray(rgb))
        self.frames += 1

    def reset(self, seeds: np.ndarray) -> np.ndarray:
        obs, info = self.venv.reset(seed=np.asarray(seeds[:1]))
        self.lives = int(info["lives"][0])
        self._frame(obs[0, -1])
        return self.env.reset(seeds)

    def send(self, actions: np.ndarray) -> None:
        if self.recording:
            # The action environment 0 executes: FIRE after a lost life, as Envs.send does
            action = self.env.fire if self.fire_next else actions[0]
            self.venv.send(np.asarray([action], dtype=actions.dtype))
        self.env.send(actions)

    def recv(self):
        out = self.env.recv()
        if self.recording:
            obs, reward, terminated, truncated, info = self.venv.recv()
            self.score += float(reward[0])
            self.length += 1
            lives = int(info["lives"][0])
            over = bool(terminated[0] or truncated[0])
            self.fire_next = self.env.fire is not None and lives < self.lives and not over
            self.lives = lives
            if over:  # SameStep autoreset: obs is the next game's; its last screen is final_obs
                self._frame(info["final_obs"][0, -1])
                self.recording = False
            else:
                self._frame(obs[0, -1])
        return out

    def finish(self) -> None:
        """Close the encoder and give the video its name (never over an existing file)."""
        self._stop()
        try:
            os.link(self.tmp, self.path)  # fails if the name was taken while recording
        except FileExistsError:
            self.keep = True
            raise FileExistsError(f"{self.path} appeared while recording; the video is "
                                  f"{self.tmp}") from None
        except OSError:  # a file system without hard links: check, then rename
            if self.path.exists():
                self.keep = True
                raise FileExistsError(f"{self.path} appeared while recording; the video is "
                                      f"{self.tmp}") from None
            os.replace(self.tmp, self.path)

    def _stop(self) -> None:
        if self.writer is not None:
            self.writer.close()  # waits for ffmpeg to finish the file
            self.writer = None
            self.venv.close()

    def close(self) -> None:
        """Stop ffmpeg and the emulator; the temporary name goes (after finish() it is a second
        link to the video) unless finish() had to keep it."""
        self._stop()
        if not self.keep:
            self.tmp.unlink(missing_ok=True)
