"""How every benchmark launches a training script, watches it and stops it.

`command()` builds the line (`python algos/x.py ...`, or torchrun with N ranks on this
machine), `as_typed()` writes it for an output without the machine's paths. `Training` starts
it in its own session (a Ctrl-C in the benchmark reaches only the benchmark, which then stops
the run once), reads its merged output as it comes (into a log file, echoed, and the progress
lines' global steps), and stops it the scripts' clean way: SIGTERM to every rank, which finishes
its iteration, checkpoints, writes summary.json and exits 0. The signal goes to the ranks, not
to torchrun's agent, which would forward it but kill its workers 30 s later, before a slow rank
reaches its stop check. A run that has not exited `grace` seconds later is killed with its whole
session. `scalars` reads a run's TensorBoard events and `phase_shares` is the one reading of
where a run's time went.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parents[1]
PROGRESS = re.compile(r"step\s+([\d,]+)/")  # common.logger's progress line, one per log call
SAMPLER_PHASES = ("env", "inference", "sampler_wait")  # a sampler process's, when it has one


def command(script: str | Path, flags: list[str], ranks: int | None = None) -> list[str]:
    """`script` (a name in algos/, or a path) with `flags`; `ranks`: under torchrun with that
    many ranks on this machine, else plain python."""
    path = ROOT / "algos" / f"{script}.py" if isinstance(script, str) else Path(script)
    launcher = [sys.executable] if ranks is None else [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}"]
    return [*launcher, str(path), *flags]


def as_typed(cmd: list[str], folder: Path, label: str = "<out>") -> list[str]:
    """`cmd` as a user types it, for an output to carry: `python`, paths in the checkout relative
    to it, those under `folder` (an output or scratch folder) as `label`/...; no machine's paths."""
    out = []
    for arg in cmd:
        if arg == sys.executable:
            arg = "python"
        elif os.path.isabs(arg):
            p = Path(arg)
            if p.is_relative_to(folder):
                arg = str(Path(label) / p.relative_to(folder))
            elif p.is_relative_to(ROOT):
                arg = str(p.relative_to(ROOT))
        out.append(arg)
    return out


def typed_path(path: str | None) -> str | None:
    """An output path given by the user, as an output records it: relative to the checkout, or
    <tmp>/... in the temporary folder."""
    if path is None:
        return None
    p = Path(path).resolve()
    return str(p.relative_to(ROOT)) if p.is_relative_to(ROOT) else as_typed(
        [str(p)], Path(tempfile.gettempdir()).resolve(), "<tmp>")[0]


