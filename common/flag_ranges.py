"""The allowed values of every numeric flag of the scripts and the benchmarks, in one table.

A value outside its range is refused before anything is created (cli.parse_args; the
benchmarks' errors.checked), in one line naming the flag, the value and the range, exit 2.
tests/test_flags.py keeps every numeric field of every Args in RANGES (or in FREE) and tries a
value outside each range. Plain Python: plot.py uses it without loading torch.
"""

from __future__ import annotations

import dataclasses
import math

POSITIVE, NONNEG, UNIT = "(0, inf)", "[0, inf)", "[0, 1]"
# The allowed values of every numeric flag of the scripts and the benchmarks, by field name
# (a tuple's every element): out_of_range refuses the rest before anything is created, and
# tests/test_flags.py keeps every numeric field of every Args in this table or in FREE.
RANGES = {
    # how long, how many, how often
    "total_timesteps": POSITIVE, "num_envs": POSITIVE, "num_steps": POSITIVE,
    "checkpoint_interval": NONNEG, "checkpoint_minutes": NONNEG, "keep_checkpoints": NONNEG,
    "collective_timeout": POSITIVE, "eval_interval": NONNEG, "eval_envs": POSITIVE,
    "eval_episodes": NONNEG, "eval_max_steps": POSITIVE, "seed": "[0, 4194304]",  # x 1000 + rank
    "num_minibatches": POSITIVE, "update_epochs": POSITIVE, "num_chunks": POSITIVE,
    "num_buffers": "[2, inf)", "sampler_cores": NONNEG, "max_policy_lag": NONNEG,
    "batch_size": POSITIVE, "replay_size": POSITIVE, "replay_ratio": POSITIVE,
    "learning_starts": NONNEG, "target_update_interval": POSITIVE, "n_step": POSITIVE,
    "eps_decay_steps": POSITIVE, "num_atoms": "[2, inf)",
    # the optimisation
    "learning_rate": POSITIVE, "adam_eps": POSITIVE, "rmsprop_alpha": "[0, 1)",
    "rmsprop_eps": POSITIVE, "max_grad_norm": NONNEG, "gamma": UNIT, "gae_lambda": UNIT,
    "clip_coef": POSITIVE, "ent_coef": NONNEG, "vf_coef": NONNEG, "target_kl": POSITIVE,
    "kl_threshold": POSITIVE,
    "imp_samp_max": NONNEG, "priority_alpha": UNIT, "priority_beta": UNIT,
    "eps_start": UNIT, "eps_end": UNIT, "eval_epsilon": UNIT, "epsilon": UNIT,
    # the benchmarks'
    "episodes": POSITIVE, "envs": POSITIVE, "parallel": POSITIVE, "ranks": POSITIVE,
    "seeds": "[0, 4194304]", "points": POSITIVE, "window": "[1, inf)", "seconds": POSITIVE,
    "e2e_seconds": POSITIVE, "stop_timeout": POSITIVE, "warmup": NONNEG, "cores": "[1, inf)",
    "envs_per_core": "[1, inf)", "minutes": POSITIVE, "torch_threads": NONNEG,
    "repeats": POSITIVE, "samples": POSITIVE, "a2c_num_envs": POSITIVE,
}
FREE = ("v_min", "v_max", "targets")  # any number (cat_dqn.py checks v_min < v_max)


def out_of_range(args, ranges: dict[str, str] | None = None, prefix: str = "") -> str | None:
    """The first numeric flag of `args` (a dataclass; nested ones are --<name>.<flag>) outside
    its range in RANGES, or in `ranges` (a script's own), as one line naming the flag, its
    value and the range; None when all are in range. None values (flags left unset) pass."""
    for f in dataclasses.fields(args):
        value, flag = getattr(args, f.name), f"--{prefix}{f.name.replace('_', '-')}"
        if dataclasses.is_dataclass(value):
            if problem := out_of_range(value, ranges, f"{prefix}{f.name}."):
                return problem
            continue
        interval = (ranges or {}).get(f.name, RANGES.get(f.name))
        values = value if isinstance(value, (tuple, list)) else (value,)  # args.json: lists
        if interval is None or value is None or all(_within(v, interval) for v in values):
            continue
        lo, hi = interval[1:-1].split(", ")
        allowed = ("positive" if interval == POSITIVE else f">= {lo}" if hi == "inf"
                   else f"in {interval}")
        shown = " ".join(map(str, values)) if isinstance(value, (tuple, list)) else value
        return f"{flag} must be {allowed}, got {shown}"
    return None


def _within(value: float, interval: str) -> bool:
    lo, hi = (float(x) for x in interval[1:-1].split(", "))
    return not math.isnan(value) and (lo <= value if interval[0] == "[" else lo < value) and (
        value <= hi if interval[-1] == "]" else value < hi)
