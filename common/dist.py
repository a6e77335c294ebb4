"""Distributed set-up: one process per GPU, launched by torchrun (or plain python: a world of one).

Gradients are averaged with one flat all-reduce per update, as in the paper (Sec. 3.2: summed
over GPUs with NCCL, divided by their number, the same step applied everywhere). By hand, not
DistributedDataParallel: the communication phase is timed on its own (DDP hides it in backward);
the Nature CNN is one 6.7 MB bucket, so DDP's overlap buys little; and sampling-time inference and
target networks use the plain module.

Devices. Rank r uses GPU `LOCAL_RANK` of those visible, or the only one when a scheduler shows
each process one GPU. NCCL refuses two ranks on one GPU, so that is refused here with one line;
`--backend gloo` lets several ranks share a GPU (CUDA tensors over gloo), which exercises the
multi-rank paths on a one-GPU machine. The GPU habits (cuDNN autotuning, TF32 matmuls, no
argument validation in torch.distributions: a host sync per call) are set here, once, and
listed by `switches()` for summary.json.

Failures. Every collective runs under the group's timeout (`--collective-timeout`). With gloo a
dead peer fails the collective at once; with NCCL collectives are asynchronous, so a dead peer
shows as a wait, ended by NCCL's watchdog at the timeout (TORCH_NCCL_ASYNC_ERROR_HANDLING=1 tears
the process down). Either way this rank ends with one line and exit code 1, and torchrun stops or
restarts the group (`--max-restarts`). Checkpoint writes wait on a side group whose timeout adds
IO_GRACE, so a long `--save-replay` write does not trip the others' timeout.

Exit. `finish()` ends main() and `fail()` ends a user error; both leave the group and end with
`os._exit`, so no C++ destructor of the interpreter's teardown runs while the group's threads
(gloo's `pt_gloo_runloop`, NCCL's watchdog) still run: that aborted finished ranks with
"terminate called without an active exception" while another rank was still finishing.
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

if dist.is_available():
    # Before any group exists: its collectives take `group=group.WORLD` as a default argument,
    # evaluated on import (torch._dynamo imports it when an optimizer is made). Imported after
    # init_process_group they hold the group for good, destroy_process_group() frees nothing and
    # its threads outlive it until the interpreter's teardown. Imported here, the default is None.
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


def setup(cuda: bool, timeout: float = 600.0, backend: str = "auto") -> World:
    """Read torchrun's RANK / LOCAL_RANK / WORLD_SIZE, pick the device and join the group.

    Nothing assumes one machine: torchrun's rendezvous supplies MASTER_ADDR and MASTER_PORT.
    `timeout`: seconds a collective waits for the other ranks before it fails. `backend`: auto
    (NCCL on GPUs, gloo on CPUs), nccl or gloo.
    """
    global _timeout, _made_group, _io_group
    rank = int(os.environ.get("RANK", 0))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    device = pick_device(cuda, local_rank, backend)
    if device.type == "cuda":
        torch.cuda.set_device(device)  # before NCCL init, so each rank owns its own GPU
        set_gpu_habits()
    torch.distributions.Distribution.set_default_validate_args(False)  # a host sync per check
    if "RANK" in os.environ and not dist.is_initialized():
        nccl = device.type == "cuda" and backend != "gloo"
        kwargs = {"device_id": device} if nccl else {}
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
            problem = shared_gpu([store.get(f"accelrl/gpu_{attempt}_{r}").decode()
                                  for r in range(world_size)])
            if problem:
                fail(problem)
        dist.init_process_group("nccl" if nccl else "gloo", rank=rank, world_size=world_size,
                                store=dist.PrefixStore(f"accelrl/attempt_{attempt}", store),
                                timeout=datetime.timedelta(seconds=timeout), **kwargs)
        _made_group = True
        if world_size > 1:
            _io_group = dist.new_group(backend="gloo",
                                       timeout=datetime.timedelta(seconds=timeout + IO_GRACE))
    return World(rank, local_rank, world_size, device)


def pick_device(cuda: bool, local_rank: int, backend: str = "auto") -> torch.device:
    """This rank's GPU (module docstring), the CPU, or one line and exit 2 for a LOCAL_RANK
    that has no GPU of its own under NCCL."""
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
    """Why NCCL would refuse this layout (two ranks on one GPU), given each rank's
    "host/GPU uuid" in rank order, or None."""
    first: dict[str, int] = {}
    for rank, gpu in enumerate(gpus):
        if gpu in first:
            return (f"ranks {first[gpu]} and {rank} would share GPU {gpu.split('/')[-1][:13]} on "
                    f"{gpu.split('/')[0]}, which NCCL refuses; launch one rank per GPU, or pass "
                    "--backend gloo to let ranks share a GPU")
        first[gpu] = rank
    return None


def set_gpu_habits() -> None:
    torch.backends.cudnn.benchmark = True  # fixed input shapes: autotune each convolution once
    torch.backends.cuda.matmul.allow_tf32 = True  # TF32 matmuls and convolutions (Ampere+)
    torch.backends.cudnn.allow_tf32 = True


def compiled(fn, on: bool):
    """The sampling step's network under --compile: torch.compile(mode="reduce-overhead"), CUDA
    graphs on a GPU (its batch is fixed: one compilation per group size). Off by default: per-step
    inference at batch 8 to 16 is launch-bound, but no GPU run has yet shown the gain."""
    global _compile
    _compile = _compile or on
    return torch.compile(fn, mode="reduce-overhead") if on else fn


def switches() -> dict:
    """The performance switches in force, for summary.json."""
    return {"cudnn_benchmark": torch.backends.cudnn.benchmark,
            "tf32_matmul": torch.backends.cuda.matmul.allow_tf32,
            "tf32_cudnn": torch.backends.cudnn.allow_tf32,
            "distribution_validation": torch.distributions.Distribution._validate_args,
            "compile": _compile,
            "backend": dist.get_backend() if dist.is_available() and dist.is_initialized()
            else None}


def clock(device: torch.device) -> float:
    """time.perf_counter() once `device` has finished its queued work: phase timers read it once
    per phase boundary (a GPU runs kernels after their launch returns)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


