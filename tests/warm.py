"""Run a script as `python algos/<script>.py ARGS` would, in a process forked from a warm one.

Importing torch and the rest costs a fresh interpreter about 2.4 s of CPU, more than many of the
suite's runs take after it (a refused flag, a 64-step resume); with some fifty such runs that was
a tenth of the suite's CPU on a 2-core machine. So each test worker starts this file once as a
server (`python tests/warm.py [MODULE ...]`): it imports `PRELOAD` (or the modules named), then
for each request forks a child that runs the script's `__main__` through runpy with the request's
argv, stdout and stderr (files) and working directory, and ends as the interpreter would
(SystemExit's code, a traceback and 1 for an exception, non-daemon threads joined, atexit
handlers run, streams flushed). The child is a new process, in a process group of its own, with
its own pid, exit code and default signal handlers; only the imports' CPU is saved.

Three rules keep the two sides in step, whatever the load on the machine:
- A fork copies one thread only; a lock another thread held stays locked in the child forever.
  So the server forks only while it has exactly one thread (counted by the kernel, so OpenMP and
  BLAS pools count too), and otherwise answers with an error line.
- Replies are read from the pipe's descriptor with `os.read` into a buffer of our own (`Lines`),
  never through a buffered file object, so a reply that has already arrived is never waited for.
- Only the server kills a child, and only its current one: it has not reaped it yet, so the pid
  (and its process group) cannot belong to anyone else. A kill for another pid is ignored.

Protocol, one JSON line each way: request {path, argv, cwd, out, err} -> {"pid"} (or {"error"}),
then {"pid", "status", "killed"} once the child ends; {"kill": pid} asks for the running child's
process group to be killed. On end of input the server kills its child and exits.
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import time
from collections import deque

PRELOAD = ("torch", "torch.nn", "torch.distributions", "torch.utils.tensorboard", "numpy",
           "gymnasium", "ale_py", "ale_py.vector_env", "tyro")


class Lines:
    """JSON lines from a file descriptor, read with os.read into our own buffer: what select()
    says about the descriptor is then the whole truth about what is left to read."""

    def __init__(self, fd: int):
        self.fd, self.partial, self.lines = fd, b"", deque()

    def pop(self) -> dict | None:
        """A line already received, or None."""
        return json.loads(self.lines.popleft()) if self.lines else None

    def fill(self) -> bool:
        """One read of what the descriptor has (it must be readable); False at end of input."""
        data = os.read(self.fd, 1 << 16)
        *whole, self.partial = (self.partial + data).split(b"\n")
        self.lines.extend(whole)
        return bool(data)

    def get(self, timeout: float | None) -> dict | None:
        """The next line; None if none came within timeout seconds; EOFError at end of input."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self.lines:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not select.select([self.fd], [], [], left)[0]:
                return None
            if not self.fill():
                raise EOFError
        return self.pop()


def threads() -> int:
    """This process's threads as the kernel counts them (Python's and native ones alike)."""
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:  # no /proc: Python's own count is the best there is
        import threading
        return threading.active_count()


def _child(req: dict) -> None:
    import atexit
    import runpy
    import threading
    import traceback

    code = 0
    try:
        os.setpgid(0, 0)  # a timeout kills the run with everything it started (torchrun's ranks)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        for fd, name in ((1, req["out"]), (2, req["err"])):
            f = os.open(name, os.O_WRONLY | os.O_TRUNC)
            os.dup2(f, fd)
            os.close(f)
        os.chdir(req["cwd"])
        if req["path"].startswith("-m "):  # `python -m module`
            sys.argv = [req["path"][3:], *req["argv"]]
            sys.path[0] = req["cwd"]
            runpy.run_module(req["path"][3:], run_name="__main__", alter_sys=True)
        else:
            sys.argv = [req["path"], *req["argv"]]
            sys.path[0] = os.path.dirname(req["path"])  # as `python path` sets it
            runpy.run_path(req["path"], run_name="__main__")
    except SystemExit as e:
        if e.code is None or isinstance(e.code, int):
            code = e.code or 0
        else:
            print(e.code, file=sys.stderr)
            code = 1
    except BaseException:
        traceback.print_exc()
        code = 1
    finally:
        threading._shutdown()  # what the interpreter's exit does, in its order
        atexit._run_exitfuncs()
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        os._exit(code)


def _reply(msg: dict) -> None:
    os.write(1, (json.dumps(msg) + "\n").encode())


