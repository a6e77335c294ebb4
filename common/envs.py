"""Vectorized environments: ALE games through ale-py's C++ AtariVectorEnv, anything else through
`gymnasium.make_vec`, both behind one small send/recv interface with true episode statistics.

How and why: docs/internals.md#commonenvspy.
"""

from __future__ import annotations

import os
import re

import gymnasium as gym
import numpy as np

OBS_SHAPE = (4, 84, 84)


class EnvError(ValueError):
    """A user-facing problem with the environment id or its spaces."""


def ale_game(env_id: str) -> str | None:
    """The ALE ROM name of an Atari id (`Pong-v5`, `ALE/Pong-v5`, `PongNoFrameskip-v4`, `Pong-v4`:
    `pong`), or None for a non-Atari id. Only the game name counts: frame skip, sticky actions and
    the like come from our flags, never from the suffix (`NoFrameskip` means nothing here)."""
    import ale_py

    gym.register_envs(ale_py)
    if ":" in env_id:  # "module:Name-v0" is always a user-registered Gymnasium env
        return None
    if env_id in gym.registry:
        spec = gym.registry[env_id]
        return spec.kwargs.get("game") if spec.entry_point == "ale_py.env:AtariEnv" else None
    m = re.fullmatch(r"(?:ALE/)?([A-Za-z0-9]+?)(?:NoFrameskip|Deterministic)?-v\d+", env_id)
    if m is None:
        raise EnvError(f"unknown environment id {env_id!r}: expected an Atari game such as "
                       "Pong-v5, a registered Gymnasium id, or 'module:Name-v0'")
    spec = gym.registry.get(f"ALE/{m.group(1)}-v5")
    if spec is None:
        raise EnvError(f"unknown Atari game {env_id!r}; list the valid names with: python -c "
                       "\"import ale_py.roms; print(ale_py.roms.get_all_rom_ids())\" "
                       "(ids are CamelCase, e.g. ms_pacman is MsPacman-v5)")
    return spec.kwargs["game"]


def env_seeds(seed: int, rank: int, num_envs: int, offset: int = 0) -> np.ndarray:
    """Distinct, repeatable seeds for each environment of each rank from `--seed`; `offset` (the
    step of a resume) gives fresh ones, so a resumed run does not replay the episodes it saw."""
    ss = np.random.SeedSequence([seed, rank, offset])
    return ss.generate_state(num_envs, dtype=np.uint32).astype(np.int64) % (2**31 - 1)


