"""The one table of algorithm configurations the paper-reproduction benchmarks launch.

More: docs/benchmarks.md, `benchmarks/registry.py`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# How global_step (environment steps over all ranks, the x axis of every chart) advances.
ITERATION = {
    "rollout": "each rank steps num_envs x num_steps, then all take one synchronous update (A3C: "
               "each its own, on central parameters): global_step += ranks x num_envs x num_steps",
    "replay": "each rank steps num_envs x num_steps into its replay shard, then all take "
              "replay_ratio x steps / (batch_size x ranks) synchronous updates, none before "
              "learning_starts (asynchronous DQN: each its own, on central parameters): "
              "global_step += ranks x num_envs x num_steps",
    "async": "each rank's sampler process runs ahead into shared buffers; global_step counts "
             "the steps trained on: += ranks x num_envs x num_steps per rollout consumed",
}

_PG_SMOKE = ("--num-envs", "4", "--num-steps", "16", "--num-minibatches", "2",
             "--update-epochs", "2", "--total-timesteps", "512")
_A2C_SMOKE = ("--num-envs", "4", "--total-timesteps", "4096")  # logs every ~2,048 steps per rank
_Q_SMOKE = ("--num-envs", "4", "--num-steps", "4", "--learning-starts", "1024",
            "--replay-size", "8192", "--replay-ratio", "1", "--target-update-interval", "1024",
            "--eps-decay-steps", "2048", "--eval-interval", "0", "--total-timesteps", "4096")
_Q_CPU = ("--replay-size", "100000", "--learning-starts", "5000")


@dataclass(frozen=True)
class Algo:
    script: str
    kind: str
    flags: tuple[str, ...] = ()
    scale: tuple[str, ...] = ()
    cpu: tuple[str, ...] = ()
    smoke: tuple[str, ...] = ()
    paper_hours: tuple[float | None, ...] = (None, None, None, None)
    paper_median: float | None = None


ALGOS = {  # one line per configuration, in the order of the paper's Table 2
    "a2c": Algo("a2c_multigpu", "rollout", (), (), (), _A2C_SMOKE, (3.8, 2.2, 1.2, 0.59), 0.65),
    "ppo": Algo("ppo_multigpu", "rollout", (), (), (), _PG_SMOKE, (4.4, 2.6, 1.5, 1.1), 1.2),
    "a3c": Algo("a2c_multigpu", "rollout", ("--asynchronous",), (), (), _A2C_SMOKE,
                (None, 2.4, 1.3, 0.65)),
    "appo": Algo("appo_async", "async", (), (), (), _PG_SMOKE, (None, 2.8, 1.5, 0.71)),
    "dqn-512": Algo("dqn_multigpu", "replay", ("--preset", "dqn-512"), ("--eval-interval", "0"),
                    _Q_CPU, _Q_SMOKE, (8.3, 4.8, 3.1, 2.6), 1.4),
    "dqn-512-async": Algo("dqn_multigpu", "replay", ("--preset", "dqn-512", "--asynchronous"),
                          ("--eval-interval", "0"), _Q_CPU, _Q_SMOKE, (None, None, 3.9, None)),
    "eps-rainbow-512": Algo("dqn_multigpu", "replay", ("--preset", "eps-rainbow-512"),
                            ("--eval-interval", "0"), _Q_CPU, _Q_SMOKE, (14.1, 8.6, 6.6, 6.4), 2.5),
    "catdqn-2048": Algo("cat_dqn", "replay", ("--preset", "catdqn-2k"), ("--eval-interval", "0"),
                        _Q_CPU, _Q_SMOKE, (10.7, 6.0, 2.8, 1.8), 2.9),
}
PAPER_RANKS = (1, 2, 4, 8)  # the columns of paper_hours


def script_path(algo: Algo) -> Path:
    return ROOT / "algos" / f"{algo.script}.py"


def missing_note(name: str) -> str | None:
    """A one-line note when the configuration's script is not on disk, else None."""
    algo = ALGOS[name]
    if script_path(algo).is_file():
        return None
    return f"note: skipping {name}: algos/{algo.script}.py does not exist"


def warm_steps(algo: Algo, run_args: dict) -> int:
    """Global steps before a run does what it does in steady state (replay: learning starts)."""
    return int(run_args.get("learning_starts", 0)) if algo.kind == "replay" else 0


def steps_per_iteration(algo: Algo, run_args: dict, ranks: int) -> int:
    """Global steps per iteration, from a run's resolved flags (args.json): see ITERATION."""
    return ranks * int(run_args["num_envs"]) * int(run_args.get("num_steps", 1))


def check_names(names, what: str = "configuration") -> str | None:
    """A one-line error for names that are not in ALGOS, else None."""
    bad = [n for n in names if n not in ALGOS]
    if bad:
        return f"unknown {what} {', '.join(map(repr, bad))}; choose from {', '.join(ALGOS)}"
    return None
