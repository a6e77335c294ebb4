"""Distributed set-up: one process per GPU, launched by torchrun (or plain python: a world of one).

How and why: docs/internals.md#commondistpy.
"""
from __future__ import annotations

import atexit
import datetime
import functools
import multiprocessing
import os
import socket
import sys
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from common import gpu
from common.gpu import clock, set_gpu_habits

if dist.is_available():
    # Now, before any group exists: its collectives' default `group=group.WORLD`, evaluated on
    # import (torch._dynamo imports it with an optimizer), is then None, not a group held for
    # good whose threads would outlive destroy_process_group() until the interpreter's teardown.
    import torch.distributed.nn.functional  # noqa: F401


@dataclass
class World:
    rank: int
    local_rank: int
    world_size: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0


IO_GRACE = 3600.0  # extra seconds a rank waits for another's checkpoint write


def setup(cuda: bool, timeout: float = 600.0, backend: str = "auto",
          deterministic: bool = False) -> World:
    """Join torchrun's group (RANK, LOCAL_RANK, WORLD_SIZE; any number of machines) on this rank's
    device. `timeout`: seconds a collective waits; `backend`: auto (NCCL on GPUs, else gloo);
    `deterministic`: --torch-deterministic (common/gpu.py)."""
    global _timeout, _made_group, _io_group
    rank = int(os.environ.get("RANK", 0))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    device = pick_device(cuda, local_rank, backend)
    if device.type == "cuda":
        torch.cuda.set_device(device)  # before NCCL init, so each rank owns its own GPU
        set_gpu_habits()
    if deterministic:
        gpu.deterministic()
    torch.distributions.Distribution.set_default_validate_args(False)  # a host sync per check
    if "RANK" in os.environ and not dist.is_initialized():
        nccl = device.type == "cuda" and backend != "gloo"
        _timeout = timeout
        os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")  # a timed-out rank ends
        # torchrun's store outlives a restarted worker group, and gloo would read the dead
        # group's addresses from it ("connectFullMesh failed"): each attempt gets its own keys.
        store, _, _ = next(dist.rendezvous("env://", rank, world_size,
                                           timeout=datetime.timedelta(seconds=timeout)))
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        if nccl:  # NCCL's own refusal ("Duplicate GPU detected") comes later, as a traceback
            store.set(f"accelrl/gpu_{attempt}_{rank}",
                      f"{socket.gethostname()}/{torch.cuda.get_device_properties(device).uuid}")
            if problem := shared_gpu([store.get(f"accelrl/gpu_{attempt}_{r}").decode()
                                      for r in range(world_size)]):
                fail(problem)
        dist.init_process_group("nccl" if nccl else "gloo", rank=rank, world_size=world_size,
                                store=dist.PrefixStore(f"accelrl/attempt_{attempt}", store),
                                timeout=datetime.timedelta(seconds=timeout),
                                **({"device_id": device} if nccl else {}))
        _made_group = True
        if world_size > 1:
            _io_group = dist.new_group(backend="gloo",
                                       timeout=datetime.timedelta(seconds=timeout + IO_GRACE))
    return World(rank, local_rank, world_size, device)


def pick_device(cuda: bool, local_rank: int, backend: str = "auto") -> torch.device:
    """This rank's GPU (docs/internals.md) or the CPU; exit 2 if NCCL gives LOCAL_RANK no GPU."""
    if not (cuda and torch.cuda.is_available()):
        return torch.device("cpu")
    count = torch.cuda.device_count()
    if count == 1:  # one GPU per process (a scheduler's binding), or ranks sharing it over gloo
        return torch.device("cuda", 0)
    if local_rank >= count and backend != "gloo":
        fail(f"LOCAL_RANK {local_rank} has no GPU of its own: {count} are visible "
             f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')}); launch "
             "--nproc_per_node <= the GPUs, or pass --backend gloo to let ranks share them")
    return torch.device("cuda", local_rank % count)


def shared_gpu(gpus: list[str]) -> str | None:
    """Why NCCL would refuse the ranks' "host/GPU uuid"s (rank order): two on one GPU; or None."""
    first: dict[str, int] = {}
    for rank, g in enumerate(gpus):
        if g in first:
            return (f"ranks {first[g]} and {rank} would share GPU {g.split('/')[-1][:13]} on "
                    f"{g.split('/')[0]}, which NCCL refuses; launch one rank per GPU, or pass "
                    "--backend gloo to let ranks share a GPU")
        first[g] = rank
    return None


_timeout = 600.0
_made_group = False  # this process joined a group: finish() and fail() end it with os._exit
_io_group = None  # gloo, with IO_GRACE more: the collectives that wait for checkpoint writes
_exit_fns: list = []  # on_exit()
name_dead_peer = None  # set by central_optim: ends this rank naming a peer that died, if one did


