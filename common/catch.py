"""Catch: a tiny Atari-shaped game that learns in a minute on a CPU (a falling ball, a paddle).

A ball starts in a random column of a 7x7 grid and falls one row per step; the agent moves a
paddle along the bottom row (0 stay, 1 left, 2 right). When the ball reaches the bottom the
episode terminates with +1 if the paddle is under it, else -1. Episodes last 6 steps. Each cell
is drawn as a 12x12 block, so frames are 84x84, stacked 4 deep like Atari: uint8 (4, 84, 84).

A random policy catches about one ball in five (mean return near -0.6); a policy that follows
the ball catches every one (return +1). Use it as `--env-id common.catch:Catch-v0`: the README's
quick start trains PPO on it to a mean return near 1 in about half a minute on 2 CPU cores, and
the tests learn on it.
"""

import gymnasium as gym
import numpy as np

CELL, SIZE = 12, 7


class Catch(gym.Env):
    metadata = {"render_modes": []}

    def __init__(self):
        self.observation_space = gym.spaces.Box(0, 255, (4, 84, 84), np.uint8)
        self.action_space = gym.spaces.Discrete(3)
        self.frames = np.zeros((4, 84, 84), np.uint8)

    def _draw(self) -> np.ndarray:
        frame = np.zeros((84, 84), np.uint8)
        r, c = self.ball
        frame[r * CELL:(r + 1) * CELL, c * CELL:(c + 1) * CELL] = 255
        p = self.paddle
        frame[(SIZE - 1) * CELL + CELL // 2:SIZE * CELL, p * CELL:(p + 1) * CELL] = 128
        return frame

    def _obs(self, first: bool = False) -> np.ndarray:
        frame = self._draw()
        if first:
            self.frames[:] = frame
        else:
            self.frames = np.concatenate([self.frames[1:], frame[None]])
        return self.frames.copy()

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.ball = [0, int(self.np_random.integers(SIZE))]
        self.paddle = SIZE // 2
        return self._obs(first=True), {}

    def step(self, action):
        self.paddle = int(np.clip(self.paddle + (0, -1, 1)[int(action)], 0, SIZE - 1))
        self.ball[0] += 1
        done = self.ball[0] == SIZE - 1
        reward = (1.0 if self.paddle == self.ball[1] else -1.0) if done else 0.0
        return self._obs(), reward, done, False, {}


gym.register("Catch-v0", entry_point=Catch)
