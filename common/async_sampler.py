"""Asynchronous sampling: a sampler process fills shared-memory rollout buffers while the learner
trains (rlpyt's asynchronous runner, after Stooke & Abbeel 2018, Sec. 3).

How and why: docs/internals.md#commonasync_samplerpy.
"""

from __future__ import annotations

import atexit
import ctypes
import os
import queue
import signal
import sys
import time
import traceback
from functools import partial

import torch
import torch.multiprocessing as mp

from common import dist, envs, gpu
from common.sampler import Sampler


class SamplerDied(RuntimeError):
    """The sampler process ended or failed; the message says how."""


class AsyncSampler:
    """`policy(model, obs, cols)` -> (actions, extras), `value_fn(model, obs)` -> values (or None):
    module-level functions. `make_model()` builds the sampler's network (its parameters and
    buffers come from `publish`); `env_kwargs` go to `envs.make_envs`. Rollouts have Sampler's
    keys, `next_obs` [B, 4, 84, 84] and, with a value_fn, `next_value` [B] (behaviour policy's).
    With `final_obs`, also `final_obs` [T x B, 4, 84, 84]: its first truncated.sum() rows are the
    true last observations of the episodes cut at a time limit, in row-major order of
    `truncated` (what the synchronous Sampler's value_fn hook sees, in its order)."""

    def __init__(self, make_model, policy, value_fn, env_kwargs: dict, num_steps: int,
                 seeds, model: torch.nn.Module, device: torch.device, extras=(),
                 clip_rewards: bool = True, num_buffers: int = 2, seed: int = 0,
                 cores: list[int] | None = None, threads: int = 1, compile: bool = False,
                 final_obs: bool = False):
        T, B = num_steps, env_kwargs["num_envs"]
        shapes = {"obs": ((T, B, 4, 84, 84), torch.uint8), "actions": ((T, B), torch.long),
                  "rewards": ((T, B), torch.float32), "terminated": ((T, B), torch.bool),
                  "truncated": ((T, B), torch.bool), "final_values": ((T, B), torch.float32),
                  **{k: ((T, B), torch.float32) for k in extras},
                  "next_obs": ((B, 4, 84, 84), torch.uint8), "next_value": ((B,), torch.float32)}
        if final_obs:  # room for a truncation at every step of every environment
            shapes["final_obs"] = ((T * B, 4, 84, 84), torch.uint8)
        # [num_buffers, ...] per key, in shared memory: buffer i is buffers[k][i]
        self.buffers = {k: torch.zeros((num_buffers, *s), dtype=d).share_memory_()
                        for k, (s, d) in shapes.items()}
        self.params = _flat(model).share_memory_()
        self.version = torch.zeros(1, dtype=torch.int64).share_memory_()
        if compile:  # the sampler process's compile folder goes inside this process's
            gpu.own_compile_cache()
        ctx = mp.get_context("spawn")
        self.lock, self.free, self.full = ctx.Lock(), ctx.Queue(), ctx.Queue()
        for i in range(num_buffers):
            self.free.put(i)
        self.proc = ctx.Process(
            target=_sampler_main, daemon=True, name="accelrl-sampler",
            args=(os.getpid(), make_model, policy, value_fn, env_kwargs, T, seeds, device,
                  tuple(extras), clip_rewards, seed, cores, threads, compile, self.buffers,
                  self.params, self.version, self.lock, self.free, self.full))
        # The child starts deaf to Ctrl-C / SIGTERM (the mask survives exec) until it ignores
        # them itself: a signal during its start-up must not look like a crash.
        mask = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
        try:
            self.proc.start()
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        atexit.register(self.close)  # after multiprocessing's hook, so it runs before it

    def publish(self, model: torch.nn.Module, version: int) -> None:
        """New parameters for the sampler's next rollout, tagged `version`. The lock (no copy of
        half-written ones) is awaited watching the sampler: if it died holding it, SamplerDied."""
        flat = _flat(model)
        while not self.lock.acquire(timeout=0.2):
            self._check_alive()
        try:
            self.params.copy_(flat)
            self.version[0] = version
        finally:
            self.lock.release()

    def _check_alive(self) -> None:
        if not self.proc.is_alive():
            code = self.proc.exitcode
            how = (f"was killed by {signal.Signals(-code).name}" if code and code < 0
                   else f"exited with code {code}")
            raise SamplerDied(f"sampler process (pid {self.proc.pid}) {how}") from None

    def get(self) -> tuple[int, dict]:
        """The next full buffer: (index, info: version, episodes, time_env, time_inference,
        sampler_wait (the sampler's wait for a free buffer), learner_wait (this call's))."""
        t0 = time.perf_counter()
        while True:
            try:
                msg = self.full.get(timeout=0.2)
                break
            except queue.Empty:
                self._check_alive()
        if msg[0] == "error":
            raise SamplerDied(f"sampler process (pid {self.proc.pid}) failed:\n{msg[1]}")
        _, i, info = msg
        return i, {**info, "learner_wait": time.perf_counter() - t0}

    def rollout(self, i: int) -> dict[str, torch.Tensor]:
        return {k: v[i] for k, v in self.buffers.items()}

    def release(self, i: int) -> None:
        """Buffer i may be overwritten: the learner is done with it."""
        self.free.put(i)

    def close(self) -> None:
        """Stop the sampler (within a second or two, killed if it does not stop)."""
        atexit.unregister(self.close)
        if self.proc.is_alive():
            self.free.put(None)
            self.proc.join(timeout=3)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join()
        for q in (self.free, self.full):  # do not block exit flushing a pipe nobody reads
            q.cancel_join_thread()
            q.close()


