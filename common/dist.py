"""Distributed set-up: one process per GPU, launched by torchrun (or plain python: a world of one).

Gradient averaging is one flat all-reduce per update, as in the paper (Sec. 3.2: gradients are
summed over GPUs with NCCL and divided by their number, and every GPU applies the same step).
We do this by hand instead of wrapping the model in DistributedDataParallel because:
- the communication phase must be timed on its own (DDP hides it inside backward);
- the network is small (the Nature CNN: 1.7M parameters, one 6.7 MB bucket), so DDP's overlap of
  backward and communication buys little, while one flat buffer costs a single collective;
- the same two calls serve every script (policy gradient and Q-learning) with no wrapper around
  the model, so sampling-time inference and target networks use the plain module.

A rank that dies or hangs must not hang the others: every collective runs under the process
group's timeout (`--collective-timeout`), and a collective that fails (a peer's connection closed,
or no progress within the timeout) ends this rank at once with one line and exit code 1, so
torchrun sees a failed worker and stops or restarts the whole group (`--max-restarts`). NCCL's
own watchdog does the same on GPUs.

A rank that ends must not crash on its way out either: a script's main() ends with `finish()`,
and a user error ends every rank through `fail()`. Both leave the group, then end the process
with `os._exit`, so that no C++ destructor of the interpreter's teardown runs while the group's
threads (gloo's `pt_gloo_runloop` and `gloo_tcp_loop`, NCCL's watchdog) may still be running:
that ended a finished rank with SIGABRT ("terminate called without an active exception") while
another rank was still finishing, and torchrun called the run failed. `cleanup()` only leaves
the group, freeing it and ending its threads (the ranks that tests start call it and go on).
"""

from __future__ import annotations

import atexit
import datetime
import functools
import multiprocessing
import os
import sys
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

if dist.is_available():
    # Before any group exists. torch.distributed.nn.functional's collectives take
    # `group=group.WORLD` as a default argument, evaluated once, on import; torch._dynamo imports
    # it, and every torch.optim optimizer imports torch._dynamo when it is made. Imported after
    # init_process_group, its ten functions hold the world group for good: destroy_process_group()
    # then frees nothing, its threads run on, and the group is freed only when the interpreter
    # tears its modules down. Imported here, those defaults are None.
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


def setup(cuda: bool, timeout: float = 600.0) -> World:
    """Read torchrun's RANK / LOCAL_RANK / WORLD_SIZE, pick the device and join the group.

    Nothing assumes one machine: torchrun's rendezvous supplies MASTER_ADDR and MASTER_PORT.
    `timeout`: seconds a collective waits for the other ranks before it fails.
    """
    global _timeout, _made_group
    rank = int(os.environ.get("RANK", 0))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    use_cuda = cuda and torch.cuda.is_available()
    if use_cuda:
        torch.cuda.set_device(local_rank)  # before NCCL init, so each rank owns its own GPU
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    if "RANK" in os.environ and not dist.is_initialized():
        kwargs = {"device_id": device} if use_cuda else {}
        _timeout = timeout
        # torchrun's store outlives a restarted worker group, and gloo would read the dead
        # group's addresses from it ("connectFullMesh failed"): each attempt gets its own keys.
        store, _, _ = next(dist.rendezvous("env://", rank, world_size,
                                           timeout=datetime.timedelta(seconds=timeout)))
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        dist.init_process_group("nccl" if use_cuda else "gloo", rank=rank, world_size=world_size,
                                store=dist.PrefixStore(f"accelrl/attempt_{attempt}", store),
                                timeout=datetime.timedelta(seconds=timeout), **kwargs)
        _made_group = True
    return World(rank, local_rank, world_size, device)


_timeout = 600.0
_made_group = False  # this process joined a group: finish() and fail() end it with os._exit


