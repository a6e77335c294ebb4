"""dqn_multigpu.py: targets and exploration against references written here, distributed
equivalence of the update, presets, learning on Catch, torchrun end to end with resume, bad input;
and asynchronous DQN (--asynchronous): learning on 2 ranks with resume, a killed rank, SIGINT."""

import pytest
import torch

from common import cli
from common.grad_step import AllReduceStep, CentralStep
from tests.conftest import (expect_error, load_algo, read_summary, replay_batch, run_script,
                            run_two_ranks)
from tests.test_a2c import kill_a_rank_then_interrupt
from tests.test_appo import _shm, _shm_left


@pytest.fixture(scope="module")
def dqn():
    return load_algo("dqn_multigpu")


def test_nature_and_double_targets_match_hand_computed_values(dqn):
    q_online = torch.tensor([[1.0, 5.0, 2.0], [0.0, -1.0, 3.0], [2.0, 2.5, -4.0]])
    q_target = torch.tensor([[4.0, 0.0, 7.0], [2.0, 6.0, 1.0], [-1.0, 3.0, 8.0]])
    batch = {"next_obs": torch.zeros(3, 4, 84, 84, dtype=torch.uint8),
             "returns": torch.tensor([1.0, 0.5, -2.0]), "discounts": torch.tensor([0.9, 0.0, 0.81])}
    online, target = (lambda o: q_online), (lambda o: q_target)
    # Nature: max_a Q_target(s', a) = 7, 6, 8
    torch.testing.assert_close(dqn.td_targets(online, target, batch, double=False),
                               torch.tensor([1.0 + 0.9 * 7, 0.5, -2.0 + 0.81 * 8]))
    # double: a' = argmax Q_online = 1, 2, 1; valued by the target: 0, 1, 3
    torch.testing.assert_close(dqn.td_targets(online, target, batch, double=True),
                               torch.tensor([1.0 + 0.9 * 0, 0.5, -2.0 + 0.81 * 3]))


def test_dueling_head_is_value_plus_centred_advantage(dqn):
    torch.manual_seed(0)
    net = dqn.QNetwork(5, dueling=True)
    obs = torch.randint(0, 256, (6, 4, 84, 84), dtype=torch.uint8)
    with torch.no_grad():
        h = net.torso(obs.float() / 255)
        v, a = net.value(h), net.head(h)  # [6, 1], [6, 5]
        want = torch.stack([v[i, 0] + a[i] - sum(a[i].tolist()) / 5 for i in range(6)])
        torch.testing.assert_close(net(obs), want)
        # the advantage's mean carries no information: shifting it leaves Q unchanged
        before = net(obs)
        net.head[-1].bias += 3.0
        torch.testing.assert_close(net(obs), before)
        batch = {"next_obs": obs[:2], "returns": torch.tensor([0.0, 1.0]),
                 "discounts": torch.tensor([0.5, 0.99])}
        q = net(obs[:2])
        torch.testing.assert_close(dqn.td_targets(net, net, batch, double=True),
                                   batch["returns"] + batch["discounts"] * q.max(1).values)


def test_epsilon_schedules(dqn):
    args = dqn.Args(num_envs=4, eps_schedule="apex")
    eps = torch.cat([dqn.epsilons(args, 0, rank, 2) for rank in range(2)])  # N = 8 envs
    want = torch.tensor([0.4 ** (1 + 7 * i / 7) for i in range(8)])
    torch.testing.assert_close(eps, want)
    assert eps[0] == pytest.approx(0.4) and eps[7] == pytest.approx(0.4 ** 8)
    assert dqn.epsilons(dqn.Args(num_envs=1, eps_schedule="apex"), 0, 0, 1).item() == \
        pytest.approx(0.4)
    lin = dqn.Args(num_envs=2, eps_start=1.0, eps_end=0.1, eps_decay_steps=1000,
                   learning_starts=0)  # the decay starts after the warm-up: tests/test_scores.py
    for step, e in ((0, 1.0), (500, 0.55), (1000, 0.1), (5000, 0.1)):
        assert dqn.epsilons(lin, step, 0, 1).tolist() == pytest.approx([e, e])