def _kill_group(pid: int) -> None:
    for kill in (os.killpg, os.kill):  # safe: pid is our unreaped child, so neither its pid
        try:                           # nor its group id can have been reused
            kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def serve(preload: tuple[str, ...] = PRELOAD) -> None:
    for name in preload:
        __import__(name)
    inbox, pending = Lines(0), deque()
    while True:
        try:
            req = pending.popleft() if pending else inbox.get(None)
        except EOFError:
            return
        if "kill" in req:  # for a child that ended before the kill came: nothing to do
            continue
        if (n := threads()) != 1:
            _reply({"error": f"tests/warm.py: the server has {n} threads, so a forked child could "
                             "deadlock on a lock another thread held; refusing to fork (an import "
                             "started them: set OMP_NUM_THREADS=1 or drop it from the preload)"})
            continue
        pid = os.fork()
        if pid == 0:
            _child(req)
        try:  # the child does the same: the group exists before either side goes on
            os.setpgid(pid, pid)
        except OSError:
            pass
        _reply({"pid": pid})
        ended, killed = os.pidfd_open(pid), False
        try:
            while True:
                while (msg := inbox.pop()) is not None:
                    if msg.get("kill") == pid:
                        _kill_group(pid)
                        killed = True
                    elif "kill" not in msg:
                        pending.append(msg)  # a request sent early: answered in its turn
                if ended in select.select([inbox.fd, ended], [], [])[0]:
                    break
                if not inbox.fill():  # the test process is gone: so goes its run
                    _kill_group(pid)
                    os.waitpid(pid, 0)
                    return
        finally:
            os.close(ended)
        _, status = os.waitpid(pid, 0)
        _reply({"pid": pid, "status": os.waitstatus_to_exitcode(status), "killed": killed})


STARTED, ENDED = {"pid"}, {"pid", "status", "killed"}  # the two replies to a request


class OutOfStep(RuntimeError):
    """The server said something other than what the protocol says next; it is not reused."""


class Server:
    """The test side: one server per test thread, started on first use. A server that got out of
    step (`in_step` False) is closed here and must be replaced, never reused."""

    def __init__(self, env: dict, preload: tuple[str, ...] | None = None):
        argv = [sys.executable, __file__, *(preload if preload is not None else ())]
        self.proc = subprocess.Popen(argv, env=env, stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, bufsize=0)
        self.replies, self.in_step = Lines(self.proc.stdout.fileno()), True

    def close(self) -> None:
        """End the server; at the end of its input it kills and reaps its running child."""
        self.in_step = False
        self.proc.stdin.close()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.proc.stdout.close()

    def _send(self, msg: dict) -> None:
        self.proc.stdin.write((json.dumps(msg) + "\n").encode())

    def _expect(self, keys: set[str], timeout: float) -> dict | None:
        try:
            msg = self.replies.get(timeout)
        except EOFError:
            self.close()
            raise OutOfStep(f"tests/warm.py server ended (code {self.proc.returncode})") from None
        if msg is not None and "error" in msg:
            self.close()
            raise OutOfStep(msg["error"])
        if msg is not None and set(msg) != keys:
            self.close()
            raise OutOfStep(f"tests/warm.py: expected a reply with {sorted(keys)}, got {msg}")
        return msg

    def submit(self, path: str, argv: list[str], cwd: str, out: str, err: str) -> None:
        """Send a request; `collect` reads its replies."""
        if not self.in_step:
            raise OutOfStep("tests/warm.py: this server is out of step; start a new one")
        self._send({"path": path, "argv": argv, "cwd": cwd, "out": out, "err": err})

    def collect(self, timeout: float, start_timeout: float = 600) -> int:
        """The exit status of the request submitted last; the run is killed after timeout
        seconds (counted from its pid's reply) and TimeoutError raised. start_timeout bounds the
        server's imports on a first request."""
        first = self._expect(STARTED, start_timeout)
        if first is None:
            self.close()
            raise OutOfStep(f"tests/warm.py: no pid within {start_timeout} s")
        pid = first["pid"]
        done = self._expect(ENDED, timeout)
        if done is None:
            self._send({"kill": pid})
            done = self._expect(ENDED, 60)
            if done is None:
                self.close()
                raise OutOfStep(f"tests/warm.py: run {pid} not ended 60 s after its kill")
        if done["pid"] != pid:
            self.close()
            raise OutOfStep(f"tests/warm.py: status for pid {done['pid']}, expected {pid}")
        if done["killed"]:
            raise TimeoutError(pid)
        return done["status"]

    def run(self, path: str, argv: list[str], cwd: str, timeout: float):
        """`python path *argv` (path "-m module": `python -m module *argv`) in cwd: a
        CompletedProcess (returncode, stdout, stderr); subprocess.TimeoutExpired after timeout
        seconds, the run and what it started killed."""
        with tempfile.NamedTemporaryFile("r") as out, tempfile.NamedTemporaryFile("r") as err:
            self.submit(path, argv, cwd, out.name, err.name)
            try:
                status = self.collect(timeout)
            except TimeoutError:
                raise subprocess.TimeoutExpired([path, *argv], timeout, out.read(),
                                                err.read()) from None
            return subprocess.CompletedProcess([path, *argv], status, out.read(), err.read())


if __name__ == "__main__":
    serve(tuple(sys.argv[1:]) or PRELOAD)
