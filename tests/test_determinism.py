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
    assert switches["deterministic"]
    gpu_only = ("cudnn_deterministic", "cudnn_benchmark", "tf32_matmul", "tf32_cudnn")
    assert all(switches[k] is None for k in gpu_only)  # a CPU run: nothing to report


def test_off_by_default(tmp_path):
    run_script("ppo_multigpu", *TINY[:-1], "--num-steps", "32", "--run-dir", str(tmp_path / "r"))
    switches = read_summary(tmp_path / "r")["switches"]
    assert switches["deterministic"] is False and switches["tf32_cudnn"] is None  # on a CPU


def test_gpu_switches_are_reported_for_a_gpu_run():
    """The deterministic switches as a GPU run records them (set here, read for a CUDA device)."""
    from common import gpu
    before = gpu.switches(torch.device("cuda", 0))
    try:
        gpu.deterministic()
        s = gpu.switches(torch.device("cuda", 0))
        assert s["deterministic"] and s["cudnn_deterministic"]
        assert not (s["cudnn_benchmark"] or s["tf32_matmul"] or s["tf32_cudnn"])
    finally:
        torch.use_deterministic_algorithms(False)
        torch.backends.cudnn.deterministic = before["cudnn_deterministic"]
        torch.backends.cudnn.benchmark = before["cudnn_benchmark"]
        torch.backends.cuda.matmul.allow_tf32 = before["tf32_matmul"]
        torch.backends.cudnn.allow_tf32 = before["tf32_cudnn"]