def _guarded(collective):
    """End this rank with one line when a collective fails, instead of a traceback or a hang."""
    @functools.wraps(collective)
    def run(*args, **kwargs):
        try:
            return collective(*args, **kwargs)
        except RuntimeError as e:  # torch.distributed.DistError and gloo's errors are these
            if name_dead_peer is not None:  # the likeliest cause: name it, not gloo's socket
                name_dead_peer()
                time.sleep(0.5)  # a killed peer's sockets close just before it turns zombie
                name_dead_peer()
            first = next((ln.strip() for ln in str(e).splitlines() if ln.strip()), "")[:300]
            abort(f"{collective.__name__} failed: {first}. Another rank died or made no progress "
                  f"for {_timeout:g} s (--collective-timeout)")
    return run


def abort(why: str) -> None:
    """End this rank at once with one line, after the on_exit clean-ups, so that torchrun can
    stop or restart the group; no group clean-up: destroying a broken group can hang."""
    print(f"error: rank {os.environ.get('RANK', 0)}: {why}; ending this rank so torchrun can "
          "stop or restart the group", file=sys.stderr, flush=True)
    _run_on_exit()
    os._exit(1)


def on_exit(fn) -> None:
    """Run fn() before any os._exit here, as the interpreter's exit would (e.g. unlink shm)."""
    _exit_fns.append(fn)


def _run_on_exit() -> None:
    while _exit_fns:
        try:
            _exit_fns.pop()()
        except Exception as e:  # a clean-up that fails must not keep the others from running
            print(f"warning: clean-up at exit failed: {e}", file=sys.stderr, flush=True)


def active() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def cleanup() -> None:
    """Leave the group (its threads end here, see the import above); the process goes on."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def finish(code: int = 0) -> None:
    """The last call of a script's main(): leave the group and end with `code` (os._exit).
    Without a group (plain python, a test calling main()) it returns, or raises SystemExit."""
    cleanup()
    if _made_group:
        _leave(code)
    if code:
        sys.exit(code)


def fail(message: str, code: int = 2) -> None:
    """End a user-caused error on every rank: one line from rank 0, exit `code`, no hang (as
    finish(); without a group SystemExit(code), which in-process tests catch)."""
    if int(os.environ.get("RANK", 0)) == 0:
        print(f"error: {message}", file=sys.stderr, flush=True)
    cleanup()
    if _made_group:
        _leave(code)
    sys.exit(code)


def _leave(code: int) -> None:
    """os._exit(code) without the interpreter's teardown (docs/internals.md), after what it does:
    kill daemonic children (APPO's sampler ignores SIGTERM; multiprocessing would wait for it
    forever), run atexit handlers (they unlink the sampler queues' semaphores, flush logging) and
    flush stdout/stderr. Scripts close their files first and write in no non-daemonic thread."""
    _run_on_exit()
    for p in multiprocessing.active_children():
        if p.daemon:
            p.kill()
            p.join()
    atexit._run_exitfuncs()  # it reports, and survives, a handler that raises
    for stream in (sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__):
        try:
            stream.flush()
        except (AttributeError, OSError, ValueError):  # None, a closed or broken stream
            pass
    os._exit(code)


@_guarded
def agree(error: str | None, io: bool = False) -> str | None:
    """Rank 0's verdict (an error or None) on every rank, so all stop or go on together.
    `io`: on the side group, after a checkpoint write."""
    if not active():
        return error
    box = [error]
    dist.broadcast_object_list(box, src=0, group=_io_group if io else None)
    return box[0]


@_guarded
def broadcast_object(obj, world: World):
    """Rank 0's object on every rank (other nodes may not see rank 0's disk)."""
    if not active():
        return obj
    box = [obj if world.is_main else None]
    dist.broadcast_object_list(box, src=0, device=world.device)
    return box[0]


@_guarded
def broadcast_params(model: torch.nn.Module) -> None:
    """Start every rank from rank 0's parameters."""
    if active():
        for p in model.state_dict().values():
            dist.broadcast(p, src=0)


@_guarded
def all_reduce_grads(model: torch.nn.Module) -> float:
    """Average gradients over ranks in one flat buffer; returns the seconds spent communicating."""
    if not active():
        return 0.0
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    flat = torch.cat([g.reshape(-1) for g in grads])
    t0 = clock(flat.device)  # the queued backward is the learner's time, not communication's
    dist.all_reduce(flat)
    seconds = clock(flat.device) - t0
    flat /= dist.get_world_size()
    for g, part in zip(grads, flat.split([g.numel() for g in grads])):
        g.copy_(part.view_as(g))
    return seconds


@_guarded
def all_reduce_mean(values: torch.Tensor) -> torch.Tensor:
    """Element-wise mean of a small tensor over ranks (statistics, stop flags)."""
    if active():
        values = values.clone()
        dist.all_reduce(values)
        values /= dist.get_world_size()
    return values


@_guarded
def all_gather(obj, io: bool = False) -> list:
    """Every rank's object, in rank order. `io`: on the side group (waits IO_GRACE longer)."""
    if not active():
        return [obj]
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj, group=_io_group if io else None)
    return out
