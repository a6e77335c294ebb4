"""Resume that is always right, and runs that survive faults (common/checkpoint.py, cli.py,
dist.py).

Regression tests for the three resume bugs (schedule after a world-size change, a copied run
writing into its original, flags read on every rank's own disk), then the faults: a killed worker
under torchrun's restarts, a hung worker, a damaged newest checkpoint, a full disk, bounded disk,
the same command run twice with `--resume auto`, the stop line's command, and a run killed
outright that resumes from its checkpoint on the clock.
"""

import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from common import checkpoint, runs
from tests.conftest import (CHILD_ENV, ROOT, assert_stopped_with_checkpoint, load_algo,
                            read_summary, run_script, run_two_ranks)

CATCH = ("--env-id", "tests.catch_env:Catch-v0", "--num-envs", "4", "--num-steps", "16")


def _scalars(run_dir: Path, tag: str) -> list[tuple[int, float]]:
    """(step, value) of a tag over the whole run directory, as TensorBoard shows it: events an
    interrupted attempt wrote after the step a resume continued from are purged."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    acc = EventAccumulator(str(run_dir), size_guidance={"scalars": 0})
    acc.Reload()
    return [(e.step, e.value) for e in acc.Scalars(tag)]


def _model(path: Path) -> dict:
    return torch.load(path, weights_only=True)["model"]


def _launch(args, nproc=1, restarts=0, cwd=ROOT, script="ppo_multigpu"):
    """Start a script as a user would, in its own process group (so nothing can outlive a test)."""
    env = {**os.environ, **CHILD_ENV}
    path = str(ROOT / "algos" / f"{script}.py")
    cmd = ([sys.executable, "-m", "torch.distributed.run", "--standalone",
            f"--nproc_per_node={nproc}", f"--max-restarts={restarts}", path] if nproc > 1
           else [sys.executable, path])
    return subprocess.Popen(cmd + ["--no-cuda", *args], cwd=cwd, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            start_new_session=True)


def _workers(marker: str, cwd: Path | None = None) -> dict[int, int]:
    """{rank: pid} of the live worker processes whose command line contains `marker` (and that
    run in `cwd`, if given)."""
    found = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmd = b" ".join(Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0"))
            if marker.encode() not in cmd or b"torch.distributed.run" in cmd:
                continue
            if cwd is not None and Path(os.readlink(f"/proc/{pid}/cwd")) != cwd:
                continue
            env = dict(kv.split(b"=", 1) for kv in
                       Path(f"/proc/{pid}/environ").read_bytes().split(b"\0") if b"=" in kv)
            state = Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0]
            if state != "Z":
                found[int(env.get(b"RANK", b"0"))] = int(pid)
        except (FileNotFoundError, ProcessLookupError, PermissionError):
            continue
    return found


def _read_until(proc, predicate, timeout=240) -> str:
    out, t0 = [], time.time()
    for line in proc.stdout:
        out.append(line)
        if predicate(line) or time.time() - t0 > timeout:
            break
    return "".join(out)


# ---- the three reproduced bugs --------------------------------------------------------------

@pytest.mark.slow
def test_resume_on_two_ranks_from_a_one_rank_checkpoint_continues_the_schedule(tmp_path):
    """Bug 1: the learning-rate annealing followed the iteration count, so a resume with another
    global batch set it to 0 and the parameters froze. It now follows the global step."""
    run = tmp_path / "run"
    run_script("ppo_multigpu", *CATCH, "--total-timesteps", "1024", "--checkpoint-interval",
               "512", "--num-minibatches", "1", "--update-epochs", "1", "--run-dir", str(run))
    ckpt = run / "checkpoints" / "step_512.pt"
    before = _model(ckpt)
    run_script("ppo_multigpu", "--resume", str(ckpt), nproc=2)  # global batch 64 -> 128
    s = read_summary(run)
    assert s["global_step"] == 1024 and s["world_size"] == 2 and s["restarts"] == 1
    lrs = _scalars(run, "charts/learning_rate")
    assert [step for step, _ in lrs] == list(range(64, 513, 64)) + list(range(640, 1025, 128))
    # (the first attempt's events after step 512 are purged: TensorBoard shows one history)
    for step, lr in lrs:  # lr at an iteration = 2.5e-4 * (1 - global step before it / total)
        batch = 64 if step <= 512 else 128
        assert lr == pytest.approx(2.5e-4 * (1 - (step - batch) / 1024), rel=1e-5), step
    after = _model(run / "checkpoints" / "step_1024.pt")
    assert any(not torch.equal(before[k], after[k]) for k in before)  # learning went on


def test_a_copied_run_resumes_into_the_copy_and_keeps_its_episodes(tmp_path):
    """Bug 2: the saved args.json carried the original run_dir, so resuming a copy wrote into
    the original. Also: summary.json's episode count survives a resume."""
    a, b = tmp_path / "a", tmp_path / "b"
    run_script("a2c_multigpu", *CATCH[:4], "--num-steps", "5", "--total-timesteps", "400",
               "--run-dir", str(a))
    shutil.copytree(a, b)
    snapshot = {p.relative_to(a): (p.read_bytes(), p.stat().st_mtime_ns)
                for p in a.rglob("*") if p.is_file()}
    episodes_before = read_summary(a)["episodes"]
    assert episodes_before > 0

    run_script("a2c_multigpu", "--resume", str(b), "--total-timesteps", "800")
    assert {p.relative_to(a): (p.read_bytes(), p.stat().st_mtime_ns)
            for p in a.rglob("*") if p.is_file()} == snapshot  # the original is untouched
    s = read_summary(b)
    assert s["global_step"] == 800 and (b / "checkpoints" / "step_800.pt").is_file()
    assert json.loads((b / "args.json").read_text())["run_dir"] == str(b)
    assert s["episodes"] > episodes_before  # counts the episodes before the resume too
    assert s["restarts"] == 1