@pytest.mark.parametrize("groups", [1, 2])
def test_each_environment_explores_with_its_own_epsilon(dqn, groups):
    """Columns 0-1 greedy (argmax is always action 0 here), columns 2-3 uniformly random, with
    the plain and the alternating sampler (which asks for the two halves in turn)."""
    from common import envs
    from common.exploration import Explorer
    from common.sampler import Sampler
    net = dqn.QNetwork(3)
    with torch.no_grad():
        for p in net.head[-1].parameters():
            p.zero_()
        net.head[-1].bias[0] = 1.0
    sampler = Sampler(envs.make_envs("tests.catch_env:Catch-v0", 4, groups=groups), 32,
                      torch.device("cpu"))
    sampler.reset(envs.env_seeds(0, 0, 4))
    torch.manual_seed(0)
    explorer = Explorer(net, 4)
    explorer.eps.copy_(torch.tensor([0.0, 0.0, 1.0, 1.0]))
    actions = sampler.collect(explorer)["actions"]
    assert (actions[:, :2] == 0).all()
    assert set(actions[:, 2:].flatten().tolist()) == {0, 1, 2}


def test_presets_fill_defaults_and_flags_override(dqn):
    args, _ = cli.parse_args(dqn.Args, ["--preset", "eps-rainbow-512", "--learning-rate", "1e-4",
                                        "--no-dueling"], presets=dqn.PRESETS)
    assert (args.double, args.prioritized, args.n_step, args.batch_size) == (True, True, 3, 512)
    assert args.target_update_interval == 8000 and args.learning_starts == 20000
    assert args.adam_eps == pytest.approx(0.005 / 512)
    assert args.learning_rate == 1e-4 and not args.dueling  # the command line wins
    nature, _ = cli.parse_args(dqn.Args, ["--preset", "dqn-nature"], presets=dqn.PRESETS)
    assert (nature.batch_size, nature.optimizer, nature.learning_rate) == (32, "rmsprop", 2.5e-4)
    assert nature.eval_epsilon == 0.05 and not nature.double
    default, _ = cli.parse_args(dqn.Args, [], presets=dqn.PRESETS)
    assert default.preset == "dqn-512" and default.batch_size == 512


def _update(batch, out_path=None):
    """One double-dueling DQN update from fixed parameters (target != online); returns them."""
    from common import dist
    dqn = load_algo("dqn_multigpu")
    world = dist.setup(cuda=False)
    args = dqn.Args(double=True, dueling=True, max_grad_norm=1.0)
    torch.manual_seed(123)
    model, target = dqn.QNetwork(6, dueling=True), dqn.QNetwork(6, dueling=True)
    dist.broadcast_params(model)
    dist.broadcast_params(target)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3, eps=1e-4)
    _, td, _ = dqn.dqn_update(model, target, AllReduceStep(model, opt, args.max_grad_norm), batch,
                              args)
    params = torch.nn.utils.parameters_to_vector(model.parameters()).detach()
    if out_path:
        torch.save((params, td), f"{out_path}.{world.rank}")
    dist.cleanup()
    return params, td


def _rank(rank, batch, out_path):
    _update({k: v.chunk(2)[rank] for k, v in batch.items()}, out_path)  # each: half the batch


