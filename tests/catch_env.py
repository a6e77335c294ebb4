"""The tests' Catch ids: `tests.catch_env:Catch-v0` is common/catch.py's game, and
CatchTruncated-v0 its time-limited variant, truncated after 3 steps, before the ball lands (for
the bootstrapping tests)."""

import gymnasium as gym

from common.catch import Catch

gym.register("CatchTruncated-v0", entry_point=Catch, max_episode_steps=3)