def _parse_in_other_cwd(rank, run_rel, cwd0, out):
    """Rank 1 runs where the run directory cannot be seen (as on another node)."""
    os.chdir(cwd0 if rank == 0 else Path(out).parent / "elsewhere")
    from common import cli, dist
    ppo = load_algo("ppo_multigpu")
    # a larger budget: resuming the finished run as it is would leave it alone and exit
    args, world = cli.parse_args(ppo.Args, ["--resume", run_rel, "--no-cuda",
                                            "--total-timesteps", "128"])
    Path(f"{out}.{rank}").write_text(json.dumps(vars(args)))
    dist.cleanup()


def test_every_rank_takes_the_saved_flags_from_rank_0(tmp_path):
    """Bug 3: each rank read args.json from its own disk; a rank that could not see it ran with
    default flags, and the ranks' collectives no longer matched (a hang)."""
    run = tmp_path / "run"
    run_script("ppo_multigpu", *CATCH, "--num-minibatches", "2", "--total-timesteps", "64",
               "--run-dir", str(run))
    (tmp_path / "elsewhere").mkdir()
    run_two_ranks(_parse_in_other_cwd, "run", str(tmp_path), str(tmp_path / "args"))
    r0, r1 = (json.loads((tmp_path / f"args.{r}").read_text()) for r in (0, 1))
    assert r0 == r1
    assert r1["num_envs"] == 4 and r1["num_steps"] == 16 and r1["num_minibatches"] == 2
    assert r1["resume"] == "run/checkpoints/step_64.pt"


def test_optimizer_flags_of_the_resume_apply_and_its_statistics_are_restored():
    from common import checkpoint, dist
    world = dist.World(0, 0, 1, torch.device("cpu"))
    model = torch.nn.Linear(3, 2)
    old = torch.optim.RMSprop(model.parameters(), lr=1e-3, alpha=0.99, eps=1e-5)
    model(torch.randn(5, 3)).sum().backward()
    old.step()
    state = {"model": model.state_dict(), "optimizer": old.state_dict(), "global_step": 7}
    new = torch.optim.RMSprop(model.parameters(), lr=1e-3, alpha=0.5, eps=1e-3)
    assert checkpoint.restore(state, world, model=model, optimizer=new) == 7
    assert new.param_groups[0]["alpha"] == 0.5 and new.param_groups[0]["eps"] == 1e-3
    square_avg = old.state[old.param_groups[0]["params"][0]]["square_avg"]
    assert torch.equal(new.state[new.param_groups[0]["params"][0]]["square_avg"], square_avg)


