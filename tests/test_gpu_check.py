"""benchmarks/gpu_check.py: the quick CPU run of every step end to end (one run, shared), a run
whose steps fail or time out, and the user errors that end it before any step."""

import json
import os
import subprocess
import sys

import pytest

from benchmarks import gpu_check, outputs
from tests.conftest import CHILD_ENV, ROOT, run_python

# One worker takes the whole module (`--dist loadgroup`): the quick run is its module fixture.
pytestmark = pytest.mark.xdist_group("gpu_check")

ROW_FIELDS = {"measurement", "steps_per_s", "vs_ceiling", "ratio", "phase_share",
              "gpu_memory_bytes", "notes", "key", "value"}
STEP_FIELDS = {"name", "title", "status", "timeout_s", "seconds", "cpu_seconds", "returncode",
               "log", "rows", "gpu_memory_bytes", "error"}


def gpu_check_run(*args: str, env: dict | None = None, timeout: float = 1200):
    if env is None:
        return run_python(ROOT / "benchmarks" / "gpu_check.py", *args, timeout=timeout)
    return subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"), *args],
                          cwd=ROOT, env={**os.environ, **CHILD_ENV, **(env or {})},
                          capture_output=True, text=True, timeout=timeout)


def written(out) -> tuple[dict, str]:
    """The one JSON and the one table a run wrote into an empty --out folder."""
    stem = out / f"gpu-check-{outputs.host()}-cpu"
    assert sorted(p.name for p in out.iterdir()) == sorted([stem.name, stem.name + ".json",
                                                             stem.name + ".md"])
    return json.loads(stem.with_name(stem.name + ".json").read_text()), \
        stem.with_name(stem.name + ".md").read_text()


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu_check")
    proc = gpu_check_run("--no-cuda", "--quick", "--out", str(out))
    return proc, *written(out)


@pytest.mark.slow
def test_quick_run_has_every_step_ok(quick):
    proc, report, _ = quick
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert [s["name"] for s in report["steps"]] == list(gpu_check.STEPS)
    assert {s["name"]: s["status"] for s in report["steps"]} == \
        dict.fromkeys(gpu_check.STEPS, "ok")
    assert report["failed"] == []


@pytest.mark.slow
def test_json_holds_every_field(quick):
    _, report, _ = quick
    hw = report["hardware"]
    assert hw["cores"] >= 1 and hw["torch"] and "CUDA" in hw["line"] and "driver" in hw["line"]
    assert report["device"] == "cpu" and report["ceiling_steps_per_s"] > 0
    for step in report["steps"]:
        assert set(step) == STEP_FIELDS and step["seconds"] > 0 and step["error"] is None
        assert step["rows"], step["name"]
        for r in step["rows"]:
            assert set(r) == ROW_FIELDS, (step["name"], r)
            assert r["steps_per_s"] is None or r["steps_per_s"] > 0, (step["name"], r)
            assert (r["ratio"] is not None) == r["vs_ceiling"], (step["name"], r)
            assert r["gpu_memory_bytes"] is None  # on the CPU
        # every step measures an env-steps rate, or (dqn, catdqn's in-process parts) a value
        assert any(r["steps_per_s"] for r in step["rows"]), step["name"]
        assert all(r["value"] > 0 for r in step["rows"] if r["value"] is not None)
    rows = {s["name"]: s["rows"] for s in report["steps"]}
    assert rows["ale"][0]["key"] == "ceiling" and rows["ale"][0]["ratio"] == 1
    for name in ("ppo", "a2c", "resume", "two_ranks"):  # summary.json's phases
        assert all(r["phase_share"]["learn"] > 0 for r in rows[name]), name
    assert "resumed from step" in rows["resume"][1]["notes"]
    assert {t["name"] for t in report["targets"] if t["value"] is not None} == \
        {t["name"] for t in report["targets"]}  # every target measured


@pytest.mark.slow
def test_table_lists_every_step_and_the_hardware(quick):
    proc, report, table = quick
    assert table == report["table_markdown"] and table.strip() in proc.stdout
    lines = table.splitlines()
    assert lines[0].startswith("| step | status | seconds | measurement | steps/s | / ceiling")
    for name in gpu_check.STEPS:
        assert any(line.startswith(f"| {name} | ok | ") for line in lines), name
    assert any(line.startswith("Hardware: ") and "cores" in line for line in lines)
    assert "Targets" in table


@pytest.mark.slow
def test_failed_and_timed_out_steps_are_reported_and_the_others_run(tmp_path):
    proc = gpu_check_run("--no-cuda", "--quick", "--out", str(tmp_path), "--steps", "ale",
                         "sampler", "ppo", "--timeouts", "ppo=1",
                         env={gpu_check.FAIL_VAR: "sampler"})
    assert proc.returncode == 1, proc.stderr
    report, table = written(tmp_path)
    status = {s["name"]: s for s in report["steps"]}
    assert [s["name"] for s in report["steps"]] == ["ale", "sampler", "ppo"]
    assert status["ale"]["status"] == "ok" and status["ale"]["rows"]
    assert status["sampler"]["status"] == "failed"
    assert "forced failure" in status["sampler"]["error"]
    assert status["ppo"]["status"] == "timeout" and status["ppo"]["timeout_s"] == 1
    assert status["ppo"]["error"].startswith("timed out after 1 s")
    assert report["failed"] == ["sampler", "ppo"]
    lines = table.splitlines()
    for name, state, note in (("ale", "ok", ""), ("sampler", "failed", "forced failure"),
                              ("ppo", "timeout", "timed out after 1 s")):
        assert any(line.startswith(f"| {name} | {state} | ") and note in line for line in lines)
    assert "failed: sampler, ppo" in proc.stderr


@pytest.mark.parametrize("args, message", [
    (["--steps", "ale", "warp"],
     "unknown step 'warp'; choose from sprint, ale, sampler, modes, ppo"),
    (["--timeouts", "ppo=soon"], "--timeouts takes NAME=SECONDS"),
    (["--timeouts", "nope=3"], "--timeouts takes NAME=SECONDS"),
])
def test_bad_input_gives_one_line_error(args, message, tmp_path):
    proc = gpu_check_run("--no-cuda", "--quick", "--out", str(tmp_path), *args, timeout=120)
    assert proc.returncode == 2 and proc.stderr.strip().splitlines() == [
        proc.stderr.strip()] and message in proc.stderr, proc.stderr
    assert not list(tmp_path.iterdir())  # refused before anything was written


def test_unwritable_out_gives_one_line_error(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    proc = gpu_check_run("--no-cuda", "--quick", "--out", str(blocker / "sub"), timeout=120)
    assert proc.returncode == 2 and proc.stderr.startswith("error: cannot write to --out"), \
        proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1


def test_outputs_never_overwrite_and_default_outside_results(tmp_path, monkeypatch):
    first = gpu_check.output_stem(str(tmp_path), "cpu")
    assert first == tmp_path / f"gpu-check-{outputs.host()}-cpu" and first.is_dir()
    assert gpu_check.output_stem(str(tmp_path), "cpu").name.endswith("-cpu-2")
    monkeypatch.setattr(outputs, "RUNS", tmp_path / "runs")
    default = gpu_check.output_stem(None, "cuda")
    assert default.parent == tmp_path / "runs" and outputs.RESULTS not in default.parents


def test_gpu_step_timeouts_fit_eight_minutes():
    assert sum(timeout for _, timeout, _ in gpu_check.STEPS.values()) <= 8 * 60
    assert set(gpu_check.parse_timeouts(("dqn=5",), quick=False).values()) >= {5.0}
