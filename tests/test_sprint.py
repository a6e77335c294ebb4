"""benchmarks/sprint.py: the recipe's sizes, the time-to-score reading against a reference
computation, a short sprint on the synthetic Catch game (report, PNG, CSV, a target reached and
one not), and one-line refusals that write nothing."""

import csv
import json

import pytest
import tyro

from tests.conftest import ROOT, load_algo, run_python

from benchmarks import sprint, training  # noqa: E402

CATCH = ("--env-id", "tests.catch_env:Catch-v0", "--no-cuda", "--window", "20", "--no-speed-mode",
         "--extra=--num-steps 32 --learning-rate 1e-3")


def run_sprint(*args: str, timeout: float = 300):
    return run_python(ROOT / "benchmarks" / "sprint.py", *args, timeout=timeout)


def flag(flags: list[str], name: str) -> str:
    return flags[flags.index(name) + 1]


@pytest.mark.parametrize("cores, envs, steps", [(2, 24, 256), (16, 64, 96), (10, 40, 160)])
def test_recipe_scales_envs_with_cores_and_keeps_rl_games_batch(cores, envs, steps):
    """At least 24 envs, 4 per core; the batch near 6,144 in 8 minibatches whatever the cores
    (rl_games' 24 x 256 in minibatches of 768); the rest rl_games' settings, flags the script
    takes."""
    flags = sprint.recipe(cores)
    assert (int(flag(flags, "--num-envs")), int(flag(flags, "--num-steps"))) == (envs, steps)
    batch = envs * steps
    assert 6144 <= batch < 6144 + 8 * envs and batch % 8 == 0
    a = tyro.cli(load_algo("ppo_multigpu").Args, args=flags)
    assert (a.num_envs, a.num_steps, a.num_minibatches, a.update_epochs) == (envs, steps, 8, 3)
    assert (a.clip_coef, a.clip_vloss, a.learning_rate, a.kl_threshold) == (0.2, False, 3e-4, 0.01)
    assert (a.gamma, a.gae_lambda, a.vf_coef, a.max_grad_norm) == (0.999, 0.95, 1.0, 10.0)
    assert a.normalize_input and a.normalize_value and a.activation == "elu"


@pytest.mark.parametrize("algo, script, ranks", [
    ("ppo", "ppo_multigpu", None), ("appo", "appo_async", None), ("a2c", "a2c_multigpu", None),
    ("a3c", "a2c_multigpu", 2)])
def test_each_algo_recipe_is_flags_its_script_takes(algo, script, ranks):
    """--algo picks the script and its recipe: APPO PPO's recipe (the same loss, lag-corrected),
    A2C 32 envs x 4 steps with Adam 3e-3 (epsilon 1e-3), a 0.1 gradient clip and a squared
    error of weight 1 (Lapan's Pong settings), A3C the same split over 2 ranks at Lapan's A3C
    rate of 1e-3; the script's own parser takes every flag."""
    got_script, got_ranks, flags = sprint.algo_recipe(algo, 2)
    assert (got_script, got_ranks) == (script, ranks)
    a = tyro.cli(load_algo(script).Args, args=flags)
    if algo in ("ppo", "appo"):
        assert flags == sprint.recipe(2)
        assert (a.num_envs, a.num_steps, a.num_minibatches, a.update_epochs) == (24, 256, 8, 3)
        assert (a.learning_rate, a.kl_threshold, a.activation) == (3e-4, 0.01, "elu")
        assert a.normalize_input and a.normalize_value and not a.clip_vloss
    else:
        assert a.num_envs * (ranks or 1) == 32 and a.num_steps == 4
        assert (a.optimizer, a.learning_rate, a.anneal_lr, a.max_grad_norm) == (
            "adam", 1e-3 if ranks else 3e-3, False, 0.1)
        assert (a.adam_eps, a.vf_coef) == (1e-3, 2.0)  # 2 x 0.5 (V - R)^2: Lapan's MSE
        assert a.asynchronous == (algo == "a3c") and a.lr_scaling == "none"
        assert a.gae_lambda == 1.0 and a.gamma == 0.99  # n-step returns, as Lapan's


