"""Verified atomic checkpoints and exact resume.

How and why: docs/internals.md#commoncheckpointpy.
"""

from __future__ import annotations

import hashlib
import os
import random
import re
import sys
from pathlib import Path

import numpy as np
import torch

from common import dist

CKPT = re.compile(r"step_(\d+)\.pt")


def step_of(ckpt: Path) -> int | None:
    """The global step in a checkpoint's name (step_<N>.pt), or None."""
    m = CKPT.fullmatch(ckpt.name)
    return int(m.group(1)) if m else None


def run_of(ckpt: Path) -> Path:
    return ckpt.parent.parent if ckpt.parent.name == "checkpoints" else ckpt.parent


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            h.update(chunk)
    return h.hexdigest()


def verify(path: Path) -> str | None:
    """Why the file cannot be trusted, or None."""
    digest = path.with_name(path.name + ".sha256")
    if not path.is_file() or path.stat().st_size == 0:
        return "empty or missing"
    if digest.is_file():
        return None if _sha256(path) == digest.read_text().strip() else "checksum mismatch"
    try:  # written without a checksum (by hand, or an older accelrl): at least it must open
        torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        return None
    except Exception as e:
        return f"unreadable ({type(e).__name__})"


def checkpoints(folder: Path) -> list[Path]:
    """The step_<N>.pt files of a run (or checkpoints/ folder), oldest first."""
    folder = folder / "checkpoints" if (folder / "checkpoints").is_dir() else folder
    return sorted((p for p in folder.glob("step_*.pt") if CKPT.fullmatch(p.name)),
                  key=lambda p: int(CKPT.fullmatch(p.name).group(1)))


def newest_good(folder: Path) -> Path | None:
    """The newest checkpoint that passes its checksum (a damaged newer one: a warning, skipped)."""
    found = checkpoints(folder)
    for path in reversed(found):
        if (problem := verify(path)) is None:
            return path
        print(f"warning: skipping checkpoint {path}: {problem}", file=sys.stderr, flush=True)
    if found:
        raise ValueError(f"cannot read checkpoint {found[-1]} nor any earlier one in {folder}")
    return None


def load(path: Path) -> dict:
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # truncated file, not a torch file, foreign pickle...
        first = next((ln.strip() for ln in str(e).splitlines() if ln.strip()), "")[:200]
        raise ValueError(f"cannot read checkpoint {path}: {type(e).__name__}: {first}") from None


def rng_state(device: torch.device) -> dict:
    """This rank's RNG states; the GPU's only for a run on one (asking would open a context)."""
    _, key, pos, _, _ = np.random.get_state()
    state = {"torch": torch.get_rng_state(),  # tensors only, so weights_only=True can load them
             "numpy": torch.from_numpy(np.append(key, pos).astype(np.int64)),
             "python": torch.tensor(random.getstate()[1], dtype=torch.int64)}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def set_rng_state(state: dict, device: torch.device) -> None:
    torch.set_rng_state(state["torch"])
    key = state["numpy"].numpy()
    np.random.set_state(("MT19937", key[:-1].astype(np.uint32), int(key[-1]), 0, 0.0))
    random.setstate((3, tuple(int(x) for x in state["python"]), None))
    if "cuda" in state and device.type == "cuda":  # a GPU run resumed on the CPU skips it
        torch.cuda.set_rng_state(state["cuda"], device)


