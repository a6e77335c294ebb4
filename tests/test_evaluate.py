"""benchmarks/evaluate.py on every script's checkpoints, its MP4 recording, its refusals; and
benchmarks/plot.py on ordinary run directories.

The tiny training runs (five scripts on Catch, PPO on Breakout for the video) are made once for
all pytest workers: the first worker to need them trains them under a file lock, as pytest-xdist
documents for fixtures that must run once. Tests therefore find the files that other tests wrote
into the same runs (eval.json, eval-2.json...) and check only what they wrote themselves.
"""

import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from filelock import FileLock

from tests.conftest import CHILD_ENV, ROOT, run_python, run_script

from benchmarks import evaluate, plot  # noqa: E402

# One worker takes the whole module (`--dist loadgroup`), so no other waits on the lock.
pytestmark = pytest.mark.xdist_group("evaluate")

CATCH = "tests.catch_env:Catch-v0"
TINY = ("--env-id", CATCH, "--num-envs", "2", "--total-timesteps", "128", "--eval-episodes", "0")
ONE_PASS = ("--update-epochs", "1", "--num-minibatches", "1")  # the weights need not learn
Q_TINY = ("--replay-size", "2000", "--batch-size", "32", "--learning-starts", "64",
          "--replay-ratio", "1")
RUNS = {  # the flags that give each network its variants: dueling heads, another C51 support
    "ppo_multigpu": (*TINY, *ONE_PASS, "--num-steps", "32", "--eval-episodes", "2",
                     "--eval-envs", "2", "--eval-interval", "64"),
    "a2c_multigpu": TINY,
    "appo_async": (*TINY, *ONE_PASS, "--num-steps", "32"),
    "dqn_multigpu": (*TINY, *Q_TINY, "--dueling"),
    "cat_dqn": (*TINY, *Q_TINY, "--num-atoms", "11", "--v-min", "-2", "--v-max", "2"),
    # 64 steps of Breakout finish no game: the plot must name the run
    "breakout": ("--env-id", "Breakout-v5", "--num-envs", "2", "--num-steps", "16", *ONE_PASS,
                 "--total-timesteps", "64", "--eval-episodes", "0", "--eval-max-steps", "200"),
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory, worker_id):
    shared = tmp_path_factory.getbasetemp()
    shared = shared.parent if worker_id != "master" else shared
    folder = shared / "evaluate-runs"
    with FileLock(str(shared / "evaluate-runs.lock")):
        if not (folder / "done").is_file():
            def train(name):
                script = "ppo_multigpu" if name == "breakout" else name
                run_script(script, *RUNS[name], "--run-dir", str(folder / name))

            with ThreadPoolExecutor(2) as pool:  # overlaps one run's start-up with another's work
                list(pool.map(train, RUNS))
            (folder / "done").touch()
    return {name: folder / name for name in RUNS}


def evaluate_cli(capsys, monkeypatch, *argv) -> tuple[dict, str]:
    """evaluate.py in this process (the imports are paid once); returns (eval.json, path)."""
    monkeypatch.setattr(sys, "argv", ["evaluate.py", *argv, "--no-cuda"])
    evaluate.main()
    out = capsys.readouterr().out
    path = next(line[len("wrote "):] for line in out.splitlines() if line.startswith("wrote "))
    return json.loads(open(path).read()), path