class Envs:
    """`num_envs` environments stepped together: `reset()`, then `send(actions)` / `recv()`. ALE's
    `send` returns at once (its C++ threads simulate meanwhile), so the alternating sampler infers
    for one group while another simulates. `self.episodes`: finished games (true return, length)."""

    def __init__(self, env_id: str, num_envs: int, *, episodic_life: bool = True,
                 sticky_actions: bool = False, num_threads: int = 0, fire_reset: bool = True,
                 max_episode_steps: int | None = None):
        self.num_envs = num_envs
        self.game = ale_game(env_id)
        self.fire = None  # index of FIRE in the action set, when it is pressed after a life loss
        if self.game is not None:
            from ale_py.vector_env import AtariVectorEnv

            # ale-py's `episodic_life=True` restarts the game at every life loss (later lives never
            # played, the score lost): take the life-loss signal and let the game run on instead.
            self.venv = AtariVectorEnv(
                self.game, num_envs, num_threads=num_threads, noop_max=30,
                use_fire_reset=fire_reset, episodic_life=False, life_loss_info=episodic_life,
                reward_clipping=False, repeat_action_probability=0.25 if sticky_actions else 0.0,
                autoreset_mode="SameStep",
                max_num_frames_per_episode=4 * max_episode_steps if max_episode_steps else 108_000)
            self.fire = fire_action(self.game) if fire_reset else None
        else:
            from gymnasium.vector import AutoresetMode

            limit = {"max_episode_steps": max_episode_steps} if max_episode_steps else {}
            try:
                self.venv = gym.make_vec(env_id, num_envs, vectorization_mode="sync",
                                         vector_kwargs={"autoreset_mode": AutoresetMode.SAME_STEP},
                                         **limit)
            except gym.error.Error as e:
                raise EnvError(f"cannot make environment {env_id!r}: {e}") from None
            obs_space, act_space = self.venv.single_observation_space, self.venv.single_action_space
            if not (isinstance(obs_space, gym.spaces.Box) and obs_space.shape == OBS_SHAPE
                    and obs_space.dtype == np.uint8):
                raise EnvError(f"{env_id!r} must have uint8 {OBS_SHAPE} observations, "
                               f"it has {obs_space}")
            if not isinstance(act_space, gym.spaces.Discrete):
                raise EnvError(f"{env_id!r} must have a discrete action space, it has {act_space}")
        self.num_actions = int(self.venv.single_action_space.n)
        self.episodes: list[tuple[float, int]] = []
        self._return = np.zeros(num_envs, np.float64)
        self._length = np.zeros(num_envs, np.int64)
        self._lives = np.zeros(num_envs, np.int64)
        self._fire_next = np.zeros(num_envs, bool)  # lost a life on the last step
        self.game_over = np.zeros(num_envs, bool)  # games that ended on the last step

    def reset(self, seeds: np.ndarray) -> np.ndarray:
        """Reset environment i with seeds[i]; returns obs uint8 [n, 4, 84, 84]."""
        obs, info = self.venv.reset(seed=[int(s) for s in seeds] if self.game is None else seeds)
        self._return[:] = 0
        self._length[:] = 0
        self._lives[:] = info.get("lives", 0)
        self._fire_next[:] = False
        return obs

    def send(self, actions: np.ndarray) -> None:
        if self._fire_next.any():  # rare: only on the step after a lost life (docs/internals.md)
            actions = np.where(self._fire_next, self.fire, actions)
        if self.game is not None:
            self.venv.send(actions)
        else:  # Gymnasium's sync vector env has no asynchronous half: step at recv time
            self._actions = actions

    def recv(self):
        """obs, raw reward, terminated, truncated, final_obs (numpy arrays); final_obs uint8
        [k = truncated.sum(), 4, 84, 84]: each truncated env's last observation, in index order."""
        if self.game is not None:
            obs, reward, terminated, truncated, info = self.venv.recv()
            lives = info["lives"].astype(np.int64)
            # A life loss leaves the game running with one life fewer; a game over resets it to a
            # full set of lives (or 0 == 0 for games without lives).
            game_over = truncated | (terminated & (lives >= self._lives))
            if self.fire is not None:
                self._fire_next = (lives < self._lives) & ~game_over
            self._lives = lives
            final_obs = info["final_obs"][truncated] if truncated.any() else None
        else:
            obs, reward, terminated, truncated, info = self.venv.step(self._actions)
            game_over = terminated | truncated
            final_obs = np.stack(info["final_obs"][truncated]) if truncated.any() else None
        self._return += reward
        self._length += 1
        self.game_over = game_over
        if game_over.any():  # rare per step: skip the bookkeeping otherwise (the hot path)
            for i in np.flatnonzero(game_over):
                self.episodes.append((float(self._return[i]), int(self._length[i])))
            self._return[game_over] = 0
            self._length[game_over] = 0
        return obs, reward, terminated, truncated, final_obs

    def close(self) -> None:
        self.venv.close()


def fire_action(game: str) -> int | None:
    """The index of FIRE in the game's (minimal) action set, or None if it has no FIRE."""
    import ale_py
    from ale_py import roms

    ale = ale_py.ALEInterface()
    ale.setLoggerMode(ale_py.LoggerMode.Error)
    ale.loadROM(roms.get_rom_path(game))
    actions = list(ale.getMinimalActionSet())
    return actions.index(ale_py.Action.FIRE) if ale_py.Action.FIRE in actions else None


def num_actions(env_id: str) -> int:
    """The game's number of actions, from one environment (EnvError for an id that is none)."""
    one = make_envs(env_id, 1)[0]
    one.close()
    return one.num_actions


def make_envs(env_id: str, num_envs: int, *, groups: int = 1, episodic_life: bool = True,
              sticky_actions: bool = False, num_threads: int = 0, fire_reset: bool = True,
              max_episode_steps: int | None = None) -> list[Envs]:
    """A rank's `num_envs` environments in `groups` equal groups (2 for the alternating sampler);
    seeded at reset per environment index, so grouped and ungrouped runs see the same episodes."""
    n = num_envs // groups
    if num_threads == 0:
        # Paper's CPU budget: the machine's cores are shared by the ranks on it. Groups alternate,
        # so each may use all of its rank's cores.
        local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
        num_threads = max(1, min(n, (os.cpu_count() or 1) // local_ranks))
    return [Envs(env_id, n, episodic_life=episodic_life, sticky_actions=sticky_actions,
                 num_threads=num_threads, fire_reset=fire_reset,
                 max_episode_steps=max_episode_steps) for g in range(groups)]
