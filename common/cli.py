"""Command line: tyro parsing, resume defaults, and the checks every script's shared flags need.

Every problem a user can cause here ends in one line from rank 0 and exit code 2, before any
process group, environment or run directory exists, so nothing can hang or be left behind.
"""

from __future__ import annotations

import json
from dataclasses import fields
from pathlib import Path

import tyro

from common import dist, envs


def parse_args(cls, argv: list[str] | None = None):
    """Parse `cls` (a dataclass) with tyro and check the shared flags.

    With `--resume`, the run's saved flags (args.json) are the defaults and the command line
    overrides them, so `--resume RUN_DIR` alone continues the run as it was launched.
    """
    args = tyro.cli(cls, args=argv)
    if args.resume:
        path = Path(args.resume)
        saved = (path if path.is_dir() else path.parent.parent) / "args.json"
        if saved.is_file():
            known = {f.name for f in fields(cls)}
            old = {k: v for k, v in json.loads(saved.read_text()).items() if k in known}
            old["resume"] = args.resume
            args = tyro.cli(cls, args=argv, default=cls(**old))
    for name in ("total_timesteps", "num_envs", "num_steps"):
        if getattr(args, name) <= 0:
            dist.fail(f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}")
    if args.checkpoint_interval < 0:
        dist.fail(f"--checkpoint-interval must be >= 0, got {args.checkpoint_interval}")
    if args.alternate and args.num_envs % 2:
        dist.fail(f"--alternate splits the environments in two halves: --num-envs must be even, "
                  f"got {args.num_envs}")
    try:
        envs.ale_game(args.env_id)
    except envs.EnvError as e:
        dist.fail(str(e))
    return args
