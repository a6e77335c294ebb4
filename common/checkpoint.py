"""Run directories, atomic checkpoints, exact resume, and clean stops on SIGTERM / SIGINT.

A checkpoint holds whatever the script puts in its state dict (model, optimizer, step counters,
schedules) plus every rank's RNG states. It is written to a temporary file and renamed, so a
crash mid-write never leaves a corrupt newest checkpoint. Loading uses `weights_only=True`.

What a resume does not restore: the emulators' internal states (ale-py cannot save a vector env).
A resumed run resets its environments with fresh seeds derived from `--seed` and the step count,
so it is repeatable, but games in progress at the checkpoint are not finished.
"""

from __future__ import annotations

import json
import os
import random
import re
import signal
import sys
import time
from dataclasses import asdict
from pathlib import Path

import numpy as np
import torch

from common import dist

CKPT = re.compile(r"step_(\d+)\.pt")


def default_run_dir(env_id: str, script: str, seed: int) -> str:
    env = re.sub(r"[^A-Za-z0-9_.-]", "_", env_id)
    return f"runs/{env}__{script}__{seed}__{int(time.time())}"


def find_checkpoint(resume: str) -> Path:
    """A checkpoint file, or the newest one in a run directory (or in its checkpoints/)."""
    path = Path(resume)
    if path.is_dir():
        folder = path / "checkpoints" if (path / "checkpoints").is_dir() else path
        found = sorted(folder.glob("step_*.pt"), key=lambda p: int(CKPT.fullmatch(p.name).group(1))
                       if CKPT.fullmatch(p.name) else -1)
        if not found:
            raise FileNotFoundError(f"no checkpoint (step_*.pt) in {folder}")
        return found[-1]
    if not path.is_file():
        raise FileNotFoundError(f"checkpoint not found: {resume}")
    return path


def load(path: Path) -> dict:
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # truncated file, not a torch file, foreign pickle...
        first = next((ln.strip() for ln in str(e).splitlines() if ln.strip()), "")[:200]
        raise ValueError(f"cannot read checkpoint {path}: {type(e).__name__}: {first}") from None


def prepare_run(args, script: str, world: dist.World) -> tuple[Path, dict | None]:
    """Choose the run directory, refuse to overwrite one, and load the checkpoint to resume.

    Rank 0 decides and every rank follows, so an error stops all ranks with one message.
    Returns (run_dir, checkpoint state or None).
    """
    error, run_dir, state = None, None, None
    if world.is_main:
        try:
            if args.resume:
                ckpt_path = find_checkpoint(args.resume)
                state = load(ckpt_path)
                run_dir = Path(args.run_dir) if args.run_dir else ckpt_path.parent.parent
                if state.get("script", script) != script:
                    raise ValueError(f"checkpoint {ckpt_path} was written by {state['script']}, "
                                     f"not {script}")
                if state.get("env_id") != args.env_id:
                    raise ValueError(f"checkpoint {ckpt_path} was trained on "
                                     f"{state.get('env_id')!r}, not {args.env_id!r}")
            else:
                run_dir = Path(args.run_dir or default_run_dir(args.env_id, script, args.seed))
                if run_dir.exists():
                    raise FileExistsError(f"run directory {run_dir} exists; pass --resume "
                                          f"{run_dir} to continue it, or choose another --run-dir")
            (run_dir / "checkpoints").mkdir(parents=True, exist_ok=True)
            saved = {k: v for k, v in asdict(args).items()}
            (run_dir / "args.json").write_text(json.dumps(saved, indent=2, default=str))
        except (OSError, ValueError) as e:
            error = str(e)
    error = dist.agree(error)
    if error:
        dist.fail(error)
    run_dir = Path(dist.broadcast_object(str(run_dir), world))
    state = dist.broadcast_object(state, world)
    return run_dir, state


def rng_state() -> dict:
    _, key, pos, _, _ = np.random.get_state()
    state = {"torch": torch.get_rng_state(),  # tensors only, so weights_only=True can load them
             "numpy": torch.from_numpy(np.append(key, pos).astype(np.int64)),
             "python": torch.tensor(random.getstate()[1], dtype=torch.int64)}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    key = state["numpy"].numpy()
    np.random.set_state(("MT19937", key[:-1].astype(np.uint32), int(key[-1]), 0, 0.0))
    random.setstate((3, tuple(int(x) for x in state["python"]), None))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def save(run_dir: Path, state: dict, global_step: int, world: dist.World) -> Path:
    """Write `checkpoints/step_<global_step>.pt` atomically on rank 0, with every rank's RNGs.

    Called by all ranks together (the RNG states are gathered)."""
    rngs = dist.all_gather(rng_state())
    path = run_dir / "checkpoints" / f"step_{global_step}.pt"
    if world.is_main:
        tmp = path.with_suffix(".pt.tmp")
        torch.save({**state, "global_step": global_step, "rng": rngs}, tmp)
        os.replace(tmp, path)  # atomic on POSIX: readers see the old file or the new, never half
    return path


def restore(state: dict | None, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
            world: dist.World) -> tuple[int, int]:
    """Load model, optimizer and this rank's RNG states from a checkpoint made by a script's
    save(); returns (global_step, iteration), or (0, 0) with no checkpoint."""
    if state is None:
        return 0, 0
    try:
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
    except (KeyError, RuntimeError, ValueError) as e:
        dist.fail(f"checkpoint does not fit this model: {str(e).splitlines()[0]}")
    restore_rng(state, world)
    return state["global_step"], state["iteration"]


def restore_rng(state: dict, world: dist.World) -> None:
    """Each rank takes back its own RNG states (only when the world size is unchanged)."""
    rngs = state.get("rng", [])
    if len(rngs) == world.world_size:
        set_rng_state(rngs[world.rank])
    elif world.is_main:
        print(f"warning: checkpoint has RNG states for {len(rngs)} ranks, this run has "
              f"{world.world_size}; random streams restart", file=sys.stderr)


class StopRequest:
    """SIGTERM / SIGINT set a flag; the training loop checks it between iterations, all ranks
    agree (so a signal to one rank stops all), and the script checkpoints and exits cleanly."""

    def __init__(self):
        self.signal: int | None = None
        for s in (signal.SIGTERM, signal.SIGINT):
            signal.signal(s, self._handle)

    def _handle(self, signum, frame):
        self.signal = signum
        signal.signal(signum, signal.SIG_DFL)  # a second Ctrl-C kills at once

    def __call__(self, device: torch.device) -> bool:
        flag = torch.tensor([1.0 if self.signal else 0.0], device=device)
        return bool(dist.all_reduce_mean(flag).item() > 0)