def test_two_ranks_on_half_batches_equal_one_process_on_the_whole(tmp_path):
    batch = replay_batch(32, 6)
    run_two_ranks(_rank, batch, str(tmp_path / "p"))
    (r0, td0), (r1, td1) = torch.load(tmp_path / "p.0"), torch.load(tmp_path / "p.1")
    single, td = _update(batch)
    assert torch.equal(r0, r1)  # every rank took the same step
    torch.manual_seed(123)
    init = torch.nn.utils.parameters_to_vector(load_algo("dqn_multigpu").QNetwork(
        6, dueling=True).parameters())
    assert (single - init).abs().max() > 1e-4  # the update did move the parameters
    torch.testing.assert_close(r0, single, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(torch.cat([td0, td1]), td)  # TD errors for the priorities


def test_asynchronous_update_equals_torch_adam_on_a_fixed_batch(dqn):
    """--asynchronous: updates through the central Adam (three chunks in shared memory) take the
    steps torch's Adam takes with the same clipped gradients (two steps: the bias correction's
    step count too), the model holds the central parameters after each, and the TD errors for
    the priorities are the same."""
    from common.central_optim import CentralOptimizer
    args = dqn.Args(double=True, dueling=True, max_grad_norm=1.0, learning_rate=1e-3,
                    adam_eps=1e-4)
    torch.manual_seed(123)
    model, target = dqn.QNetwork(6, dueling=True), dqn.QNetwork(6, dueling=True)
    ref = dqn.QNetwork(6, dueling=True)
    ref.load_state_dict(model.state_dict())
    reference = torch.optim.Adam(ref.parameters(), lr=1e-3, eps=1e-4)
    central = CentralOptimizer(model.parameters(), 3, eps=args.adam_eps)
    try:
        for seed in (0, 1):
            batch = replay_batch(32, 6, seed)
            _, td, _ = dqn.dqn_update(model, target, CentralStep(
                model, central, args.learning_rate, args.max_grad_norm), batch, args)
            _, td_ref, _ = dqn.dqn_update(ref, target, AllReduceStep(ref, reference,
                                                                     args.max_grad_norm),
                                          batch, args)
            torch.testing.assert_close(td, td_ref)
            for p, q in zip(model.parameters(), ref.parameters()):
                torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-7)
    finally:
        central.unlink()
    assert central.steps[:3].tolist() == [2, 2, 2]  # every chunk took both gradients
    torch.manual_seed(123)
    init = dqn.QNetwork(6, dueling=True)  # the steps did move the parameters
    assert max((p - q).abs().max() for p, q in zip(model.parameters(), init.parameters())) > 1e-4


CATCH = ("--env-id", "tests.catch_env:Catch-v0", "--num-envs", "8", "--replay-size", "20000",
         "--learning-starts", "500", "--batch-size", "64", "--replay-ratio", "4",
         "--learning-rate", "5e-4", "--adam-eps", "1e-4", "--n-step", "3", "--double",
         "--eps-decay-steps", "4000", "--eps-end", "0.02", "--target-update-interval", "400",
         "--eval-interval", "0")


@pytest.mark.slow
def test_dqn_learns_catch(tmp_path):
    """A random policy scores about -0.7 on Catch; DQN (double, 3-step) catches nearly every ball
    after about 600 updates of 64. Seeds 1-3 gave 0.70 each here with the convolutions in
    channels-last (the CPU's default), 0.80, 0.82, 0.68 without."""
    run = tmp_path / "run"
    run_script("dqn_multigpu", *CATCH, "--seed", "1", "--total-timesteps", "10000",
               "--run-dir", str(run), timeout=900)
    s = read_summary(run)
    assert s["episodes"] > 1500 and s["updates"] == 596
    assert s["mean_return_last100"] > 0.6


def _scalars(run_dir, tag):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    out = []
    for f in sorted(run_dir.glob("events.out.tfevents.*")):
        acc = EventAccumulator(str(f))
        acc.Reload()
        if tag in acc.Tags()["scalars"]:
            out += [(e.step, e.value) for e in acc.Scalars(tag)]
    return sorted(out)