@pytest.mark.parametrize("script", [s for s in RUNS if s != "breakout"])
def test_every_script_evaluates_and_never_overwrites(script, runs, capsys, monkeypatch):
    run = runs[script]
    first, first_path = evaluate_cli(capsys, monkeypatch, str(run), "--episodes", "3")
    assert os.path.dirname(first_path) == str(run / "checkpoints")
    saved = json.loads((run / "args.json").read_text())
    (ckpt,) = (run / "checkpoints").glob("step_*.pt")  # 128 steps, or a whole iteration more
    assert first["checkpoint"] == str(ckpt) and first["script"] == script
    assert first["global_step"] == int(ckpt.stem[len("step_"):]) >= 128
    assert first["episodes"] == len(first["returns"]) == len(first["lengths"]) == 3
    assert set(first["returns"]) <= {-1.0, 1.0} and first["lengths"] == [6, 6, 6]  # Catch
    assert first["mean_return"] == pytest.approx(sum(first["returns"]) / 3)
    assert first["human_normalized"] is None  # Catch has no reference scores
    if script in ("dqn_multigpu", "cat_dqn"):
        assert first["epsilon"] == saved["eval_epsilon"] and first["policy"] == "epsilon-greedy"
    else:
        assert first["epsilon"] is None and first["policy"] == "sampled"
    before = open(first_path).read()

    second, second_path = evaluate_cli(capsys, monkeypatch, str(run), "--episodes", "3")
    assert second_path != first_path and os.path.basename(second_path).startswith("eval-")
    assert open(first_path).read() == before  # the first results are left as they were
    assert second["returns"] == first["returns"]  # same seed, same games


def test_several_runs_are_evaluated_one_line_each(runs, capsys, monkeypatch):
    """The README's `evaluate.py runs/common.catch_Catch-v0__ppo_multigpu__1__*` once a second
    run matches: each run is played and written, one line each."""
    names = ["ppo_multigpu", "dqn_multigpu"]
    monkeypatch.setattr(sys, "argv", ["evaluate.py", *(str(runs[n]) for n in names),
                                      "--episodes", "2", "--no-cuda"])
    evaluate.main()
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 2
    for name, line in zip(names, lines):
        assert line.startswith(str(runs[name] / "checkpoints")) and f"({name}, step " in line
        written = Path(line.split("; wrote ")[1])
        result = json.loads(written.read_text())
        assert written.parent == runs[name] / "checkpoints" and result["episodes"] == 2
        assert f"mean {result['mean_return']:.2f} +- " in line


def test_video_of_the_first_game(runs, tmp_path):
    import imageio_ffmpeg

    video = tmp_path / "breakout.mp4"
    cmd = [ROOT / "benchmarks" / "evaluate.py", str(runs["breakout"]), "--episodes", "1",
           "--video", str(video), "--no-cuda"]
    proc = run_python(*cmd)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "fell out of step" not in proc.stderr  # the recording played the evaluated game
    assert ": 1 game, sampled, cap" in proc.stdout, proc.stdout
    path = next(line[len("wrote "):] for line in proc.stdout.splitlines()
                if line.startswith("wrote "))
    result = json.loads(open(path).read())
    assert result["human_normalized"] is not None  # Breakout has reference scores
    frames, _ = imageio_ffmpeg.count_frames_and_secs(str(video))
    assert frames > 10 and frames == result["video_frames"] == result["lengths"][0] + 1
    reader = imageio_ffmpeg.read_frames(str(video))
    meta = next(reader)
    reader.close()
    assert meta["size"] == (160, 210) and meta["fps"] == 15  # the RGB screen, not 84x84
    assert not [p for p in tmp_path.iterdir() if p != video]  # no temporary file left

    # a real process: one line, no traceback
    again = run_python(*cmd)
    assert again.returncode == 2 and again.stderr.strip() == f"error: {video} exists; choose " \
        "another --video name"


def fake_checkpoint(path, state: dict) -> None:
    """A checkpoint with its checksum beside it, as common/checkpoint.py writes them."""
    import hashlib
    torch.save(state, path)
    path.with_name(path.name + ".sha256").write_text(hashlib.sha256(path.read_bytes()).hexdigest())


