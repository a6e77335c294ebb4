"""Central parameters and optimizer state in the machine's shared memory, updated asynchronously.

How and why: docs/internals.md#commoncentral_optimpy.
"""

from __future__ import annotations

import fcntl
import math
import os
import re
import tempfile
import time
import uuid
from functools import partial
from pathlib import Path

import torch

from common import checkpoint, dist
from common.gpu import Upload
from common.grad_step import AllReduceStep, CentralStep

FOLDER = Path("/dev/shm") if os.path.isdir("/dev/shm") else Path(tempfile.gettempdir())


STATS = {"adam": ("exp_avg", "exp_avg_sq"), "rmsprop": ("square_avg",)}  # torch's state names


class CentralOptimizer:
    """Adam or RMSProp (`rule`) on central parameters shared by one machine's processes. The
    creator (name=None) writes the files from `params` (and a checkpoint's `state`); others attach
    by its `name`. `step(lr)` applies `params`' gradients; `pull()` copies the central parameters
    back; `add_steps(n)` counts n environment steps into the global step and returns it."""

    def __init__(self, params, num_chunks: int = 3, betas=(0.9, 0.999), eps: float = 1e-8,
                 name: str | None = None, state: dict | None = None, folder: Path = FOLDER,
                 rule: str = "adam", alpha: float = 0.99, global_step: int = 0):
        self.params = list(params)
        self.peers: dict[int, int] = {}  # rank -> pid of the machine's other ranks (shared())
        n = sum(p.numel() for p in self.params)
        self.sizes = [len(c) for c in torch.arange(n).tensor_split(num_chunks)]
        self.betas, self.eps, self.rule, self.alpha = betas, eps, rule, alpha
        rows = 1 + len(STATS[rule])
        self.name = name or f"accelrl-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.paths = [folder / f"{self.name}.c{c}" for c in range(num_chunks)]
        self.steps_path = folder / f"{self.name}.steps"
        if name is None:
            self._create(state, global_step)
        self.chunks = [torch.from_file(str(p), shared=True, size=rows * k).view(rows, k)
                       for p, k in zip(self.paths, self.sizes)]  # [rows, n_c]: param, statistics
        counts = torch.from_file(str(self.steps_path), shared=True, size=num_chunks + 1,
                                 dtype=torch.int64)
        self.steps, self.global_step = counts[:num_chunks], counts[num_chunks:]
        self.fds = [os.open(p, os.O_RDWR) for p in (*self.paths, self.steps_path)]
        self.last_order: list[tuple[int, int]] = []  # (chunk, its step count) of the last step
        self._upload = Upload(self.params[0].device)

    def _create(self, state: dict | None, global_step: int) -> None:
        remove_stale(self.paths[0].parent)
        flat = torch.cat([p.detach().reshape(-1).float().cpu() for p in self.params])
        rows = [flat] + [state[k].float() if state else torch.zeros_like(flat)
                         for k in STATS[self.rule]]  # a KeyError: another rule's checkpoint
        steps = torch.zeros(len(self.sizes) + 1, dtype=torch.int64)
        steps[-1] = global_step
        if state:  # another --num-chunks than the checkpoint's: chunks differ by a step at most
            old = state["step"]
            steps[:-1] = old if len(old) == len(self.sizes) else int(old.float().mean().round())
        try:
            for c, path in enumerate(self.paths):
                with open(path, "xb") as f:  # x: never map someone else's files
                    f.write(torch.stack([r.split(self.sizes)[c] for r in rows]).numpy().tobytes())
            with open(self.steps_path, "xb") as f:
                f.write(steps.numpy().tobytes())
        except BaseException:
            self.unlink()
            raise

    def unlink(self) -> None:
        """Remove the names once every process has attached (their mappings and locks remain)."""
        for p in (*self.paths, self.steps_path):
            p.unlink(missing_ok=True)

    def _try_lock(self, c: int) -> bool:
        try:
            fcntl.flock(self.fds[c], fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            return False

    def add_steps(self, n: int) -> int:
        """Count n more environment steps into the machine's global step; returns the new total."""
        fcntl.flock(self.fds[-1], fcntl.LOCK_EX)
        try:
            self.global_step += n
            return int(self.global_step)
        finally:
            fcntl.flock(self.fds[-1], fcntl.LOCK_UN)

    @torch.no_grad()
    def step(self, lr: float) -> float:
        """Apply the rule to the central copy with `params`' gradients; returns seconds spent
        waiting for chunks that other processes held."""
        grad = torch.cat([p.grad.reshape(-1) for p in self.params]).float().cpu()
        grads = grad.split(self.sizes)
        pending, waited, self.last_order = list(range(len(self.sizes))), 0.0, []
        while pending:
            c = next((c for c in pending if self._try_lock(c)), None)  # whichever is free first
            if c is None:  # all the rest are busy: queue on the first instead of spinning
                c, t0 = pending[0], time.perf_counter()
                fcntl.flock(self.fds[c], fcntl.LOCK_EX)
                waited += time.perf_counter() - t0
            try:
                rule = self._adam if self.rule == "adam" else self._rmsprop
                self.last_order.append((c, rule(c, grads[c], lr)))
            finally:
                fcntl.flock(self.fds[c], fcntl.LOCK_UN)
            pending.remove(c)
        return waited

    def _adam(self, c: int, g: torch.Tensor, lr: float) -> int:
        """torch.optim.Adam's update (no weight decay, no amsgrad) on chunk c, under its lock."""
        p, m, v = self.chunks[c]
        t = int(self.steps[c]) + 1
        self.steps[c] = t
        b1, b2 = self.betas
        m.lerp_(g, 1 - b1)
        v.mul_(b2).addcmul_(g, g, value=1 - b2)
        denom = (v.sqrt() / math.sqrt(1 - b2 ** t)).add_(self.eps)
        p.addcdiv_(m, denom, value=-lr / (1 - b1 ** t))
        return t

    def _rmsprop(self, c: int, g: torch.Tensor, lr: float) -> int:
        """torch.optim.RMSprop's update (not centered, no momentum) on chunk c, under its lock."""
        p, v = self.chunks[c]
        t = int(self.steps[c]) + 1
        self.steps[c] = t
        v.mul_(self.alpha).addcmul_(g, g, value=1 - self.alpha)
        p.addcdiv_(g, v.sqrt().add_(self.eps), value=-lr)
        return t

    def check_peers(self) -> None:
        """End this rank with one line if another rank has died. Asynchronous ranks meet only at
        the logging cadence, which on a slow machine outlasts torchrun's grace between its
        SIGTERM and SIGKILL, so they look each iteration (one kill(pid, 0) per peer)."""
        for rank, pid in self.peers.items():
            try:
                os.kill(pid, 0)
                with open(f"/proc/{pid}/stat") as f:  # an unreaped zombie answers kill() too
                    dead = f.read().rsplit(")", 1)[1].split()[0] == "Z"
            except ProcessLookupError:
                dead = True
            except OSError:  # no /proc: kill()'s answer is all there is
                dead = False
            if dead:
                dist.abort(f"rank {rank} (pid {pid}) died")

    @torch.no_grad()
    def pull(self) -> None:
        """Copy the central parameters into `params`, without locks: a chunk being written may be
        read half old, half new, which asynchronous SGD tolerates (Hogwild); readers never wait."""
        flat = torch.cat([ch[0] for ch in self.chunks])
        flat = self._upload({"flat": flat})["flat"]  # to a GPU: one pinned copy, not one per tensor
        for p, src in zip(self.params, flat.split([p.numel() for p in self.params])):
            p.copy_(src.view_as(p))

    def state_dict(self) -> dict:
        """The rule's statistics for a checkpoint (the parameters are the model's, after pull())."""
        return {**{k: torch.cat([ch[1 + i] for ch in self.chunks]).clone()
                   for i, k in enumerate(STATS[self.rule])}, "step": self.steps.clone()}

    def close(self) -> None:
        for fd in self.fds:
            os.close(fd)
        self.fds = []


def remove_stale(folder: Path = FOLDER) -> None:
    """Unlink central-state files whose creator no longer runs (it was killed outright)."""
    for f in folder.glob("accelrl-*"):
        if m := re.match(r"accelrl-(\d+)-", f.name):
            try:
                os.kill(int(m.group(1)), 0)
            except ProcessLookupError:
                f.unlink(missing_ok=True)
            except PermissionError:  # alive, another user's
                pass


def check(args, world, instead: str = "drop --asynchronous") -> None:
    """The asynchronous modes' refusal, in one line: ranks on more than one machine."""
    if int(os.environ.get("LOCAL_WORLD_SIZE", world.world_size)) != world.world_size:
        dist.fail("the asynchronous mode runs on one machine (the central parameters live in its "
                  f"shared memory); for several machines {instead}")


def refusal(args, state: dict) -> str | None:
    """Why a checkpoint cannot resume under these flags (runs.prepare_run's `check`): the
    synchronous and central optimizer states differ, and so do the central rules'."""
    if state.get("asynchronous", False) != args.asynchronous:
        how = "with" if state.get("asynchronous") else "without"
        return (f"checkpoint {args.resume} was trained {how} --asynchronous: its optimizer "
                "state does not carry over; resume it as it ran")
    if args.asynchronous and STATS[args.optimizer][0] not in state["optimizer"]:
        return (f"checkpoint {args.resume} holds another rule's central statistics than "
                f"--optimizer {args.optimizer}; resume it with the optimizer it ran with")
    return None


def shared(make, world, state: dict | None = None) -> CentralOptimizer:
    """The machine's central optimizer, called by all ranks: rank 0 creates it (`make(state=...)`),
    the others attach (`make(name=...)`), and rank 0 unlinks the names once all have attached
    (mappings and locks live on), or, whatever ends the start-up in between (another rank dying,
    an exception), in the `finally` or dist's exit hook."""
    central = make(state=state) if world.is_main else None
    if central is not None:
        dist.on_exit(central.unlink)  # a failed collective leaves through os._exit
    try:
        name = dist.broadcast_object(central.name if central else None, world)
        central = central or make(name=name)
        pids = dist.all_gather(os.getpid())  # also: every rank has mapped and opened the files
        central.peers = {r: pid for r, pid in enumerate(pids) if r != world.rank}
        dist.name_dead_peer = central.check_peers  # a failed meeting then names the dead rank
    finally:
        if world.is_main and central is not None:
            central.unlink()
    return central


def make_step(model, optimizer: torch.optim.Optimizer | None, run, asynchronous: bool,
              max_grad_norm: float, num_chunks: int = 3, **rule) -> AllReduceStep:
    """The run's step (common/grad_step.py), after `run.restore`: the all-reduced one (`optimizer`
    takes the checkpoint's statistics), or the central one (rank 0 writes the central state from
    the model and the checkpoint's statistics, the others attach). `rule`: the central update's
    (rule="adam" or "rmsprop", eps, alpha); `optimizer`, when given, is where the rate starts."""
    state = run.state
    if not asynchronous:
        if state is not None:
            checkpoint.load_into(optimizer, state["optimizer"])
        return AllReduceStep(model, optimizer, max_grad_norm)
    central = shared(partial(CentralOptimizer, model.parameters(), num_chunks,
                             global_step=run.start_step, **rule),
                     run.world, state and state["optimizer"])
    central.pull()
    lr = optimizer.param_groups[0]["lr"] if optimizer is not None else 0.0
    return CentralStep(model, central, lr, max_grad_norm)
