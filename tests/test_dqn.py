"""dqn_multigpu.py: targets and exploration against references written here, distributed
equivalence of the update, presets, learning on Catch, torchrun end to end with resume, bad input."""

import pytest
import torch

from common import cli
from tests.conftest import (expect_error, load_algo, read_summary, replay_batch, run_script,
                            run_two_ranks)


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
    actions = sampler.collect(dqn.GroupPolicy(net).start(torch.tensor([0.0, 0.0, 1.0, 1.0])))[
        "actions"]
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
    _, td, _ = dqn.dqn_update(model, target, opt, batch, args)
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


@pytest.mark.slow
def test_dqn_learns_catch(tmp_path):
    """A random policy scores about -0.7 on Catch; DQN (double, 3-step) catches nearly every ball
    after about 600 updates of 64. Seed 1 gave 0.88 here."""
    run = tmp_path / "run"
    run_script("dqn_multigpu", "--env-id", "tests.catch_env:Catch-v0", "--seed", "1",
               "--total-timesteps", "10000", "--num-envs", "8", "--replay-size", "20000",
               "--learning-starts", "500", "--batch-size", "64", "--replay-ratio", "4",
               "--learning-rate", "5e-4", "--adam-eps", "1e-4", "--n-step", "3", "--double",
               "--eps-decay-steps", "4000", "--eps-end", "0.02", "--target-update-interval",
               "400", "--eval-interval", "0", "--run-dir", str(run), timeout=900)
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
    assert not (tmp_path / "new").exists()  # no run directory is made for a failed start
