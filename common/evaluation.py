"""Evaluation: whole games on separate environments, scored as the literature scores them.

How and why: docs/internals.md#commonevaluationpy.
"""

from __future__ import annotations

import numpy as np
import torch

from common import dist, envs


def make_envs(args) -> envs.Envs | None:
    """The evaluation environments of one rank (`--eval-envs`), or None with `--eval-episodes 0`.
    Same game settings as training, except that a lost life never ends the episode."""
    if args.eval_episodes <= 0:
        return None
    return envs.make_envs(args.env_id, min(args.eval_envs, args.eval_episodes), episodic_life=False,
                          sticky_actions=args.sticky_actions, fire_reset=args.fire_reset,
                          max_episode_steps=args.eval_max_steps)[0]


def probe(args) -> tuple[int, envs.Envs | None]:
    """(the game's number of actions, from one environment, and the rank's evaluation
    environments, or None): a script checks its game with this before it writes anything, and a
    bad one ends the run in one line."""
    try:
        return envs.num_actions(args.env_id), make_envs(args)
    except envs.EnvError as e:
        dist.fail(str(e))


@torch.no_grad()
def play(policy, env: envs.Envs, episodes: int, seeds: np.ndarray,
         device: torch.device) -> tuple[list[float], list[int]]:
    """Play `episodes` whole games (env j: games j, j + n, ...); (returns, lengths) in game order.
    policy(obs uint8 [n, 4, 84, 84] on device) -> actions [n]."""
    n = env.num_envs
    quota = [episodes // n + (j < episodes % n) for j in range(n)]
    games: list[list[tuple[float, int]]] = [[] for _ in range(n)]
    obs = env.reset(seeds)
    env.episodes.clear()
    while any(len(g) < q for g, q in zip(games, quota)):
        env.send(policy(torch.from_numpy(obs).to(device)).cpu().numpy())
        obs = env.recv()[0]
        done = np.flatnonzero(env.game_over)
        if len(done):  # Envs appends finished games in index order, one per game over
            for j, game in zip(done, env.episodes[-len(done):]):
                if len(games[j]) < quota[j]:
                    games[j].append(game)
            env.episodes.clear()
    order = [games[j][k] for k in range(max(quota)) for j in range(n) if k < len(games[j])]
    return [r for r, _ in order], [length for _, length in order]


def evaluate(policy, env: envs.Envs, args, world: dist.World, global_step: int) -> dict:
    """Every rank plays `--eval-episodes` games; returns all ranks' games (called by all ranks)
    as {"returns", "lengths", "mean_return", "episodes"}."""
    seeds = envs.env_seeds(args.seed + 10**6, world.rank, env.num_envs, offset=global_step)
    returns, lengths = play(policy, env, args.eval_episodes, seeds, world.device)
    gathered = dist.all_gather((returns, lengths))
    returns = [r for rs, _ in gathered for r in rs]
    lengths = [n for _, ns in gathered for n in ns]
    return {"returns": returns, "lengths": lengths, "episodes": len(returns),
            "mean_return": sum(returns) / len(returns) if returns else None}