@pytest.mark.slow
def test_torchrun_two_ranks_end_to_end_resume_and_refill(tmp_path):
    """2 ranks x 2 envs x 4 steps = 16 steps an iteration; learning from step 64 at batch 16 per
    rank and replay ratio 2 gives 2 x 16 / 32 = 1 update an iteration."""
    run = tmp_path / "run"
    common = ["--env-id", "Breakout-v5", "--num-envs", "2", "--batch-size", "16",
              "--replay-size", "2000", "--learning-starts", "64", "--target-update-interval",
              "64", "--replay-ratio", "2", "--prioritized", "--n-step", "3", "--save-replay",
              "--eps-schedule", "apex", "--alternate", "--eval-interval", "1", "--eval-envs", "2",
              "--eval-episodes", "1", "--eval-epsilon", "1.0", "--eval-max-steps", "1000",
              "--checkpoint-interval", "160", "--run-dir", str(run)]
    run_script("dqn_multigpu", *common, "--total-timesteps", "320", nproc=2)
    s = read_summary(run)
    assert s["global_step"] == 320 and s["world_size"] == 2 and s["device"] == "cpu"
    assert s["updates"] == 17  # iterations 4 to 20
    assert s["replay_bytes_per_transition"] <= 7100
    names = sorted(p.name for p in (run / "checkpoints").glob("step_*.pt"))
    assert names == ["step_160.pt", "step_160.rank0.pt", "step_160.rank1.pt", "step_320.pt",
                     "step_320.rank0.pt", "step_320.rank1.pt"]
    ckpt = torch.load(run / "checkpoints" / "step_320.pt", weights_only=True)
    assert ckpt["counters"]["updates"] == 17 and len(ckpt["rng"]) == 2
    shard = torch.load(run / "checkpoints" / "step_320.rank1.pt", weights_only=True)["replay"]
    assert shard["steps"] == 80 and shard["frames"].shape == (500, 2, 84, 84)  # 320 / 4 envs

    # resume with the replay: learning goes on at once, an update every iteration
    run_script("dqn_multigpu", "--resume", str(run), "--total-timesteps", "640", nproc=2)
    s = read_summary(run)
    assert s["global_step"] == 640 and s["updates"] == 17 + 20 and s["args"]["prioritized"]
    ckpt = torch.load(run / "checkpoints" / "step_640.pt", weights_only=True)
    assert ckpt["counters"]["updates"] == 37 and ckpt["counters"]["generated"] == 37 * 16
    ratio = _scalars(run, "charts/replay_ratio")
    assert ratio[-1] == (640, pytest.approx(2.0))

    # resume without it: the buffer refills for --learning-starts steps first
    run_script("dqn_multigpu", "--resume", str(run), "--no-save-replay", "--total-timesteps",
               "960", nproc=2)
    s = read_summary(run)
    assert s["global_step"] == 960 and s["updates"] == 37 + 17  # from step 704 on
    for tag in ("charts/SPS", "charts/epsilon", "charts/replay_ratio", "charts/eval_return",
                "losses/td_loss", "losses/q_values", "time/env", "time/learn", "time/comm",
                "time/eval"):
        assert _scalars(run, tag), tag
    eps = _scalars(run, "charts/epsilon")[-1][1]  # rank 0's envs: i = 0, 1 of N = 4 (apex)
    assert eps == pytest.approx((0.4 + 0.4 ** (1 + 7 / 3)) / 2)


def _bad(*args):
    return expect_error("dqn_multigpu", *args)


def test_bad_inputs_give_one_clear_line(tmp_path):
    run = str(tmp_path / "new")
    assert "--batch-size must be positive" in _bad("--batch-size", "0", "--run-dir", run)
    assert "--n-step must be positive" in _bad("--n-step", "0", "--run-dir", run)
    assert "--gamma must be in [0, 1]" in _bad("--gamma", "1.5", "--run-dir", run)
    assert "--replay-size 100 gives 6 transitions per environment" in _bad(
        "--replay-size", "100", "--run-dir", run)
    assert "unknown Atari game 'Foo-v5'" in _bad("--env-id", "Foo-v5", "--run-dir", run)
    assert "--preset does not apply to --resume RUN" in _bad(
        "--resume", str(tmp_path / "old"), "--preset", "dqn-nature")
    assert "--num-chunks must be positive" in _bad("--asynchronous", "--num-chunks", "0",
                                                   "--run-dir", run)
    assert "use --optimizer adam" in _bad("--asynchronous", "--optimizer", "rmsprop",
                                          "--run-dir", run)
    assert not (tmp_path / "new").exists()  # no run directory is made for a failed start