@pytest.mark.parametrize("case, message", [
    ("no such path", "no such run directory or checkpoint:"),
    ("empty run", "no checkpoint (step_*.pt) in"),
    ("unknown script", "was written by 'sac', which accelrl does not know"),
    ("no sidecar, unknown script", "was written by 'sac', which accelrl does not know"),
    ("damaged", "no readable checkpoint in"),
    ("not torch", "unreadable"),
    ("video of Catch", "--video records Atari games; tests.catch_env:Catch-v0 is not one"),
    ("epsilon of PPO", "--epsilon is the DQN family's"),
])
def test_bad_input_is_one_line(case, message, runs, tmp_path, capsys, monkeypatch):
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    ckpt = run / "checkpoints" / "step_100.pt"
    extra = []
    if case == "unknown script":
        fake_checkpoint(ckpt, {"model": {}, "script": "sac", "env_id": CATCH, "global_step": 100})
    elif case == "no sidecar, unknown script":
        torch.save({"model": {}, "script": "sac", "env_id": CATCH, "global_step": 100}, ckpt)
    elif case == "damaged":  # a checkpoint cut short: its checksum no longer matches
        (good,) = (runs["ppo_multigpu"] / "checkpoints").glob("step_*.pt")
        ckpt.write_bytes(good.read_bytes()[:1000])
        ckpt.with_name(ckpt.name + ".sha256").write_text(
            good.with_name(good.name + ".sha256").read_text())
    elif case == "not torch":
        ckpt.write_text("not a checkpoint")
    elif case == "video of Catch":
        run, extra = runs["ppo_multigpu"], ["--video", str(tmp_path / "catch.mp4")]
    elif case == "epsilon of PPO":
        run, extra = runs["ppo_multigpu"], ["--epsilon", "0.1"]
    target = ckpt if case == "not torch" else tmp_path / "nothing" if case == "no such path" \
        else run
    monkeypatch.setattr(sys, "argv", ["evaluate.py", str(target), *extra, "--no-cuda"])
    with pytest.raises(SystemExit) as stopped:
        evaluate.main()
    assert stopped.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and message in err[0], err
    assert not (tmp_path / "catch.mp4").exists()


def test_plot_of_ordinary_runs_names_a_run_without_games(runs, tmp_path, capsys, monkeypatch):
    played, silent = runs["ppo_multigpu"], runs["breakout"]
    monkeypatch.setattr(sys, "argv", ["plot.py", str(played), str(silent), "--out",
                                      str(tmp_path)])
    plot.main()
    out = capsys.readouterr().out
    png = tmp_path / "runs.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    assert "| breakout | Breakout-v5 | 64 | 0 | no finished game |" in out
    assert "no finished game yet, so no training curve: breakout" in out
    assert (tmp_path / "runs.md").read_text() in out
    rows = (tmp_path / "runs.csv").read_text().splitlines()
    assert any(r.startswith("ppo_multigpu,") and ",train," in r for r in rows)
    assert any(r.startswith("ppo_multigpu,") and ",eval," in r for r in rows)  # eval curve
    assert not any(r.startswith("breakout,") for r in rows)

    # Run again, now on the default folder: nothing is overwritten
    monkeypatch.setattr(plot, "ROOT", tmp_path / "checkout")
    for _ in range(2):
        monkeypatch.setattr(sys, "argv", ["plot.py", str(played), str(silent)])
        plot.main()
    written = sorted(p.name for p in (tmp_path / "checkout" / "runs" / "plots").iterdir())
    assert written == ["runs-2.csv", "runs-2.md", "runs-2.png", "runs.csv", "runs.md", "runs.png"]


@pytest.mark.parametrize("script", ["ppo_multigpu", "dqn_multigpu"])
def test_the_loading_example_of_the_docs_runs(script, runs, tmp_path):
    """docs/evaluate.md's example, as written but for the checkout and the run it names, plays
    8 games from a folder outside the checkout (a user's own script)."""
    page = (ROOT / "docs" / "evaluate.md").read_text()
    code = page.split("## A trained agent in your own code")[1].split("```python\n")[1]
    code = code.split("```")[0].replace("runs/Pong-v5__ppo_multigpu__1__1765000000",
                                        str(runs[script]))
    assert "/path/to/accelrl" in code
    code = code.replace("/path/to/accelrl", str(ROOT))
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True,
                          text=True, timeout=300, env={**os.environ, **CHILD_ENV})
    assert proc.returncode == 0, proc.stderr[-2000:]
    first, last = proc.stdout.strip().splitlines()
    assert first == f"{script} on {CATCH}, step 128"
    score = float(last.removeprefix("mean score over 8 games: "))
    assert -1 <= score <= 1  # Catch's scores are -1 or +1
