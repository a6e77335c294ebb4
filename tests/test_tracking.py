"""--track: the Weights & Biases run of a training run, kept offline (WANDB_MODE=offline) and read
back from its .wandb file: the flags as its config, the TensorBoard scalars synced once each; and
the one line a missing wandb gives."""

import glob
import json
import os
import struct
import subprocess
import sys

import pytest

from tests.conftest import CHILD_ENV, ROOT, read_summary, scalar_tags

CATCH = "tests.catch_env:Catch-v0"
TINY = ("--env-id", CATCH, "--num-envs", "4", "--num-steps", "32", "--total-timesteps", "1024",
        "--eval-episodes", "2", "--eval-envs", "2", "--no-cuda", "--track",
        "--wandb-project-name", "accelrl-tests")


def records(path: str):
    """The protobuf records of a .wandb file: W&B's 7-byte header, then LevelDB's log format
    (32 KiB blocks of chunks, each a 7-byte header of checksum, length and type: 1 a whole
    record, 2-4 its first, middle and last parts)."""
    from wandb.proto import wandb_internal_pb2 as pb

    data, pos, part = open(path, "rb").read(), 7, b""
    while pos + 7 <= len(data):
        if 32768 - pos % 32768 < 7:  # a block's tail too short for a header is padding
            pos += 32768 - pos % 32768
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if length == 0 and kind == 0:
            break
        part, pos = part + data[pos + 7:pos + 7 + length], pos + 7 + length
        if kind in (1, 4):
            record = pb.Record()
            record.ParseFromString(part)
            part = b""
            yield record


def run(*args, env=None, code=None, cwd=ROOT):
    cmd = [sys.executable, *(["-c", code] if code else [str(ROOT / "algos" / "ppo_multigpu.py")]),
           *args]
    return subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=600,
                          env={**os.environ, **CHILD_ENV, "WANDB_MODE": "offline",
                               "WANDB_SILENT": "true", **(env or {})})


@pytest.mark.parametrize("where", ["absolute", "default"])
def test_offline_run_holds_the_config_and_each_scalar_once(tmp_path, where):
    """With an absolute --run-dir and with the default one, runs/<run> relative to the working
    directory (which once made W&B copy the events file into itself, link by link, and sync
    every scalar many times)."""
    if where == "absolute":
        run_dir = tmp_path / "run"
        proc = run(*TINY, "--run-dir", str(run_dir))
    else:
        proc = run(*TINY, cwd=tmp_path)
        (run_dir,) = (tmp_path / "runs").iterdir()
    assert proc.returncode == 0, proc.stderr[-2000:]
    (wandb_file,) = glob.glob(str(run_dir / "wandb" / "offline-run-*" / "run-*.wandb"))
    events = [p for p in run_dir.rglob("events.out.tfevents.*")]
    assert len(events) == 1 and events[0].parent == run_dir, events
    config, history = {}, {}
    for r in records(wandb_file):
        kind = r.WhichOneof("record_type")
        if kind == "run":
            assert r.run.display_name == run_dir.name  # the run directory's name, its id too
            assert r.run.run_id == run_dir.name.replace(".", "-")[-64:]
            config.update({i.key: json.loads(i.value_json) for i in r.run.config.update})
        elif kind == "config":
            config.update({i.key: json.loads(i.value_json) for i in r.config.update})
        elif kind == "history":
            step = {i.key or "/".join(i.nested_key): json.loads(i.value_json)
                    for i in r.history.item}
            for k, v in step.items():
                history.setdefault(k, []).append((step["global_step"], v))
    assert config["env_id"] == CATCH and config["total_timesteps"] == 1024 and config["track"]
    assert config["wandb_project_name"] == "accelrl-tests"
    # one W&B step per log call (8 iterations of 128 steps), each TensorBoard scalar synced once
    assert [s for s, _ in history["charts/SPS"]] == list(range(128, 1025, 128))
    assert scalar_tags(run_dir) <= set(history)
    assert [s for s, _ in history["charts/eval_return"]] == [1024]
    assert history["charts/eval_return"][0][1] == read_summary(run_dir)["eval_return"]


def test_without_wandb_track_ends_in_one_line(tmp_path):
    code = ("import runpy, sys; sys.modules['wandb'] = None; "  # import wandb raises ImportError
            f"runpy.run_path({str(ROOT / 'algos' / 'ppo_multigpu.py')!r}, run_name='__main__')")
    proc = run(*TINY, "--run-dir", str(tmp_path / "run"), code=code)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "error: --track sends the run to Weights & Biases, which is not installed: "
        "pip install wandb"]
    assert not (tmp_path / "run").exists()
