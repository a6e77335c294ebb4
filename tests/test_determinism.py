"""--torch-deterministic: two synchronous runs with the same flags end with the same parameters,
bit for bit, and summary.json records the switches in force."""

import pytest
import torch

from tests.conftest import read_summary, run_script

CATCH = "tests.catch_env:Catch-v0"
TINY = ("--env-id", CATCH, "--num-envs", "4", "--total-timesteps", "256", "--eval-episodes", "2",
        "--eval-envs", "2", "--torch-deterministic")
Q = ("--replay-size", "2000", "--batch-size", "32", "--learning-starts", "64",
     "--replay-ratio", "2", "--prioritized")
FLAGS = {"ppo_multigpu": ("--num-steps", "32"), "a2c_multigpu": ("--num-steps", "8"),
         "dqn_multigpu": (*Q, "--num-steps", "8"), "cat_dqn": (*Q, "--num-steps", "8")}


def final_weights(run_dir) -> dict:
    (ckpt,) = (run_dir / "checkpoints").glob("step_*.pt")
    return torch.load(ckpt, weights_only=True)["model"]


@pytest.mark.parametrize("script", FLAGS)
def test_two_runs_give_the_same_parameters(script, tmp_path):
    for name in ("a", "b"):
        run_script(script, *TINY, *FLAGS[script], "--run-dir", str(tmp_path / name))
    a, b = final_weights(tmp_path / "a"), final_weights(tmp_path / "b")
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a), [k for k in a if not torch.equal(a[k], b[k])]
    eval_a, eval_b = (read_summary(tmp_path / n)["eval_returns"] for n in ("a", "b"))
    assert len(eval_a) == 2 and eval_a == eval_b
    switches = read_summary(tmp_path / "a")["switches"]
    assert switches["deterministic"] and switches["cudnn_deterministic"]
    assert not (switches["cudnn_benchmark"] or switches["tf32_matmul"] or switches["tf32_cudnn"])


def test_off_by_default(tmp_path):
    run_script("ppo_multigpu", *TINY[:-1], "--num-steps", "32", "--run-dir", str(tmp_path / "r"))
    assert read_summary(tmp_path / "r")["switches"]["deterministic"] is False