def test_report_commands_carry_no_machine_paths(tmp_path):
    """The JSON's command as a user types it: python, the script relative to the checkout, the
    run directory under <out>."""
    import sys
    folder = tmp_path / "sprint"
    cmd = [sys.executable, "-m", "torch.distributed.run", str(ROOT / "algos" / "a2c.py"),
           "--run-dir", str(folder / "run"), "--resume", "/elsewhere/x", "--seed", "1"]
    assert training.as_typed(cmd, folder) == [
        "python", "-m", "torch.distributed.run", "algos/a2c.py", "--run-dir", "<out>/run",
        "--resume", "/elsewhere/x", "--seed", "1"]


def test_committed_sprint_reports_carry_no_machine_paths():
    for path in (ROOT / "benchmarks" / "results").glob("sprint-*.json"):
        r = json.loads(path.read_text())
        assert r["command"][0] == "python" and not any(
            a.startswith(("/", str(ROOT))) for a in r["command"]), path.name


def test_speed_flags_are_the_mode_measured_fastest_on_the_device():
    """bf16 and compiled on a CPU with bf16 units (docs/results.md), nothing on a GPU until one
    is measured; flags the script takes."""
    cpuinfo = open("/proc/cpuinfo").read()
    bf16 = "avx512_bf16" in cpuinfo or "amx_bf16" in cpuinfo
    assert sprint.speed_flags("cpu") == (["--precision", "bf16", "--compile"] if bf16 else [])
    assert sprint.speed_flags("cuda") == []
    a = tyro.cli(load_algo("ppo_multigpu").Args, args=sprint.recipe(2) + ["--precision", "bf16",
                                                                         "--compile"])
    assert a.precision == "bf16" and a.compile


def reference_time_to(games, target, window):
    for i in range(window - 1, len(games)):
        mean = sum(g[2] for g in games[i - window + 1:i + 1]) / window
        if mean >= target:
            return games[i][0], games[i][1], i + 1
    return None


def test_time_to_matches_a_reference_and_needs_a_full_window():
    rng = __import__("random").Random(0)
    games = [(0.5 * i, 100 * i, rng.choice([-1.0, 1.0]) + i / 200) for i in range(400)]
    for target in (-0.5, 0.0, 0.5, 1.0, 1.5, 2.5):
        hit, ref = sprint.time_to(games, target, 20), reference_time_to(games, target, 20)
        assert (hit and (hit["seconds"], hit["step"], hit["games"])) == (ref or None), target
    # a high first game is not a mean of 3
    assert sprint.time_to([(1, 1, 30.0), (2, 2, 0.0), (3, 3, 0.0)], 10.0, 3)["games"] == 3
    assert sprint.time_to([(1, 1, 30.0), (2, 2, 0.0)], 10.0, 3) is None
    assert sprint.running_means([1.0, 3.0, 5.0, 7.0], 2) == [1.0, 2.0, 4.0, 6.0]


