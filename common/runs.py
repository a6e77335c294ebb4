"""Run directories: where a run goes, and the directory a run starts or continues in.

How and why: docs/internals.md#commonrunspy.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import sys
import time
from dataclasses import asdict
from pathlib import Path

from common import dist
from common.checkpoint import checkpoints, load, newest_good, run_of, verify

LAUNCH_ONLY = ("run_dir", "resume", "cuda", "collective_timeout")  # never taken from args.json


def default_run_dir(env_id: str, script: str, seed: int) -> Path:
    env = re.sub(r"[^A-Za-z0-9_.-]", "_", env_id)
    return Path(f"runs/{env}__{script}__{seed}__{int(time.time())}")


def _elastic_run(env_id: str, script: str, seed: int) -> Path | None:
    """The directory a previous attempt of this torchrun job created (it wrote the run id)."""
    env = re.sub(r"[^A-Za-z0-9_.-]", "_", env_id)
    run_id = os.environ.get("TORCHELASTIC_RUN_ID")
    for d in sorted(Path("runs").glob(f"{env}__{script}__{seed}__*"), reverse=True):
        if (d / "torchrun_id").is_file() and (d / "torchrun_id").read_text() == run_id:
            return d
    return None


def locate(args, script: str) -> tuple[Path, Path | None]:
    """Rank 0: (run directory, checkpoint to resume or None). Raises with a one-line message."""
    restarted = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0)) > 0
    resume = args.resume or ("auto" if restarted else None)
    if args.resume == "auto" and not args.run_dir and not restarted:
        raise ValueError("--resume auto needs --run-dir: the default directory name holds the "
                         "start time, so a new launch cannot find the run to continue")
    if resume == "auto":
        run_dir = Path(args.run_dir) if args.run_dir else (
            restarted and _elastic_run(args.env_id, script, args.seed)
            or default_run_dir(args.env_id, script, args.seed))
        return run_dir, newest_good(run_dir) if run_dir.is_dir() else None
    if resume:
        path = Path(resume)
        if path.is_dir():
            if not checkpoints(path):
                raise FileNotFoundError(f"no checkpoint (step_*.pt) in {path}")
            ckpt = newest_good(path)
        elif path.is_file():
            if problem := verify(path):
                raise ValueError(f"cannot read checkpoint {path}: {problem}")
            ckpt = path
        else:
            raise FileNotFoundError(f"checkpoint not found: {resume}")
        run_dir = Path(args.run_dir) if args.run_dir else run_of(ckpt)
        if run_dir.resolve() != run_of(ckpt).resolve() and run_dir.exists():
            raise FileExistsError(f"run directory {run_dir} exists and is not the run of {ckpt}; "
                                  "a resume writes into its own run or a new directory")
        return run_dir, ckpt
    run_dir = Path(args.run_dir or default_run_dir(args.env_id, script, args.seed))
    if run_dir.exists():
        raise FileExistsError(f"run directory {run_dir} exists; pass --resume {run_dir} (or "
                              "--resume auto) to continue it, or choose another --run-dir")
    return run_dir, None


def saved_args(ckpt: Path | None) -> dict:
    """The flags of the run a checkpoint belongs to (its args.json), less the launch-only ones."""
    f = run_of(ckpt) / "args.json" if ckpt else None
    if f is None or not f.is_file():
        return {}
    return {k: v for k, v in json.loads(f.read_text()).items() if k not in LAUNCH_ONLY}


def continue_command(args) -> str:
    """The command that continues this run as it was launched: python, or torchrun with this
    launch's shape, the script, --resume and the launch-only flags that differ from defaults."""
    local, world = (int(os.environ.get(k, 1)) for k in ("LOCAL_WORLD_SIZE", "WORLD_SIZE"))
    if "LOCAL_WORLD_SIZE" not in os.environ:
        launcher = ["python"]
    elif world == local:
        launcher = ["torchrun", "--standalone", "--nproc_per_node", str(local)]
    else:  # run on each machine, as the launch was
        launcher = ["torchrun", "--nnodes", str(world // local), "--nproc_per_node", str(local),
                    "--rdzv-backend", "c10d", "--rdzv-endpoint", "HOST:PORT"]
    script = Path(sys.argv[0])
    try:
        script = script.resolve().relative_to(Path.cwd())
    except ValueError:
        pass
    flags = ["--resume", str(args.run_dir)] + ([] if args.cuda else ["--no-cuda"])
    if args.collective_timeout != 600.0:
        flags += ["--collective-timeout", f"{args.collective_timeout:g}"]
    return shlex.join([*launcher, str(script), *flags])


def prepare_run(args, script: str, world: dist.World, check=None) -> tuple[Path, dict | None]:
    """Create the run directory cli.parse_args chose; rank 0 loads the checkpoint to resume, and
    every rank receives it (or one error message): (run_dir, state or None). `check(state)`: the
    script's own reason to refuse a checkpoint, or None; asked before args.json is rewritten."""
    error, state, run_dir = None, None, Path(args.run_dir)
    if world.is_main:
        try:
            if args.resume:
                state = load(Path(args.resume))
                if state.get("script", script) != script:
                    raise ValueError(f"checkpoint {args.resume} was written by {state['script']}, "
                                     f"not {script}")
                if state.get("env_id") != args.env_id:
                    raise ValueError(f"checkpoint {args.resume} was trained on "
                                     f"{state.get('env_id')!r}, not {args.env_id!r}")
                if check and (problem := check(state)):
                    raise ValueError(problem)
                state["resumed_from"] = args.resume
            (run_dir / "checkpoints").mkdir(parents=True, exist_ok=True)
            for leftover in (run_dir / "checkpoints").glob("*.tmp"):  # a save that was cut short
                leftover.unlink()
            (run_dir / "args.json").write_text(json.dumps(asdict(args), indent=2, default=str))
            if "TORCHELASTIC_RUN_ID" in os.environ:  # lets a restarted group find this run
                (run_dir / "torchrun_id").write_text(os.environ["TORCHELASTIC_RUN_ID"])
        except (OSError, ValueError) as e:
            error = str(e)
    if error := dist.agree(error):
        dist.fail(error)
    return run_dir, dist.broadcast_object(state, world)