def test_a2c_sets_omp_wait_policy_like_every_script():
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    code = ("import runpy, os, sys; sys.argv = ['x', '--help']\n"
            "try: runpy.run_path('algos/a2c_multigpu.py', run_name='__main__')\n"
            "except SystemExit: pass\n"
            "print('POLICY', os.environ.get('OMP_WAIT_POLICY'))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=120).stdout
    assert "POLICY PASSIVE" in out


# ---- faults ---------------------------------------------------------------------------------

@pytest.mark.slow
def test_killed_worker_is_restarted_by_torchrun_and_the_run_finishes(tmp_path):
    """SIGKILL one worker under `torchrun --max-restarts 1`, with no --run-dir (the default name
    holds the start time): the restarted group finds its run, loads the newest checkpoint and
    finishes at --total-timesteps."""
    proc = _launch([*CATCH, "--num-minibatches", "1", "--update-epochs", "1",
                    "--total-timesteps", "2048", "--checkpoint-interval", "256",
                    "--keep-checkpoints", "0", "--seed", "5"], nproc=2, restarts=1, cwd=tmp_path)
    head = _read_until(proc, lambda ln: ln.startswith("step") and int(
        ln.split()[1].split("/")[0].replace(",", "")) >= 768)
    os.kill(_workers("ppo_multigpu.py", cwd=tmp_path)[1], signal.SIGKILL)
    out = head + proc.communicate(timeout=300)[0]
    assert proc.returncode == 0, out
    runs = list((tmp_path / "runs").iterdir())
    assert len(runs) == 1, runs  # the restart continued the first attempt's directory
    s = read_summary(runs[0])
    assert s["global_step"] == 2048 and s["restarts"] == 1
    line = next(ln for ln in out.splitlines() if ln.startswith("resumed from"))
    from common import checkpoint
    resumed = tmp_path / line.split()[2]
    # the newest complete checkpoint when rank 1 died: 512, or 768 if its save had finished
    assert resumed.parent == runs[0] / "checkpoints" and int(resumed.stem[5:]) in (512, 768)
    assert f"(model {checkpoint.fingerprint(_model(resumed))})" in line
    steps = [step for step, _ in _scalars(runs[0], "charts/SPS")]
    assert steps == sorted(set(steps)) and steps[-1] == 2048  # charts continue, no duplicates


@pytest.mark.slow
def test_hung_worker_ends_the_run_within_the_timeout(tmp_path):
    """SIGSTOP one worker: the other's collective fails after --collective-timeout, it says why
    and exits, torchrun stops the group, and no process is left behind."""
    run = tmp_path / "run"
    proc = _launch([*CATCH, "--total-timesteps", "10000000", "--collective-timeout", "5",
                    "--run-dir", str(run)], nproc=2)
    head = _read_until(proc, lambda ln: ln.startswith("step"))
    workers = _workers(str(run))
    os.kill(workers[1], signal.SIGSTOP)
    t0 = time.time()
    try:
        out = head + proc.communicate(timeout=150)[0]
    finally:
        os.killpg(proc.pid, signal.SIGKILL) if proc.poll() is None else None
    assert proc.returncode != 0
    assert "no progress for 5 s (--collective-timeout)" in out, out
    assert time.time() - t0 < 120  # 5 s timeout, then torchrun's own grace period to stop rank 1
    time.sleep(1)
    assert not _workers(str(run)), "a worker outlived the run"


def _save_five(tmp_path, keep):
    from common import checkpoint, dist
    world = dist.World(0, 0, 1, torch.device("cpu"))
    (tmp_path / "checkpoints").mkdir()
    for step in range(100, 600, 100):
        checkpoint.save(tmp_path, world, step, keep, {"x": torch.full((3,), float(step))},
                        rank_state={"shard": torch.arange(step)})
    return checkpoint, world


def test_keep_checkpoints_leaves_the_newest(tmp_path):
    _save_five(tmp_path, keep=2)
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == [
        "step_400.pt", "step_400.pt.sha256", "step_400.rank0.pt", "step_400.rank0.pt.sha256",
        "step_500.pt", "step_500.pt.sha256", "step_500.rank0.pt", "step_500.rank0.pt.sha256"]


@pytest.mark.parametrize("damage", ["truncate", "bitflip", "empty"])
def test_a_damaged_newest_checkpoint_is_skipped_for_the_previous_one(tmp_path, damage, capsys):
    checkpoint, world = _save_five(tmp_path, keep=0)
    newest = tmp_path / "checkpoints" / "step_500.pt"
    data = bytearray(newest.read_bytes())
    if damage == "truncate":
        data = data[:len(data) // 2]
    elif damage == "bitflip":
        data[len(data) // 2] ^= 0x04  # inside the tensor data: torch.load alone would not notice
    else:
        data = b""
    newest.write_bytes(bytes(data))
    assert checkpoint.newest_good(tmp_path) == tmp_path / "checkpoints" / "step_400.pt"
    assert f"skipping checkpoint {newest}" in capsys.readouterr().err
    assert checkpoint.load_rank_state(tmp_path, 400, world)["shard"].numel() == 400


def test_a_resume_uses_the_previous_checkpoint_when_the_newest_is_damaged(tmp_path):
    run = tmp_path / "run"
    run_script("ppo_multigpu", *CATCH, "--total-timesteps", "256", "--checkpoint-interval", "64",
               "--run-dir", str(run))
    newest = run / "checkpoints" / "step_256.pt"
    data = bytearray(newest.read_bytes())
    data[len(data) // 2] ^= 0x01
    newest.write_bytes(bytes(data))
    proc = run_script("ppo_multigpu", "--resume", str(run), "--total-timesteps", "320")
    assert f"skipping checkpoint {newest}: checksum mismatch" in proc.stderr
    assert f"resumed from {run / 'checkpoints' / 'step_192.pt'} at step 192" in proc.stdout
    assert read_summary(run)["global_step"] == 320


def test_a_full_disk_ends_the_run_with_one_line_and_keeps_the_previous_checkpoint(
        tmp_path, monkeypatch, capsys):
    from common import checkpoint, dist
    world = dist.World(0, 0, 1, torch.device("cpu"))
    (tmp_path / "checkpoints").mkdir()
    good = checkpoint.save(tmp_path, world, 10, 3, {"x": torch.ones(3)})

    def full(obj, f):
        f.write(b"half a checkpoint")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(torch, "save", full)
    with pytest.raises(SystemExit) as exit_:
        checkpoint.save(tmp_path, world, 20, 3, {"x": torch.zeros(3)})
    assert exit_.value.code == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "No space left on device" in err[0]
    assert "the previous checkpoint step_10.pt is intact" in err[0]
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == [
        "step_10.pt", "step_10.pt.sha256"]  # no half file, no temporary left
    monkeypatch.undo()
    assert checkpoint.newest_good(tmp_path) == good
    assert torch.equal(checkpoint.load(good)["x"], torch.ones(3))


def test_the_same_command_twice_with_resume_auto_continues_the_first_run(tmp_path):
    run = tmp_path / "run"
    cmd = [*CATCH, "--total-timesteps", "768", "--resume", "auto", "--run-dir", str(run)]
    proc = _launch(cmd)
    head = _read_until(proc, lambda ln: ln.startswith("step"))
    proc.send_signal(signal.SIGTERM)  # preempted
    out = head + proc.communicate(timeout=120)[0]
    assert proc.returncode == 0 and "stopped by signal" in out, out
    stopped_at = read_summary(run)["global_step"]
    assert 0 < stopped_at < 768

    proc = _launch(cmd)  # the requeued job: the very same command
    out = proc.communicate(timeout=300)[0]
    assert proc.returncode == 0, out
    assert f"resumed from {run / 'checkpoints' / f'step_{stopped_at}.pt'}" in out
    s = read_summary(run)
    assert s["global_step"] == 768 and s["restarts"] == 1


def test_the_stop_line_prints_the_command_that_continues_the_run(tmp_path):
    """The stop line gives the whole command, not a flag: run as printed (its `python` being
    this interpreter), it continues the run to its end."""
    run = tmp_path / "run"
    proc = _launch([*CATCH, "--total-timesteps", "768", "--run-dir", str(run)])
    head = _read_until(proc, lambda ln: ln.startswith("step"))
    proc.send_signal(signal.SIGTERM)
    out = head + proc.communicate(timeout=120)[0]
    assert proc.returncode == 0, out
    stopped_at = assert_stopped_with_checkpoint(run, out)
    command = out.split("continue with:\n")[1].splitlines()[0].strip()
    assert command == f"python algos/ppo_multigpu.py --resume {run} --no-cuda", out
    env = {**os.environ, **CHILD_ENV}
    proc = subprocess.run([sys.executable, *shlex.split(command)[1:]], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"resumed from {run / 'checkpoints' / f'step_{stopped_at}.pt'}" in proc.stdout
    assert read_summary(run)["global_step"] == 768


def test_a_default_run_killed_outright_resumes_from_its_checkpoint_on_the_clock(tmp_path):
    """Checkpoints come on the wall clock by default (--checkpoint-minutes, 10; 3 s here), so a
    run killed outright (SIGKILL: an out-of-memory kill, a lost machine) keeps its progress."""
    run = tmp_path / "run"
    proc = _launch([*CATCH, "--checkpoint-minutes", "0.05", "--eval-episodes", "0",
                    "--run-dir", str(run)])
    _read_until(proc, lambda ln: ln.startswith("step"))
    deadline = time.time() + 120
    while not list((run / "checkpoints").glob("step_*.pt")) and time.time() < deadline:
        time.sleep(0.2)
    time.sleep(0.5)  # the checksum and rename are atomic; give a second save no chance to matter
    proc.kill()
    proc.communicate(timeout=60)
    assert proc.returncode == -signal.SIGKILL
    newest = checkpoint.newest_good(run)
    assert newest is not None
    step = checkpoint.step_of(newest)
    out = run_script("ppo_multigpu", "--resume", str(run), "--total-timesteps",
                     str(step + 128)).stdout
    assert f"resumed from {newest} at step {step:,}" in out, out
    s = read_summary(run)
    assert s["global_step"] == step + 128 and s["restarts"] == 1


def test_the_continue_command_has_the_launch_shape_and_launch_only_flags(monkeypatch):
    args = SimpleNamespace(run_dir="runs/x y", cuda=False, collective_timeout=60.0)
    monkeypatch.setattr(sys, "argv", [str(ROOT / "algos" / "dqn_multigpu.py")])
    monkeypatch.chdir(ROOT)
    for k in ("LOCAL_WORLD_SIZE", "WORLD_SIZE"):
        monkeypatch.delenv(k, raising=False)
    assert runs.continue_command(args) == ("python algos/dqn_multigpu.py --resume 'runs/x y' "
                                           "--no-cuda --collective-timeout 60")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    monkeypatch.setenv("WORLD_SIZE", "8")
    args = SimpleNamespace(run_dir="runs/r", cuda=True, collective_timeout=600.0)
    assert runs.continue_command(args) == ("torchrun --standalone --nproc_per_node 8 "
                                           "algos/dqn_multigpu.py --resume runs/r")
    monkeypatch.setenv("WORLD_SIZE", "16")
    assert runs.continue_command(args).startswith(
        "torchrun --nnodes 2 --nproc_per_node 8 --rdzv-backend c10d --rdzv-endpoint HOST:PORT "
        "algos/dqn_multigpu.py --resume runs/r")


def test_resuming_a_finished_run_says_so_and_changes_nothing(tmp_path):
    run = tmp_path / "run"
    run_script("ppo_multigpu", *CATCH, "--total-timesteps", "128", "--eval-episodes", "0",
               "--run-dir", str(run))

    def snapshot():
        return {p.relative_to(run): (p.stat().st_mtime_ns, p.read_bytes())
                for p in run.rglob("*") if p.is_file()}

    before = snapshot()
    for how in (str(run), "auto"):
        proc = run_script("ppo_multigpu", *CATCH, "--total-timesteps", "128", "--resume", how,
                          "--run-dir", str(run))
        assert f"run {run} already finished at step 128" in proc.stdout, proc.stdout
        assert "resumed" not in proc.stdout
        assert snapshot() == before
    assert read_summary(run)["restarts"] == 0