@pytest.mark.slow
def test_sprint_on_catch_reports_times_and_writes_png_and_csv(tmp_path):
    """A 20-second budget: -0.95 (a random policy's mean is about -0.6) is reached, 2 never."""
    out = tmp_path / "s"
    proc = run_sprint(*CATCH, "--minutes", "0.33", "--targets", "-0.95", "2",
                      "--eval-episodes", "4", "--out", str(out))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    r = json.loads((out / "sprint.json").read_text())
    assert r["cores"] == len(__import__("os").sched_getaffinity(0))
    assert r["stopped_by_budget"] and r["envs"] == max(24, r["cores"] * 4)
    assert r["steps"] > 0 and r["steps_per_s_overall"] > 0 and r["games"] >= 20
    assert 0 < r["train_seconds"] < 0.33 * 60 + sprint.STOP_GRACE
    rows = list(csv.DictReader(open(out / "sprint.csv")))
    assert len(rows) == r["games"]
    reached, missed = r["targets"]
    assert missed == {"target": 2.0, "minutes": None, "seconds": None, "step": None,
                      "games": None}
    games = [(float(x["seconds"]), int(x["step"]), float(x["score"])) for x in rows]
    ref = reference_time_to(games, -0.95, 20)
    assert (round(reached["seconds"], 2), reached["step"], reached["games"]) == ref
    assert 0 < reached["seconds"] <= r["train_seconds"]
    ev = r["final_eval"]
    assert ev["games"] == 4 and ev["cut_games"] == 0 and -1 <= ev["mean"] <= 1
    assert (out / "sprint.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "not reached" in proc.stdout and "| -0.95 (mean of last 20) |" in proc.stdout
    assert (out / "run" / "summary.json").is_file()


@pytest.mark.slow
@pytest.mark.parametrize("algo", ["appo", "a2c", "a3c"])
def test_each_algo_sprints_on_catch(algo, tmp_path):
    """The other scripts' sprints end the same way: the budget stops the run, a target is timed,
    the report names the script and its ranks, and holds no machine path."""
    out = tmp_path / "s"
    extra = ("--extra=--num-steps 32 --learning-rate 1e-3",) if algo == "appo" else ()
    proc = run_sprint("--algo", algo, *CATCH[:5], "--no-speed-mode", *extra, "--minutes", "0.33",
                      "--targets", "-0.95", "--eval-episodes", "0", "--out", str(out))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    r = json.loads((out / "sprint.json").read_text())
    script, ranks, _ = sprint.algo_recipe(algo, r["cores"])
    assert (r["algo"], r["script"], r["ranks"]) == (algo, script, ranks or 1)
    assert r["stopped_by_budget"] and r["steps"] > 0 and r["games"] >= 20
    assert r["envs"] == (24 if algo == "appo" else 32)
    assert r["targets"][0]["minutes"] is not None
    assert r["command"][:2] == (["python", "-m"] if ranks else ["python", f"algos/{script}.py"])
    assert str(tmp_path) not in (out / "sprint.json").read_text()
    assert r["sprint_command"][:4] == ["python", "benchmarks/sprint.py", "--algo", algo]
    assert f"sprint of {script}" in proc.stdout and "where the time went" in proc.stdout


@pytest.mark.parametrize("args, message", [
    (("--minutes", "0"), "--minutes must be positive, got 0.0"),
    (("--targets",), "--targets needs at least one score"),
    (("--window", "0"), "--window must be >= 1"),
    (("--cores", "0"), "--cores must be >= 1, got 0"),
    (("--extra", "'unclosed"), "--extra is not a valid flag string"),
])
def test_bad_input_is_one_line_and_writes_nothing(args, message, tmp_path):
    proc = run_sprint("--no-cuda", "--out", str(tmp_path / "s"), *args, timeout=60)
    assert proc.returncode == 2 and proc.stderr.strip().splitlines() == [
        f"error: {proc.stderr.strip()[7:]}"] and message in proc.stderr, proc.stderr
    assert not (tmp_path / "s").exists()


def test_existing_out_is_refused_untouched(tmp_path):
    (tmp_path / "mine.txt").write_text("a user's file")
    proc = run_sprint("--no-cuda", "--minutes", "1", "--out", str(tmp_path), timeout=60)
    assert proc.returncode == 2 and "exists" in proc.stderr and len(
        proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert [p.name for p in tmp_path.iterdir()] == ["mine.txt"]


def test_a_failing_training_run_ends_in_one_line(tmp_path):
    proc = run_sprint("--no-cuda", "--minutes", "1", "--env-id", "NoSuchGame-v5",
                      "--out", str(tmp_path / "s"), timeout=120)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    (line,) = proc.stderr.strip().splitlines()
    assert line.startswith("error: training exited") and "NoSuchGame" in line, line


def test_default_out_takes_the_next_free_name_under_runs(tmp_path, monkeypatch):
    monkeypatch.setattr(sprint.outputs, "RUNS", tmp_path)
    first = sprint.out_folder(sprint.Args(), "cpu")
    (first / "mine.txt").write_text("kept")
    second = sprint.out_folder(sprint.Args(), "cpu")
    assert first.parent == second.parent == tmp_path and second.name == first.name + "-2"
    assert (first / "mine.txt").read_text() == "kept" and not list(second.iterdir())