@pytest.mark.slow
def test_async_dqn_learns_catch_on_two_ranks_and_resumes(tmp_path):
    """Asynchronous DQN: two ranks, each with its own 8 environments and replay shard, push their
    own gradients into the central Adam. The synchronous test's flags on 30,016 steps: 924
    updates per rank, 1,848 central ones. Not repeatable (the chunks take the gradients in the
    order timing gives), so measured under the suite's load: two runs at once on the 2-core CPU
    here, seeds 1, 3, 4, 7, 8 and 9. Each caught every ball of the final evaluation (16 games);
    training's last 100 games: 0.88 to 0.98 (a random policy: about -0.7). At 20,032 steps one
    run in eight was still learning (evaluation 0.5, last 100 games 0.32)."""
    shm_before, run = _shm(), tmp_path / "run"
    run_script("dqn_multigpu", *CATCH, "--asynchronous", "--seed", "1", "--total-timesteps",
               "30016", "--run-dir", str(run), nproc=2, timeout=900)
    s = read_summary(run)
    assert s["world_size"] == 2 and s["global_step"] == s["central_step"] == 30016
    assert s["updates"] == 924 and s["central_updates"] == 2 * 924  # the ratio over both ranks
    assert s["eval_return"] > 0.5 and s["mean_return_last100"] > 0.5
    ckpt = torch.load(run / "checkpoints" / "step_30016.pt", weights_only=True)
    assert set(ckpt["optimizer"]) == {"exp_avg", "exp_avg_sq", "step"} and ckpt["asynchronous"]
    assert ckpt["optimizer"]["step"].tolist() == [1848] * 3  # every chunk took every update
    assert not _shm_left(shm_before)  # the central state's files are unlinked

    # resume: the central statistics, their step counts and the global step continue
    run_script("dqn_multigpu", "--resume", str(run), "--total-timesteps", "30656",
               "--eval-episodes", "0", nproc=2)
    s = read_summary(run)
    assert s["global_step"] == s["central_step"] == 30656 and s["args"]["asynchronous"]
    # the replay was not saved, so it refills for --learning-starts (500) steps: learning from
    # step 30,516, three iterations of 64 steps, 192 x 4 / (64 x 2) = 6 more updates per rank
    assert s["updates"] == 924 + 6 and s["central_updates"] == 2 * 930
    saved = (run / "args.json").read_text()
    assert "trained with --asynchronous" in _bad("--resume", str(run), "--no-asynchronous",
                                                 "--total-timesteps", "40000")
    assert "use --optimizer adam" in _bad("--resume", str(run), "--optimizer", "rmsprop",
                                          "--total-timesteps", "40000")
    assert (run / "args.json").read_text() == saved  # a refused resume changes nothing
    assert not _shm_left(shm_before)


@pytest.mark.slow
def test_async_dqn_killed_rank_ends_the_run_and_sigint_stops_it_cleanly(tmp_path):
    """A3C's fault test (tests/test_a2c.py) on asynchronous DQN, at the default replay ratio: the
    ranks meet only every 2,048 steps per rank, which with its updates outlasts on 2 busy cores
    the 30 s torchrun waits after forwarding Ctrl-C, so a signalled rank skips its updates."""
    kill_a_rank_then_interrupt("dqn_multigpu", (*CATCH, "--asynchronous"), tmp_path)
