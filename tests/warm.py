"""Run a script as `python algos/<script>.py ARGS` would, in a process forked from a warm one.

Importing torch and the rest costs a fresh interpreter about 2.4 s of CPU, more than many of the
suite's runs take after it (a refused flag, a 64-step resume); with some fifty such runs that was
a tenth of the suite's CPU on a 2-core machine. So each test worker starts this file once as a
server (`python tests/warm.py`): it imports `PRELOAD`, then for each request forks a child that
runs the script's `__main__` through runpy with the request's argv, stdout and stderr (files) and
working directory, and ends as the interpreter would (SystemExit's code, a traceback and 1 for an
exception, non-daemon threads joined, atexit handlers run, streams flushed). The child is a new
process with its own pid, exit code and default signal handlers; only the imports' CPU is saved.
The server runs nothing but imports, so it is single-threaded and safe to fork (a pytest worker
that has run torch's thread pool is not). Protocol, one JSON line each way: request
{path, argv, cwd, out, err} -> {"pid"}, then {"status"} once the child ends.
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

PRELOAD = ("torch", "torch.nn", "torch.distributions", "torch.utils.tensorboard", "numpy",
           "gymnasium", "ale_py", "ale_py.vector_env", "tyro")


def _child(req: dict) -> None:
    import atexit
    import runpy
    import threading
    import traceback

    code = 0
    try:
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


def serve() -> None:
    for name in PRELOAD:
        __import__(name)
    reply = sys.stdout
    for line in sys.stdin:
        req = json.loads(line)
        pid = os.fork()
        if pid == 0:
            _child(req)
        print(json.dumps({"pid": pid}), file=reply, flush=True)
        _, status = os.waitpid(pid, 0)
        print(json.dumps({"status": os.waitstatus_to_exitcode(status)}), file=reply, flush=True)


class Server:
    """The test side: one server per test process, started on first use."""

    def __init__(self, env: dict):
        self.proc = subprocess.Popen([sys.executable, __file__], env=env, text=True,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE)

    def _read(self, deadline: float) -> dict | None:
        out = self.proc.stdout
        if not select.select([out], [], [], max(0.0, deadline - time.monotonic()))[0]:
            return None
        line = out.readline()
        if not line:
            raise RuntimeError(f"tests/warm.py server ended (code {self.proc.wait()})")
        return json.loads(line)

    def run(self, path: str, argv: list[str], cwd: str, timeout: float):
        """`python path *argv` (path "-m module": `python -m module *argv`) in cwd: a
        CompletedProcess (returncode, stdout, stderr)."""
        with tempfile.NamedTemporaryFile("r") as out, tempfile.NamedTemporaryFile("r") as err:
            self.proc.stdin.write(json.dumps({"path": path, "argv": argv, "cwd": cwd,
                                              "out": out.name, "err": err.name}) + "\n")
            self.proc.stdin.flush()
            deadline = time.monotonic() + timeout
            pid = self._read(time.monotonic() + 60)["pid"]
            done = self._read(deadline)
            if done is None:
                os.kill(pid, signal.SIGKILL)
                self._read(time.monotonic() + 60)
                raise subprocess.TimeoutExpired([path, *argv], timeout, out.read(), err.read())
            return subprocess.CompletedProcess([path, *argv], done["status"], out.read(),
                                               err.read())


if __name__ == "__main__":
    serve()
