"""tests/warm.py, the harness that runs scripts forked from a warm server: replies read late, a
run killed at its timeout with what it started, a stale kill, a server out of step replaced, and
the refusal to fork a server that has more than one thread. Servers here preload only `json`, so
each test takes about a second."""

import os
import subprocess
import sys
import textwrap
import time

import pytest

from tests import warm
from tests.conftest import CHILD_ENV, ROOT

QUICK = "import sys\nprint('out', sys.argv[1:])\nprint('err', file=sys.stderr)\nsys.exit(3)\n"


@pytest.fixture
def server():
    s = warm.Server({**os.environ, **CHILD_ENV}, preload=("json",))
    yield s
    if s.in_step:
        s.close()


def _script(tmp_path, name, text):
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return str(path)


def _quick(server, tmp_path, *argv):
    proc = server.run(_script(tmp_path, "quick.py", QUICK), list(argv), str(tmp_path), timeout=60)
    assert (proc.returncode, proc.stdout, proc.stderr) == (3, f"out {list(argv)}\n", "err\n")


def _gone(pid: int) -> bool:
    """True once pid has ended (polled for up to 10 s: the kill is asynchronous)."""
    for _ in range(200):
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":  # a zombie has ended too
                    return True
        except FileNotFoundError:
            return True
        time.sleep(0.05)
    return False


def test_replies_read_late_come_back_at_once(server, tmp_path):
    """The lost reply: both reply lines are in the pipe before the test side reads the first.
    A buffered reader would take both with its first read and then wait out the timeout for a
    line it already holds (and raise TimeoutExpired); ours returns the status at once."""
    out, err = tmp_path / "out", tmp_path / "err"
    out.touch(), err.touch()
    for i in range(3):
        server.submit(_script(tmp_path, "quick.py", QUICK), [str(i)], str(tmp_path), str(out),
                      str(err))
        time.sleep(1.0)  # the child exits in milliseconds: both lines are waiting now
        assert server.collect(timeout=20) == 3
        assert out.read_text() == f"out ['{i}']\n"
    _quick(server, tmp_path, "next")  # and the next request is in step


def test_a_run_killed_at_its_timeout_takes_what_it_started_and_leaves_the_server_in_step(
        server, tmp_path):
    """A run past its timeout is killed with its process group (here a `sleep` it started, as
    torchrun starts ranks); the server then answers the next request with the right status."""
    pidfile = tmp_path / "grandchild"
    slow = _script(tmp_path, "slow.py", f"""\
        import subprocess, sys, time
        child = subprocess.Popen(["sleep", "600"])
        open({str(pidfile)!r}, "w").write(str(child.pid))
        print("started", flush=True)
        time.sleep(600)
        """)
    with pytest.raises(subprocess.TimeoutExpired) as e:
        server.run(slow, [], str(tmp_path), timeout=2)
    assert e.value.output == "started\n"
    assert _gone(int(pidfile.read_text()))
    assert server.in_step
    _quick(server, tmp_path, "after", "timeout")


def test_a_stale_kill_is_ignored(server, tmp_path):
    """A kill that reaches the server after its child ended (the timeout raced the exit) names a
    pid the server has reaped: it must not touch it, nor answer, nor hurt the next request."""
    _quick(server, tmp_path, "first")
    server._send({"kill": 1})  # a pid that is not the server's child
    server._send({"kill": os.getpid()})  # nor is this test process
    _quick(server, tmp_path, "second")


def test_a_server_out_of_step_is_replaced(server, tmp_path):
    """A reply that is not the one the protocol says comes next (here a status where a pid was
    due) closes the server; it refuses further requests, and conftest starts a new one."""
    server.replies.lines.append(b'{"pid": 1, "status": 0, "killed": false}')
    with pytest.raises(warm.OutOfStep, match=r"expected a reply with \['pid'\]"):
        server.run(_script(tmp_path, "quick.py", QUICK), [], str(tmp_path), timeout=60)
    assert not server.in_step and server.proc.returncode is not None
    with pytest.raises(warm.OutOfStep, match="out of step"):
        server.submit("x.py", [], str(tmp_path), "o", "e")


def test_the_server_refuses_to_fork_with_a_second_thread(tmp_path):
    """An import that starts a thread (a BLAS pool, a future preload) would let children deadlock
    on locks the thread held at the fork: the server refuses with one line instead."""
    (tmp_path / "threaded.py").write_text(
        "import threading, time\nthreading.Thread(target=time.sleep, args=(600,), "
        "daemon=True).start()\n")
    env = {**os.environ, **CHILD_ENV, "PYTHONPATH": f"{tmp_path}:{ROOT}"}
    server = warm.Server(env, preload=("threaded",))
    with pytest.raises(warm.OutOfStep) as e:
        server.run(_script(tmp_path, "quick.py", QUICK), [], str(tmp_path), timeout=60)
    message = str(e.value)
    assert "\n" not in message and "the server has 2 threads" in message
    assert "refusing to fork" in message
    assert not server.in_step


def test_the_preloaded_server_has_one_thread():
    """The suite's own preload (torch, gymnasium, ale-py, ...) leaves the server with one thread
    under the tests' environment, so every fork is safe."""
    code = ("import sys; sys.path.insert(0, 'tests'); import warm\n"
            "for m in warm.PRELOAD: __import__(m)\nprint(warm.threads())")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env={**os.environ, **CHILD_ENV},
                         capture_output=True, text=True, timeout=300)
    assert out.stdout.strip() == "1", out.stderr