def _write(obj, path: Path) -> None:
    tmp = path.with_name(path.name + ".tmp")
    try:
        with open(tmp, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        digest = path.with_name(path.name + ".sha256")
        digest.with_name(digest.name + ".tmp").write_text(_sha256(tmp))
        os.replace(digest.with_name(digest.name + ".tmp"), digest)
        os.replace(tmp, path)  # atomic on POSIX: readers see the old file or the new, never half
    except BaseException:
        for leftover in (tmp, path.with_name(path.name + ".sha256.tmp")):
            leftover.unlink(missing_ok=True)
        raise


def _prune(folder: Path, keep: int, mine: re.Pattern) -> None:
    """Delete this writer's files of all but the newest `keep` steps (0 keeps everything)."""
    steps = sorted({int(m.group(1)) for p in folder.iterdir() if (m := mine.fullmatch(p.name))})
    for step in steps[:-keep] if keep else []:
        for p in folder.iterdir():
            m = mine.fullmatch(p.name)
            if m and int(m.group(1)) == step:
                p.unlink(missing_ok=True)
                p.with_name(p.name + ".sha256").unlink(missing_ok=True)


def save(run_dir: Path, world: dist.World, global_step: int, keep: int, state: dict,
         rank_state: dict | None = None) -> Path:
    """Write `step_<global_step>.pt` (rank 0) and each rank's `rank_state` (if given), then prune;
    called by all ranks. A failed write (a full disk) ends the run on every rank with one line."""
    folder = run_dir / "checkpoints"
    path = folder / f"step_{global_step}.pt"
    error = None
    if rank_state is not None:
        try:
            _write(rank_state, folder / f"step_{global_step}.rank{world.rank}.pt")
        except OSError as e:
            error = f"rank {world.rank}: {e}"
    gathered = dist.all_gather((rng_state(world.device), error), io=True)  # all shards written
    errors = [e for _, e in gathered if e]
    if world.is_main and not errors:
        try:
            _write({**state, "global_step": global_step, "rng": [r for r, _ in gathered]}, path)
        except OSError as e:
            errors.append(str(e))
    if message := dist.agree("; ".join(errors) or None, io=True):  # rank 0 wrote the state
        previous = [p.name for p in checkpoints(folder) if p != path]
        kept = (f"the previous checkpoint {previous[-1]} is intact" if previous
                else "no earlier checkpoint exists")
        dist.fail(f"cannot write checkpoint {path}: {message}; {kept}", code=1)
    if rank_state is not None:
        _prune(folder, keep, re.compile(rf"step_(\d+)\.rank{world.rank}\.pt"))
    if world.is_main:
        _prune(folder, keep, CKPT)
    return path


def load_rank_state(run_dir: Path, global_step: int, world: dist.World) -> dict | None:
    """This rank's own part of the checkpoint at `global_step`, or None (with a warning) when it
    is missing, damaged, or was written by a run with another number of ranks."""
    path = run_dir / "checkpoints" / f"step_{global_step}.rank{world.rank}.pt"
    other = run_dir / "checkpoints" / f"step_{global_step}.rank{world.world_size}.pt"
    if problem := verify(path) or ("written by more ranks" if other.exists() else None):
        print(f"warning: rank {world.rank}: not using {path}: {problem}", file=sys.stderr,
              flush=True)
        return None
    return load(path)


def restore(state: dict | None, world: dist.World, **objects) -> int:
    """`load_state_dict` for each keyword object (model=, optimizer=...) from its entry, and this
    rank's RNG states; returns the global step (0 without a checkpoint). Optimizers keep this
    launch's hyperparameters (lr, eps...): only their statistics return."""
    if state is None:
        return 0
    for name, obj in objects.items():
        load_into(obj, state.get(name))
    restore_rng(state, world)
    if world.is_main:  # the fingerprint ties a log to the weights it continued from
        print(f"resumed from {state.get('resumed_from')} at step {state['global_step']:,} "
              f"(model {fingerprint(objects['model'].state_dict())})", flush=True)
    return state["global_step"]


def load_into(obj, state_dict: dict | None) -> None:
    """`obj.load_state_dict(state_dict)`, or one line and exit 2 when it does not fit. An optimizer
    keeps this launch's hyperparameters (lr, eps...): only its statistics return."""
    try:
        if state_dict is None:
            raise KeyError("no entry for it")
        launch = obj.param_groups if isinstance(obj, torch.optim.Optimizer) else []
        launch = [{k: v for k, v in g.items() if k != "params"} for g in launch]
        obj.load_state_dict(state_dict)
        for group, flags in zip(obj.param_groups if launch else [], launch):
            group.update(flags)
    except (KeyError, RuntimeError, ValueError) as e:
        dist.fail(f"checkpoint does not fit this model: {str(e).splitlines()[0]}")


def fingerprint(state_dict: dict) -> str:
    """A short hash of a model's tensors, to compare weights across logs and files."""
    h = hashlib.sha256()
    for k, v in state_dict.items():
        h.update(k.encode())
        h.update(v.detach().cpu().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:12]


def restore_rng(state: dict, world: dist.World) -> None:
    """Each rank takes back its own RNG states (only when the world size is unchanged)."""
    rngs = state.get("rng", [])
    if len(rngs) == world.world_size:
        set_rng_state(rngs[world.rank], world.device)
    elif world.is_main:
        print(f"warning: checkpoint has RNG states for {len(rngs)} ranks, this run has "
              f"{world.world_size}; random streams restart", file=sys.stderr)