_timeout = 600.0
_made_group = False  # this process joined a group: finish() and fail() end it with os._exit
_io_group = None  # gloo, with IO_GRACE more: the collectives that wait for checkpoint writes
_compile = False  # some network was compiled (compiled())
_exit_fns: list = []  # on_exit()


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
            _run_on_exit()
            os._exit(1)  # no group clean-up: destroying a broken group can hang
    return run


def on_exit(fn) -> None:
    """Run fn() before any os._exit here (a failed collective, finish(), fail()): what the
    interpreter's exit would otherwise have done, e.g. unlink shared memory this rank created."""
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
    """End a user-caused error on every rank: one line from rank 0, a non-zero exit, no hang
    (os._exit as finish(); without a group SystemExit(code), which in-process tests catch)."""
    if int(os.environ.get("RANK", 0)) == 0:
        print(f"error: {message}", file=sys.stderr, flush=True)
    cleanup()
    if _made_group:
        _leave(code)
    sys.exit(code)


def _leave(code: int) -> None:
    """End this process now with `code`, without the interpreter's teardown (module docstring).

    os._exit skips what a normal exit does in Python, so that is done first: daemonic children
    still alive are killed (APPO's sampler ignores SIGTERM, and multiprocessing's exit handler
    would wait for it forever), the atexit handlers run (multiprocessing's finalizers unlink the
    sampler queues' semaphores; logging flushes), and stdout/stderr are flushed. The scripts close
    their files (TensorBoard, summary.json, fsynced checkpoints) before this, and run nothing that
    writes in a non-daemonic thread.
    """
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
    """Share rank 0's verdict (an error message or None) so all ranks stop or go on together.
    `io`: on the side group, after a checkpoint write (module docstring)."""
    if not active():
        return error
    box = [error]
    dist.broadcast_object_list(box, src=0, group=_io_group if io else None)
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
    t0 = clock(flat.device)  # the queued backward is the learner's time, not communication's
    dist.all_reduce(flat)
    seconds = clock(flat.device) - t0
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
def all_gather(obj, io: bool = False) -> list:
    """Every rank's object, in rank order (episode statistics for logging). `io`: on the side
    group, which waits IO_GRACE longer for a rank still writing its checkpoint."""
    if not active():
        return [obj]
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj, group=_io_group if io else None)
    return out
