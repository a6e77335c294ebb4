"""The GPU rules that can be checked without a GPU (device count and synchronize faked): which
GPU a rank takes, the refusal of layouts NCCL would reject, experiment slots from an inherited
CUDA_VISIBLE_DEVICES, phase timers that wait for the device, and CUDA RNG state only for runs on
a GPU. benchmarks/gpu_check.py exercises the real thing on a GPU."""

import pytest
import torch

from benchmarks import experiments
from common import checkpoint, dist, gpu


@pytest.fixture
def gpus(monkeypatch):
    """fake(n): pretend n GPUs are visible."""
    def fake(n):
        monkeypatch.setattr(torch.cuda, "is_available", lambda: n > 0)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: n)
    return fake


def test_a_rank_takes_its_local_gpu_or_the_only_visible_one(gpus):
    gpus(4)
    assert dist.pick_device(True, 2) == torch.device("cuda", 2)
    assert dist.pick_device(False, 2) == torch.device("cpu")  # --no-cuda
    gpus(1)  # a scheduler that shows each process its own GPU
    assert dist.pick_device(True, 3) == torch.device("cuda", 0)
    gpus(0)
    assert dist.pick_device(True, 0) == torch.device("cpu")


def test_a_rank_without_a_gpu_is_refused_under_nccl_and_shares_under_gloo(gpus, capsys,
                                                                         monkeypatch):
    gpus(2)
    monkeypatch.setenv("RANK", "0")  # rank 0 says why
    with pytest.raises(SystemExit) as e:
        dist.pick_device(True, 3)
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "LOCAL_RANK 3 has no GPU" in err[0] and "--backend gloo" in err[0]
    assert dist.pick_device(True, 3, "gloo") == torch.device("cuda", 1)


def test_two_ranks_on_one_gpu_are_named_before_nccl_refuses_them():
    assert dist.shared_gpu(["a/GPU-1", "a/GPU-2", "b/GPU-1"]) is None  # same uuid, other host
    problem = dist.shared_gpu(["a/GPU-1", "a/GPU-2", "a/GPU-1"])
    assert "ranks 0 and 2" in problem and "--backend gloo" in problem


def test_experiment_slots_keep_an_inherited_cuda_visible_devices(monkeypatch, capsys):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3, 5,6,7")
    assert experiments.visible_gpus() == ["3", "5", "6", "7"]
    assert experiments.gpu_slots(experiments.visible_gpus(), 2, 2) == [["3", "5"], ["6", "7"]]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert experiments.visible_gpus() == []
    assert experiments.gpu_slots([], 3, 2) == [[], [], []]  # CPU machine
    with pytest.raises(SystemExit):  # never two runs (or ranks) on one GPU
        experiments.gpu_slots(["0", "1"], 2, 2)
    assert "needs 4 GPUs, 2 visible" in capsys.readouterr().err


class FakeGpu:
    """A device whose kernels run after their launch returns: `launch(s)` queues s seconds of
    work and returns at once; synchronize() waits for it. Time is a fake clock."""

    def __init__(self, monkeypatch):
        self.now, self.queued = 0.0, 0.0
        monkeypatch.setattr(gpu.time, "perf_counter", lambda: self.now)
        monkeypatch.setattr(torch.cuda, "synchronize", self.synchronize)

    def launch(self, seconds):
        self.queued += seconds

    def synchronize(self, device=None):
        self.now += self.queued
        self.queued = 0.0


def test_phase_timers_give_queued_gpu_work_to_the_phase_that_queued_it(monkeypatch):
    fake, dev = FakeGpu(monkeypatch), torch.device("cuda", 0)
    t0 = gpu.clock(dev)
    fake.launch(0.3)  # the learner's backward, queued
    t1 = gpu.clock(dev)  # the end of learning: it waits for the backward
    fake.now += 0.05  # the collective itself
    t2 = gpu.clock(dev)
    assert (t1 - t0, t2 - t1) == pytest.approx((0.3, 0.05))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda d=None: pytest.fail("CPU synced"))
    gpu.clock(torch.device("cpu"))


def test_phase_clock_splits_an_iteration_into_its_phases(monkeypatch):
    """The scripts' phase bookkeeping: learning timed on the device clock (its queued work
    included), the all-reduce measured inside it moved to communication, the sampler's own
    counters read as differences, evaluation only when timed, and a fresh start at each pop."""
    from types import SimpleNamespace

    from common.logger import PhaseClock
    fake, dev = FakeGpu(monkeypatch), torch.device("cuda", 0)
    sampler = SimpleNamespace(time_env=5.0, time_inference=2.0)
    phases = PhaseClock(dev, sampler)
    sampler.time_env, sampler.time_inference = 5.5, 2.25  # one rollout
    with phases("learn"):
        fake.launch(0.3)  # queued: the clock at the end waits for it
    phases.add("comm", 0.05, taken_from="learn")
    assert phases.pop() == pytest.approx({"env": 0.5, "inference": 0.25, "learn": 0.25,
                                          "comm": 0.05, "eval": 0.0})
    with phases("eval"):
        fake.now += 1.0
    phases.add("sampler_wait", 0.5)  # any phase a script reports (APPO's waits)
    assert phases.pop() == pytest.approx({"env": 0.0, "inference": 0.0, "learn": 0.0,
                                          "comm": 0.0, "eval": 1.0, "sampler_wait": 0.5})


def test_cuda_rng_state_is_saved_and_restored_only_for_a_run_on_a_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_rng_state", lambda d=None: pytest.fail("read GPU RNG"))
    monkeypatch.setattr(torch.cuda, "set_rng_state", lambda s, d=None: pytest.fail("set GPU"))
    state = checkpoint.rng_state(torch.device("cpu"))  # --no-cuda on a GPU machine
    assert "cuda" not in state
    checkpoint.set_rng_state({**state, "cuda": torch.zeros(8, dtype=torch.uint8)},
                             torch.device("cpu"))  # a GPU run's checkpoint resumed on the CPU


def test_no_argument_validation_in_torch_distributions_after_setup():
    dist.setup(cuda=False)
    assert torch.distributions.Distribution._validate_args is False
    assert gpu.switches()["distribution_validation"] is False