def pin(args, world) -> list[int]:
    """A script's --sampler-cores dealt out: this rank's share (local rank r of n takes every
    n-th from the r-th, or all of them if there are fewer than n), returned for its sampler
    process; the learner (this process, and threads it starts from now on) moves to the cores no
    sampler has. Cores this process may not use end the run in one line."""
    sampler_cores = args.sampler_cores
    if sampler_cores and not getattr(args, "async_sampling", True):  # the DQN family's switch
        dist.fail("--sampler-cores pins the sampler process of --async-sampling: add that flag")
    allowed = os.sched_getaffinity(0)
    if not set(sampler_cores) <= allowed:
        dist.fail(f"--sampler-cores {list(sampler_cores)} are not all among the cores this "
                  f"process may use: {sorted(allowed)}")
    local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    cores = list(sampler_cores[world.local_rank::local_ranks] or sampler_cores)
    learner_cores = allowed - set(sampler_cores)
    if cores and learner_cores:  # disjoint cores: sampling and learning really overlap
        os.sched_setaffinity(0, learner_cores)
        torch.set_num_threads(max(1, len(learner_cores) // local_ranks))
    return cores


def _flat(model: torch.nn.Module) -> torch.Tensor:
    """Parameters and buffers (e.g. a DQN's exploration epsilon) as one float32 CPU vector."""
    return torch.cat([t.detach().reshape(-1).float().cpu()
                      for t in (*model.parameters(), *model.buffers())])


@torch.no_grad()
def _unflat(flat: torch.Tensor, model: torch.nn.Module) -> None:
    offset = 0
    for t in (*model.parameters(), *model.buffers()):
        t.copy_(flat[offset:offset + t.numel()].view_as(t))  # a copy: never alias shared memory
        offset += t.numel()


def _die_with_parent(parent: int) -> None:
    try:  # Linux: SIGKILL this process when the thread that started it exits
        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL))  # 1: PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
    if os.getppid() != parent:  # the parent died before prctl took effect
        os._exit(1)


def _sampler_main(parent, make_model, policy, value_fn, env_kwargs, T, seeds, device, extras,
                  clip_rewards, seed, cores, threads, compile, buffers, params, version, lock, free,
                  full):
    _die_with_parent(parent)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole process group:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # the learner stops us when it has saved
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT, signal.SIGTERM})
    env_groups = []
    try:
        if cores:
            os.sched_setaffinity(0, cores)
        torch.set_num_threads(threads)
        torch.manual_seed(seed)
        if device.type == "cuda":  # else the context opens on GPU 0, whatever the rank's GPU
            torch.cuda.set_device(device)
            gpu.set_gpu_habits()
        torch.distributions.Distribution.set_default_validate_args(False)
        env_groups = envs.make_envs(**env_kwargs)
        model = make_model().to(device)
        net = gpu.compiled(model, compile)  # shares model's parameters, which _unflat updates
        sampler = Sampler(env_groups, T, device, extras=extras, clip_rewards=clip_rewards)
        sampler.reset(seeds)
        finals = []  # with final_obs: the true last observations of truncated episodes

        def hook(obs):  # the Sampler's value_fn, called only at time limits
            if "final_obs" in buffers:
                finals.append(obs.cpu())
            return value_fn(model, obs) if value_fn else torch.zeros(len(obs), device=obs.device)

        have = -1
        while True:
            t0 = time.perf_counter()
            while True:  # wait for a free buffer, watching the parent
                try:
                    i = free.get(timeout=0.5)
                    break
                except queue.Empty:
                    if os.getppid() != parent:
                        os._exit(1)
            if i is None:
                break
            waited = time.perf_counter() - t0
            with lock:
                if int(version) != have:
                    _unflat(params, model)
                    have = int(version)
            env0, inf0 = sampler.time_env, sampler.time_inference
            buf = {k: v[i] for k, v in buffers.items()}
            if device.type == "cpu":  # write straight into shared memory
                sampler.buf = {k: buf[k] for k in sampler.buf}
            finals.clear()
            out = {**sampler.collect(partial(policy, net), hook), "next_obs": sampler.next_obs}
            if finals:  # packed in front, in the order met: row-major in (t, b)
                buf["final_obs"][:sum(len(f) for f in finals)].copy_(torch.cat(finals))
            if value_fn is not None:
                with torch.no_grad():
                    out["next_value"] = value_fn(model, sampler.next_obs)
            for k, v in out.items():
                if buf[k].data_ptr() != v.data_ptr():
                    buf[k].copy_(v)
            full.put(("rollout", i, {"version": have, "episodes": sampler.pop_episodes(),
                                     "time_env": sampler.time_env - env0,
                                     "time_inference": sampler.time_inference - inf0,
                                     "sampler_wait": waited}))
    except Exception:
        full.put(("error", traceback.format_exc()))
        full.close()
        full.join_thread()
        sys.exit(1)
    finally:
        for e in env_groups:
            e.close()