def _guarded(collective):
    """End this rank with one line when a collective fails, instead of a traceback or a hang."""
    @functools.wraps(collective)
    def run(*args, **kwargs):
        try:
            return collective(*args, **kwargs)
        except RuntimeError as e:  # torch.distributed.DistError and gloo's errors are these
            first = next((ln.strip() for ln in str(e).splitlines() if ln.strip()), "")[:300]
            print(f"error: rank {os.environ.get('RANK', 0)}: {collective.__name__} failed: "
                  f"{first}. Another rank died or made no progress for {_timeout:g} s "
                  "(--collective-timeout); ending this rank so torchrun can stop or restart the "
                  "group", file=sys.stderr, flush=True)
            os._exit(1)  # no clean-up: destroying a broken group can hang
    return run


def active() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def cleanup() -> None:
    """Leave the group (its threads end here, see the import above); the process goes on."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def finish(code: int = 0) -> None:
    """The last call of a script's main(): leave the group and end the process with `code`.

    In a process that joined a group this does not return: it ends with os._exit (see _leave).
    Without a group (plain python, or a test calling main() in its own process) there are no
    group threads to outlive, so it returns (or raises SystemExit for a non-zero `code`) and the
    interpreter exits as usual.
    """
    cleanup()
    if _made_group:
        _leave(code)
    if code:
        sys.exit(code)


def fail(message: str, code: int = 2) -> None:
    """End a user-caused error on every rank: one line from rank 0, a non-zero exit, no hang.

    In a process that joined a group it leaves the group and ends with os._exit (as finish());
    without one it raises SystemExit(code), which in-process callers (tests) can catch.
    """
    if int(os.environ.get("RANK", 0)) == 0:
        print(f"error: {message}", file=sys.stderr, flush=True)
    cleanup()
    if _made_group:
        _leave(code)
    sys.exit(code)


def _leave(code: int) -> None:
    """End this process now, with `code`, without the interpreter's teardown.

    os._exit runs no module teardown and no C++ static destructor: nothing of torch (or of a
    process group that something still holds) is destroyed while its threads run. It also skips
    what a normal exit does in Python, so that is done here first:
    - daemonic child processes still alive are killed, as PR_SET_PDEATHSIG would when we exit
      (APPO's sampler, when fail() comes mid-run: it ignores SIGTERM, so multiprocessing's exit
      handler below would terminate it in vain and then wait for it forever). At the end of a
      run the scripts have stopped their children already (APPO: sampler.close()).
    - the atexit handlers run, as at a normal exit. What they do for these scripts:
      multiprocessing's finalizers unlink the named semaphores of APPO's sampler queues and lock
      (without them the resource tracker unlinks them and warns of "leaked semaphore objects"),
      logging.shutdown() flushes log handlers, weakref.finalize callbacks run; torch's (dynamo's
      compile-time dump, the DataLoader exit flag) do nothing here.
    - stdout and stderr are flushed (os._exit drops what a buffer still holds).
    Files the scripts write are closed before this (TensorBoard's writer, summary.json, the
    checkpoints, which are also fsynced), and nothing that writes runs in a non-daemonic thread
    (a normal exit would wait for those). Shared memory needs nothing: torch's CPU tensors share
    through file descriptors whose names are gone already, and APPO's central parameter files
    are unlinked as soon as every rank has opened them.
    """
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
def agree(error: str | None) -> str | None:
    """Share rank 0's verdict (an error message or None) so all ranks stop or go on together."""
    if not active():
        return error
    box = [error]
    dist.broadcast_object_list(box, src=0)
    return box[0]


@_guarded
def broadcast_object(obj, world: World):
    """Rank 0's object on every rank (checkpoints: other nodes may not see rank 0's disk)."""
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
    t0 = time.perf_counter()
    dist.all_reduce(flat)
    if flat.is_cuda:
        torch.cuda.synchronize(flat.device)  # so the time measured is the collective's
    seconds = time.perf_counter() - t0
    flat /= dist.get_world_size()
    offset = 0
    for g in grads:
        g.copy_(flat[offset:offset + g.numel()].view_as(g))
        offset += g.numel()
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
def all_gather(obj) -> list:
    """Every rank's object, in rank order (episode statistics for logging)."""
    if not active():
        return [obj]
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out
