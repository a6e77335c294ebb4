"""Command line: tyro parsing, the run to start or continue, and the checks every script's shared
flags need. Every problem a user can cause here ends in one line from rank 0 and exit code 2 on
every rank, before any environment or run directory exists, so nothing can hang or be left
behind.
"""

from __future__ import annotations

import difflib
import os
import sys
from pathlib import Path

import tyro

from common import checkpoint, dist, envs, runs
from common.flag_ranges import POSITIVE, out_of_range  # noqa: F401  # POSITIVE: scripts' own ranges


def parse_args(cls, argv: list[str] | None = None, presets: dict[str, dict] | None = None,
               ranges: dict[str, str] | None = None):
    """Parse `cls` (a dataclass) with tyro, join the process group and check the shared flags;
    returns (args, world). Rank 0 chooses the run (`runs.locate`) and sends every rank the
    saved flags (args.json) of a run it continues: they become the defaults, which the command
    line overrides, so `--resume RUN_DIR` alone continues the run as it was launched. On return
    `args.run_dir` is the run directory and `args.resume` the checkpoint file to load (or None).
    `presets`: the values each `--preset` name stands for (the DQN family's configurations);
    `ranges`: the script's own allowed values where they differ from common.flag_ranges's."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if problem := unknown_flag(cls, argv):
        dist.fail(problem)
    if presets:
        argv = _with_preset(cls, argv, presets)
    args = tyro.cli(cls, args=argv)
    world = dist.setup(args.cuda, args.collective_timeout, args.backend, args.torch_deterministic)
    script = Path(sys.modules[cls.__module__].__file__).stem
    found, error = None, None
    if world.is_main:
        try:
            run_dir, ckpt = runs.locate(args, script)
            found = (str(run_dir), str(ckpt) if ckpt else None, runs.saved_args(ckpt))
        except (OSError, ValueError) as e:
            error = str(e)
    if error := dist.agree(error):
        dist.fail(error)
    run_dir, ckpt, saved = dist.broadcast_object(found, world)
    if saved:
        known = {k: tuple(v) if isinstance(v, list) else v  # JSON kept tuples as lists
                 for k, v in saved.items() if k in cls.__dataclass_fields__}
        args = tyro.cli(cls, args=argv, default=cls(**{**known, "resume": args.resume}))
    args.run_dir, args.resume = run_dir, ckpt
    done = checkpoint.step_of(Path(ckpt)) if ckpt else None
    if done is not None and done >= args.total_timesteps:  # nothing left: the run stays as it is
        if world.is_main:
            print(f"run {run_dir} already finished at step {done:,} (--total-timesteps "
                  f"{args.total_timesteps:,}); nothing to do. Pass a larger --total-timesteps to "
                  "train on", flush=True)
        dist.finish(0)
        sys.exit(0)  # without a group finish() returns
    cores = os.cpu_count() or 1
    local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    if world.device.type == "cpu" and local_ranks > cores and world.local_rank == 0:
        print(f"warning: {local_ranks} CPU ranks on {cores} cores: they will take turns on the "
              "cores (each rank also runs emulator threads); use --nproc_per_node <= cores",
              file=sys.stderr, flush=True)

    if problem := out_of_range(args, ranges):
        dist.fail(problem)
    if args.track:
        try:
            import wandb  # noqa: F401
        except ImportError:
            dist.fail("--track sends the run to Weights & Biases, which is not installed: "
                      "pip install wandb")
    if getattr(args, "alternate", False) and args.num_envs % 2:
        dist.fail(f"--alternate splits the environments in two halves: --num-envs must be even, "
                  f"got {args.num_envs}")
    try:
        game = envs.ale_game(args.env_id)
    except envs.EnvError as e:
        dist.fail(str(e))
    if args.capture_video and (game is None or args.eval_episodes <= 0):
        dist.fail(f"--capture-video records evaluation games of Atari: {args.env_id} is not one"
                  if game is None else "--capture-video records evaluation games: give "
                  "--eval-episodes > 0")
    return args, world


def unknown_flag(cls, argv: list[str]) -> str | None:
    """The first flag of argv that `cls` does not have, with the flags it may stand for: those
    whose words' initials it is (--lr: --learning-rate) or that it begins, else the closest."""
    names = [f.replace("_", "-") for f in cls.__dataclass_fields__]
    known = {"help", *names, *(f"no-{n}" for n in names)}
    for arg in argv:
        if not arg.startswith("--") or arg == "--":
            continue
        flag = arg[2:].split("=", 1)[0]
        if flag in known:
            continue
        guess = [n for n in names if "".join(w[0] for w in n.split("-")) == flag
                 or n.startswith(flag)] or difflib.get_close_matches(flag, names, n=3, cutoff=0.6)
        return f"unknown flag --{flag}" + (
            f"; did you mean {' or '.join('--' + g for g in guess)}?" if guess else
            "; --help lists the flags")
    return None


def _with_preset(cls, argv: list[str], presets: dict[str, dict]) -> list[str]:
    """The chosen preset's values as flags in front of the command line, where later flags win.
    `--resume RUN` keeps the run's own resolved flags (args.json) instead; `--resume auto` and
    torchrun restarts repeat the first launch's command line, so they resolve the same way."""
    first = tyro.cli(cls, args=argv)
    if first.resume and first.resume != "auto":
        if any(a == "--preset" or a.startswith("--preset=") for a in argv):
            dist.fail("--preset does not apply to --resume RUN, which keeps the run's own flags; "
                      "pass the flags to change instead")
        return argv
    flags = []
    for name, value in presets[first.preset].items():
        flag = "--" + name.replace("_", "-")
        if isinstance(value, bool):
            flags.append(flag if value else "--no-" + flag[2:])
        else:
            flags += [flag, repr(value) if isinstance(value, float) else str(value)]
    return flags + argv

