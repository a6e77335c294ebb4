"""The DQN family's replay shard (dqn_multigpu.py, cat_dqn.py): each rank's part of --replay-size,
sized and checked against its device's memory, restored from a checkpoint or refilled, and the
number of updates the replay ratio asks for."""

from __future__ import annotations

import os
import sys
from typing import Callable

import torch

from common import checkpoint, dist
from common.replay import Replay


def _free_bytes(device: torch.device) -> int:
    """Memory a new allocation can take: the GPU's free memory, or MemAvailable over local ranks."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    with open("/proc/meminfo") as f:
        kib = next(int(ln.split()[1]) for ln in f if ln.startswith("MemAvailable:"))
    return kib * 1024 // int(os.environ.get("LOCAL_WORLD_SIZE", 1))


def make(args, world) -> Callable[[], Replay]:
    """A maker of this rank's shard of --replay-size (on its device, or the CPU with --replay-device
    cpu); says its size, and refuses in one line one that does not fit (1M takes 7.1 GB)."""
    rows = args.replay_size // world.world_size // args.num_envs
    if rows < args.num_steps + args.n_step + 5:
        dist.fail(f"--replay-size {args.replay_size} gives {rows} transitions per environment "
                  f"on each of {world.world_size} ranks; need at least --num-steps + --n-step + 5 "
                  f"= {args.num_steps + args.n_step + 5}")
    device = world.device if args.replay_device == "auto" else torch.device("cpu")
    n = rows * args.num_envs
    need = n * (84 * 84 + 2 + 4 + 1 + 4) + (16 << max(1, (n - 1).bit_length()) if
                                            args.prioritized else 0)
    free = _free_bytes(device)
    error = None if need < free else (
        f"the replay shard of {n:,} transitions needs {need / 1e9:.2f} GB on {device}, which has "
        f"{free / 1e9:.2f} GB free: lower --replay-size (now {args.replay_size:,} over all ranks)")
    if error := dist.agree(error):
        dist.fail(error)
    if world.is_main:
        print(f"replay: {n:,} transitions per rank ({need / 1e9:.2f} GB on {device})", flush=True)
    return lambda: Replay(n, args.num_envs, device, n_step=args.n_step, gamma=args.gamma,
                          prioritized=args.prioritized, alpha=args.priority_alpha)


def restore_or_refill(new_replay: Callable[[], Replay], state: dict | None, run_dir, world,
                      args, counters: dict) -> Replay:
    """This rank's replay: fresh, or the saved shard of a resumed run (--save-replay). When any
    rank lacks its shard, every rank starts afresh and learns only after --learning-starts more
    steps: all ranks must take the same updates."""
    replay = new_replay()
    if state is None:
        return replay
    loaded = False
    shard = checkpoint.load_rank_state(run_dir, state["global_step"], world) \
        if args.save_replay else None
    try:
        loaded = shard is not None and replay.load_state_dict(shard["replay"]) is None
    except (ValueError, KeyError) as e:
        print(f"warning: rank {world.rank}: {e}", file=sys.stderr, flush=True)
    if dist.all_reduce_mean(torch.tensor([float(loaded)], device=world.device)).item() < 1:
        replay = new_replay() if loaded else replay
        counters["learn_from"] = state["global_step"] + args.learning_starts
        if world.is_main:
            print(f"replay not restored: refilling it for {args.learning_starts:,} steps "
                  "before learning again", flush=True)
    return replay


def counters(args, state: dict | None) -> dict:
    """The replay schedule's counters, continued from a checkpoint: updates taken, the fraction
    of an update owed (`credit`), the step learning starts at, steps generated while learning."""
    out = {"updates": 0, "credit": 0.0, "learn_from": args.learning_starts, "generated": 0}
    return {**out, **state["counters"]} if state is not None else out


def ratio(counters: dict, args, world_size: int) -> float:
    """Samples replayed per sample generated so far (charts/replay_ratio)."""
    return counters["updates"] * args.batch_size * world_size / max(counters["generated"], 1)


def updates_due(counters: dict, args, global_batch: int, world_size: int) -> int:
    """Updates to take after `global_batch` new steps: replay_ratio x steps / (batch x ranks),
    the fraction carried in counters["credit"], so samples replayed / samples generated is
    exactly --replay-ratio whatever the batch or world size (logged as charts/replay_ratio)."""
    counters["generated"] += global_batch
    counters["credit"] += args.replay_ratio * global_batch / (args.batch_size * world_size)
    due = int(counters["credit"])
    counters["credit"] -= due
    counters["updates"] += due
    return due