class Training:
    """A training run in a child process. `progress`: (seconds since launch, global step) of each
    progress line; `launched_at` (time.time()), `returncode`, `seconds` (launch to exit),
    `stopped` (this side stopped it), `killed` (it outlived its grace); `lines`: its output,
    `tail()` the last lines."""

    def __init__(self, cmd: list[str], log: Path | None = None, echo: bool = False,
                 env: dict[str, str] | None = None, append: bool = False):
        self.cmd, self.echo, self.stopped, self.killed = cmd, echo, False, False
        self.progress: list[tuple[float, int]] = []
        self.lines: list[str] = []  # the whole output (a run's is small)
        self.log = open(log, "a" if append else "w") if log else None
        if self.log:
            self.log.write(f"$ {shlex.join(cmd)}\n")
        self.launched, self.launched_at = time.monotonic(), time.time()  # the latter: wall clock
        self.proc = subprocess.Popen(
            cmd, cwd=ROOT, env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            if m := PROGRESS.search(line):
                self.progress.append((time.monotonic() - self.launched,
                                      int(m.group(1).replace(",", ""))))
            self.lines.append(line)
            if self.log:
                self.log.write(line)
                self.log.flush()
            if self.echo:
                print(line, end="", flush=True)

    def run(self, until: Callable[[Training], bool] | None = None, limit: float | None = None,
            grace: float | None = 120.0) -> Training:
        """Wait for the run to end; stop it once `until(self)` holds (asked five times a second)
        or `limit` seconds after its launch. Ctrl-C (or SIGTERM after errors.stop_on_sigterm)
        stops it too, then goes on up."""
        try:
            while self.proc.poll() is None:
                time.sleep(0.2)
                if (limit is not None and self.elapsed >= limit) or (until and until(self)):
                    self.stop(grace)
        except KeyboardInterrupt:
            self.stop(grace)
            raise
        finally:
            self._finish()
        return self

    @property
    def elapsed(self) -> float:
        return time.monotonic() - self.launched

    def stop(self, grace: float | None = 120.0) -> None:
        """SIGTERM to every rank; after `grace` seconds (None: wait) SIGKILL to the session and to
        every process under the run in a session of its own (a gpu_check step's training runs)."""
        if self.proc.poll() is not None:
            return
        self.stopped, under = True, descendants(self.proc.pid)
        for pid in self._ranks():
            _kill(pid, signal.SIGTERM)
        try:
            self.proc.wait(grace)
        except subprocess.TimeoutExpired:
            self.killed = True
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        for pid in under:  # gone by now, unless the run left them behind
            _kill(pid, signal.SIGKILL)

    def _ranks(self) -> list[int]:
        """The processes to signal: torchrun's workers, else the run itself."""
        if "torch.distributed.run" not in self.cmd:
            return [self.proc.pid]
        return children(self.proc.pid) or [self.proc.pid]  # none yet: the agent forwards it

    def _finish(self) -> None:
        self.proc.wait()
        self.reader.join(10)
        self.seconds = self.elapsed
        if self.log:
            self.log.close()

    @property
    def returncode(self) -> int | None:
        return self.proc.returncode

    def tail(self, lines: int = 12) -> str:
        return "".join(self.lines[-lines:]).strip() or "(no output)"

    def steady(self) -> dict:
        """Steps/s between the first progress line and the last: start-up and the first
        iteration left out (summary.json's sps counts them, and the final checkpoint)."""
        if len(self.progress) < 2:
            return {"steady_sps": None}
        (t0, s0), (t1, s1) = self.progress[0], self.progress[-1]
        return {"steady_sps": (s1 - s0) / (t1 - t0), "steady_seconds": t1 - t0,
                "steady_steps": s1 - s0}


def _kill(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def children(pid: int) -> list[int]:
    """The processes `pid` started (Linux's /proc; none elsewhere)."""
    out = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            out += [int(p) for p in (task / "children").read_text().split()]
        except OSError:
            pass
    return out


def descendants(pid: int) -> list[int]:
    """Every process under `pid`, training runs in sessions of their own included."""
    out, todo = [], [pid]
    while todo:
        found = children(todo.pop())
        out, todo = out + found, todo + found
    return out


def summary(run_dir: Path) -> dict:
    """A run's summary.json ({} when it wrote none)."""
    path = Path(run_dir) / "summary.json"
    return json.loads(path.read_text()) if path.is_file() else {}


def scalars(run_dir: Path) -> tuple[dict[str, list[tuple[float, int, float]]], float | None]:
    """A run's TensorBoard scalars, {tag: [(wall time, global step, value)]} in the order they
    were written, and the wall time of its first event (None: no events)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    series: dict[str, list] = {}
    starts = []
    for f in sorted(Path(run_dir).glob("events.out.tfevents.*")):
        acc = EventAccumulator(str(f), size_guidance={"scalars": 0})  # 0: every event
        acc.Reload()
        try:
            starts.append(acc.FirstEventTimestamp())
        except ValueError:  # an empty file
            continue
        for tag in acc.Tags()["scalars"]:
            series.setdefault(tag, []).extend((e.wall_time, e.step, e.value)
                                              for e in acc.Scalars(tag))
    return {k: sorted(v, key=lambda e: e[0]) for k, v in series.items()}, min(starts, default=None)


def phase_shares(phase_seconds: dict[str, float], wall: float) -> dict | None:
    """Each phase's seconds over the wall time, and "other": the time no phase took. With a
    sampler process (APPO, --async-sampling: it logs sampler_wait) its phases overlap the
    learner's, so "other" is what the learner's phases leave."""
    if not wall:
        return None
    own = [v for k, v in phase_seconds.items()
           if "sampler_wait" not in phase_seconds or k not in SAMPLER_PHASES]
    return {**{k: v / wall for k, v in phase_seconds.items()}, "other": 1 - sum(own) / wall}
