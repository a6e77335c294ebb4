"""A2C on Atari, synchronous and data-parallel over GPUs.

Advantage actor-critic, the synchronous variant of A3C (Mnih et al. 2016, arXiv 1602.01783), as
run in "Accelerated Methods for Deep Reinforcement Learning" (Stooke & Abbeel 2018, arXiv
1803.02811): one process per GPU, each driving 16 emulators with batched inference (paper
Sec. 3.1), and one optimizer step per 5-step rollout on gradients averaged over all GPUs
(Sec. 3.2), so all ranks hold the same parameters. The global batch is ranks x envs x steps.
Hyperparameters follow OpenAI baselines' `a2c` (RMSprop, lr 7e-4 decayed linearly, 5 steps).

Learning rate and world size. With more ranks the global batch grows (16 x 5 = 80 samples per
rank), and `--lr-scaling` chooses how the learning rate follows, relative to one rank:
`none` keeps it, `linear` multiplies it by the number of ranks (Goyal et al. 2017, for SGD),
`sqrt` by its square root (the rule usually given for adaptive optimizers such as RMSprop and
Adam). Default `none`. We could not confirm from the paper's text which rule its A2C runs used.
The authors' code (github.com/astooke/accel_rl) takes the learning rate as a plain argument and
applies no rule, and its multi-GPU A2C example sweep keeps one rate (2.5e-4) for 64, 128 and 256
environments per learner. So treat the rate as a hyperparameter to retune when scaling out.

RMSprop as baselines runs it. TensorFlow's RMSprop (baselines) adds epsilon inside the square
root, PyTorch's outside. That changes the step size: gradients clipped to norm 0.5 over 1.7M
weights are a few 1e-4 per weight, so TensorFlow's sqrt(1e-5) = 3e-3 floor sets the step, where
PyTorch's 1e-5 would let each weight move by about the learning rate. We pass sqrt(--rmsprop-eps)
as PyTorch's epsilon, which keeps the denominator within a factor sqrt(2) of TensorFlow's.
TensorFlow also starts the mean square at 1, not 0; we keep PyTorch's 0, because the 1 shrinks
the steps of the first several hundred updates (it decays as 0.99^t), which in our short tests
only delayed learning.
(Stable-baselines3 documents PyTorch's plain RMSprop as less stable for A2C: RMSpropTFLike.)

A3C (--asynchronous; paper Sec. 3.2, Table 2: 50M steps in 2.4 / 1.3 / 0.65 hours on 2 / 4 / 8
GPUs). Each rank applies its own clipped gradient to central parameters and RMSProp statistics in
the machine's shared memory (common/central_optim.py: chunks under their own locks, whichever is
free first; the statistics shared by all ranks, as in the A3C paper), then pulls the central
parameters: no all-reduce, no rank waits for another inside an update. Ranks still meet at the
logging cadence, each having run the same iterations, so checkpoints and signals work as in A2C.

Launch:
    python algos/a2c_multigpu.py --env-id Pong-v5                         # one process
    torchrun --standalone --nproc_per_node 8 algos/a2c_multigpu.py        # 8 GPUs, one machine
    torchrun --standalone --nproc_per_node 8 algos/a2c_multigpu.py --asynchronous   # A3C
    torchrun --nnodes 2 --nproc_per_node 8 --rdzv-backend c10d \\
        --rdzv-endpoint HOST:29500 algos/a2c_multigpu.py                  # 2 machines
"""

from __future__ import annotations

import math
import os
import sys
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Literal

# torch's OpenMP threads spin after each parallel op by default, taking the cores the emulator
# threads need: on a 2-core CPU that cut the sampler to 0.4x the emulators' speed (docs/results.md).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
from torch.distributions import Categorical  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout, no install
from common import central_optim, checkpoint, cli, dist, envs, evaluation  # noqa: E402
from common import gpu, runs, signals  # noqa: E402
from common.central_optim import CentralOptimizer  # noqa: E402
from common.advantages import gae  # noqa: E402  # GAE, eq. 16 of Schulman et al. 2016
from common.logger import Logger, PhaseClock, crossed  # noqa: E402
from common.sampler import Sampler  # noqa: E402


@dataclass
class Args:
    env_id: str = "Pong-v5"
    """Atari game as Gymnasium spells it (Pong-v5, ALE/Pong-v5, PongNoFrameskip-v4), or any
    Gymnasium id (also 'module:Name-v0') with uint8 (4, 84, 84) observations and discrete actions"""
    seed: int = 1
    """seed for parameters, exploration and environments (each rank and environment gets its own)"""
    total_timesteps: int = 10_000_000
    """environment steps over all ranks (frames are 4x this); 10M is CleanRL's Atari budget"""
    num_envs: int = 16
    """environments per rank (paper: 16 per GPU for A2C)"""
    cuda: bool = True
    """use cuda:LOCAL_RANK with NCCL when a GPU exists; --no-cuda forces the CPU with gloo"""
    backend: Literal["auto", "nccl", "gloo"] = "auto"
    """auto: NCCL on GPUs, gloo on CPUs; gloo also lets several ranks share one GPU"""
    compile: bool = False
    """torch.compile the sampling step's network and the learner's minibatch loss (CUDA graphs on
    a GPU); compilation (10-60 s) is counted in the run's time (docs/results.md)"""
    precision: Literal["fp32", "bf16"] = "fp32"
    """the network's arithmetic in learning and sampling: bf16 autocast, outputs, losses, targets
    and optimizer state in float32 (docs/results.md: PPO's learner 2x faster on a bf16 CPU)"""
    channels_last: Literal["auto", "on", "off"] = "auto"
    """convolutions in channels-last memory format; auto: on a CPU (each learner 1.26-1.43x
    faster there, docs/results.md), not on a GPU (not yet measured there)"""
    run_dir: str | None = None
    """output directory; default runs/<env>__<script>__<seed>__<unix time>"""
    alternate: bool = False
    """alternating sampler: two env groups, one simulates while the other's actions are inferred"""
    checkpoint_interval: int = 0
    """global steps between checkpoints; 0 means none by steps (--checkpoint-minutes still saves)"""
    checkpoint_minutes: float = 10.0
    """wall-clock minutes between checkpoints, the most a crash or a lost machine costs; 0: none"""
    resume: str | None = None
    """checkpoint file or run directory to continue, up to --total-timesteps; 'auto': continue
    --run-dir's newest checkpoint if it has one, else start the run there"""
    keep_checkpoints: int = 3
    """newest checkpoints to keep (older ones are deleted once a new one is safely written); 0
    keeps all"""
    collective_timeout: float = 600.0
    """seconds a rank waits for the others in a collective before it gives up: a hung or dead
    rank then ends the run (and `torchrun --max-restarts` restarts it) instead of hanging it"""
    episodic_life: bool = True
    """end the learner's episode at each life loss, the game going on (paper: on)"""
    sticky_actions: bool = False
    """repeat the previous action with probability 0.25, as ALE v5 (paper: off)"""
    clip_rewards: bool = True
    """learn from sign(reward) (Nature DQN; the paper, all algorithms); episode statistics always
    report the raw score"""
    fire_reset: bool = True
    """press FIRE at every game start and after every lost life, in games that have it (Breakout
    serves the ball only then; common/envs.py); --no-fire-reset leaves it to the agent"""
    eval_interval: int = 250_000
    """global steps between evaluations on separate environments (common/evaluation.py); 0: only
    the final one at the end of the run"""
    eval_episodes: int = 8
    """games each rank plays per evaluation, cut ones included; 0 turns evaluation off"""
    eval_envs: int = 4
    """evaluation environments per rank, separate from the training ones"""
    eval_max_steps: int = 4_500
    """steps after which an evaluation game is cut and scored as it stands (18,000 frames, the
    5-minute cap of Machado et al. 2018)"""

    num_steps: int = 5
    """steps per environment per rollout (A3C paper's t_max, baselines' a2c, the paper's code)"""
    learning_rate: float = 7e-4
    """learning rate for one rank (baselines' a2c, the paper's code); see --lr-scaling"""
    lr_scaling: Literal["none", "linear", "sqrt"] = "none"
    """multiply --learning-rate by 1, the number of ranks, or its square root (module docstring)"""
    anneal_lr: bool = True
    """decay the learning rate linearly to 0 over --total-timesteps (baselines' a2c 'linear')"""
    optimizer: Literal["rmsprop", "adam"] = "rmsprop"
    """RMSprop as in the A3C paper and baselines' a2c; Adam (eps 1e-5) as rlpyt's A2C default"""
    rmsprop_alpha: float = 0.99
    """RMSprop decay of the mean squared gradient (A3C paper, baselines' a2c)"""
    rmsprop_eps: float = 1e-5
    """RMSprop epsilon, inside the square root as in TensorFlow (baselines' a2c)"""
    gamma: float = 0.99
    """discount factor (A3C paper)"""
    gae_lambda: float = 1.0
    """1.0: n-step returns (A3C paper, baselines, the paper's code); below 1: GAE, this lambda"""
    ent_coef: float = 0.01
    """entropy bonus coefficient (A3C paper, baselines' a2c)"""
    vf_coef: float = 0.5
    """coefficient on 0.5 (V - R)^2, i.e. 0.25 (V - R)^2 as in the paper's code (baselines: 0.5)"""
    max_grad_norm: float = 0.5
    """global gradient-norm clip, applied after averaging over ranks (baselines, paper's code); with
    --asynchronous to each rank's own gradient"""
    asynchronous: bool = False
    """asynchronous multi-GPU optimisation (paper Sec. 3.2): each rank applies its own gradients to
    central parameters and optimizer state in this machine's shared memory
    (common/central_optim.py), with no all-reduce; one machine only"""
    num_chunks: int = 3
    """chunks of the central parameters, each under its own lock (paper: 3)"""


def layer_init(layer: nn.Module, std: float = math.sqrt(2), bias: float = 0.0) -> nn.Module:
    nn.init.orthogonal_(layer.weight, std)  # orthogonal init as in baselines' Atari policies
    nn.init.constant_(layer.bias, bias)
    return layer


class Agent(nn.Module):
    """Nature-DQN torso (Mnih et al. 2015), policy and value heads; forward in --precision
    and --channels-last."""

    def __init__(self, num_actions: int, precision: str = "fp32", channels_last: str = "auto"):
        super().__init__()
        self.precision, self.channels_last = precision, channels_last
        self.torso = nn.Sequential(
            layer_init(nn.Conv2d(4, 32, 8, stride=4)), nn.ReLU(),
            layer_init(nn.Conv2d(32, 64, 4, stride=2)), nn.ReLU(),
            layer_init(nn.Conv2d(64, 64, 3, stride=1)), nn.ReLU(), nn.Flatten(),
            layer_init(nn.Linear(64 * 7 * 7, 512)), nn.ReLU())
        self.actor = layer_init(nn.Linear(512, num_actions), std=0.01)  # near-uniform first policy
        self.critic = layer_init(nn.Linear(512, 1), std=1.0)

    @gpu.in_modes
    def forward(self, obs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """obs uint8 [N, 4, 84, 84] -> logits [N, A], value [N] (float32)."""
        h = self.torso(obs.float() / 255.0)
        return self.actor(h), self.critic(h).squeeze(-1)


def nstep_returns(rewards, terminated, truncated, final_values, next_value, gamma):
    """n-step returns over a [T, B] rollout (A3C paper, Algorithm S3): for each step, the
    discounted rewards up to the end of the rollout plus the discounted value of the state there.

    At a termination the next state's value is 0. At a truncation it is the value of the true
    last observation (final_values), since the episode would have gone on. Either way the sum
    does not cross into the next episode. next_value [B] bootstraps the last step.
    """
    returns = torch.empty_like(rewards)  # [T, B]
    running = next_value  # [B]: the return from the state after step t
    for t in reversed(range(rewards.shape[0])):
        running = torch.where(truncated[t], final_values[t], running)
        running = torch.where(terminated[t], torch.zeros_like(running), running)
        running = rewards[t] + gamma * running
        returns[t] = running
    return returns


def make_optimizer(agent: Agent, args: Args, lr: float) -> torch.optim.Optimizer:
    if args.optimizer == "adam":
        return gpu.adam(agent.parameters(), lr=lr, eps=1e-5)
    # TensorFlow-like RMSprop (module docstring): sqrt(eps) outside the root stands in for eps
    # inside it, as in baselines' TF1 optimizer.
    return torch.optim.RMSprop(agent.parameters(), lr=lr, alpha=args.rmsprop_alpha,
                               eps=math.sqrt(args.rmsprop_eps))


def a2c_loss(agent: Agent, rollout: dict[str, torch.Tensor], next_obs: torch.Tensor, args: Args
             ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """A2C's loss on a [T, B] rollout and the next observations [B] -> (loss, statistics); one
    graph under --compile.

    One forward pass gives the loss terms and the bootstrap value of next_obs; the parameters are
    still those that sampled the rollout, so the values are on-policy.
    """
    T, B = rollout["rewards"].shape
    obs = torch.cat([rollout["obs"].flatten(0, 1), next_obs])  # [(T + 1) * B, 4, 84, 84] uint8
    logits, values = agent(obs)
    logits, values, next_value = logits[:T * B], values[:T * B], values[T * B:].detach()
    with torch.no_grad():
        v = values.detach().view(T, B)  # [T, B]
        if args.gae_lambda == 1.0:
            returns = nstep_returns(rollout["rewards"], rollout["terminated"], rollout["truncated"],
                                    rollout["final_values"], next_value, args.gamma)
            advantages = returns - v
        else:
            advantages = gae(rollout["rewards"], v, rollout["terminated"], rollout["truncated"],
                             rollout["final_values"], next_value, args.gamma, args.gae_lambda)
            returns = advantages + v
    returns, advantages = returns.flatten(), advantages.flatten()  # [T * B]

    # A3C paper Sec. 4: the policy gradient weighted by the advantage (a constant here, so only
    # the value loss trains the critic), a squared value error, and an entropy bonus that keeps
    # the policy from collapsing early.
    pi = Categorical(logits=logits)
    pg_loss = -(advantages * pi.log_prob(rollout["actions"].flatten())).mean()
    v_loss = 0.5 * ((values - returns) ** 2).mean()
    entropy = pi.entropy().mean()
    loss = pg_loss - args.ent_coef * entropy + args.vf_coef * v_loss
    with torch.no_grad():
        explained_var = 1 - torch.var(returns - values) / torch.var(returns).clamp(min=1e-8)
    return loss, {"policy_loss": pg_loss.detach(), "value_loss": v_loss.detach(),
                  "entropy": entropy.detach(), "explained_variance": explained_var}


def a2c_update(agent: Agent, optimizer: torch.optim.Optimizer, rollout: dict[str, torch.Tensor],
               next_obs: torch.Tensor, args: Args, central: CentralOptimizer | None = None
               ) -> tuple[dict[str, torch.Tensor], float]:
    """One A2C step on this rank's [T, B] rollout; returns (stats as device tensors, comm seconds).

    A2C: the gradient is averaged over ranks before clipping and the optimizer step, so with R
    ranks the step sees R x T x B samples and every rank stays identical. A3C (`central`): this
    rank's own clipped gradient goes into the central optimizer, whose new parameters it pulls;
    comm is then the wait for chunks other ranks held. Nothing here waits for the device (no
    .item()): the stats stay tensors until the logging cadence reads them.
    """
    loss, stats = gpu.compiled(a2c_loss, args.compile)(agent, rollout, next_obs, args)
    optimizer.zero_grad(set_to_none=False)
    loss.backward()
    comm = 0.0 if central else dist.all_reduce_grads(agent)
    grad_norm = nn.utils.clip_grad_norm_(agent.parameters(), args.max_grad_norm)
    if central is None:
        optimizer.step()
    else:  # chunk by chunk, whichever is free first, then the result (other ranks' steps too)
        comm = central.step(optimizer.param_groups[0]["lr"])
        central.pull()
    return {**stats, "grad_norm": grad_norm}, comm


def main() -> None:
    # joins the process group; on resume, the run's flags; 0 would clip every gradient to 0
    args, world = cli.parse_args(Args, ranges={"max_grad_norm": cli.POSITIVE})
    batch_per_rank = args.num_envs * args.num_steps
    if args.asynchronous:
        central_optim.check(args, world)
    if args.asynchronous and args.lr_scaling != "none":
        dist.fail("--lr-scaling scales the step of the synchronous global batch; with "
                  "--asynchronous each rank steps on its own batch: leave it at none")

    # ---- set-up: environments, run directory, model, optimizer, resume ----
    device = world.device
    try:
        env_groups = envs.make_envs(args.env_id, args.num_envs, groups=2 if args.alternate else 1,
                                    episodic_life=args.episodic_life,
                                    sticky_actions=args.sticky_actions, fire_reset=args.fire_reset)
        eval_env = evaluation.make_envs(args)
    except envs.EnvError as e:
        dist.fail(str(e))
    run_dir, state = runs.prepare_run(args, "a2c_multigpu", world,
                                           check=partial(central_optim.refusal, args))

    base_lr = args.learning_rate * {"none": 1.0, "linear": world.world_size,
                                    "sqrt": math.sqrt(world.world_size)}[args.lr_scaling]
    torch.manual_seed(args.seed)  # same initial parameters on every rank (broadcast below too)
    agent = Agent(env_groups[0].num_actions, args.precision, args.channels_last).to(device)
    optimizer = make_optimizer(agent, args, base_lr)
    torch.manual_seed(args.seed * 1000 + world.rank)  # per-rank action sampling
    np.random.seed(args.seed * 1000 + world.rank)
    global_step = checkpoint.restore(state, world, model=agent, **(  # or 0
        {} if args.asynchronous else {"optimizer": optimizer}))
    dist.broadcast_params(agent)
    # Before the central state exists: from now on Ctrl-C or SIGTERM stops cleanly.
    stop = signals.StopRequest(args)
    central = None
    if args.asynchronous:  # A3C: rank 0 writes the central state, the others attach to it
        rule = (dict(rule="adam", eps=1e-5) if args.optimizer == "adam" else  # as make_optimizer
                dict(rule="rmsprop", alpha=args.rmsprop_alpha, eps=math.sqrt(args.rmsprop_eps)))
        central = central_optim.shared(partial(CentralOptimizer, agent.parameters(),
                                               args.num_chunks, global_step=global_step, **rule),
                                       world, state and state["optimizer"])
        central.pull()
    central_step = global_step  # A3C: the machine's step count at this rank's last rollout

    global_batch = batch_per_rank * world.world_size
    # An iteration is only 80 steps per rank: logging (an all-gather and TensorBoard writes) and
    # the stop check (an all-reduce) run every log_every iterations, about 2048 steps per rank.
    # It depends on this launch's iteration count alone, so all ranks reach them together.
    log_every = max(1, 2048 // batch_per_rank)
    sampler = Sampler(env_groups, args.num_steps, device, clip_rewards=args.clip_rewards)
    sampler.reset(envs.env_seeds(args.seed, world.rank, args.num_envs, offset=global_step))
    logger = Logger(run_dir, world, args, state, global_batch)
    phases = PhaseClock(device, sampler)  # seconds per phase between log calls

    step = gpu.compiled(agent, args.compile)

    def policy(obs):  # obs uint8 [n, 4, 84, 84] -> actions [n]; values are recomputed to learn
        return Categorical(logits=step(obs)[0]).sample(), {}

    def save():
        if central is not None:  # once every rank is between updates, the central copy is whole
            dist.all_gather(None)
            central.pull()
        return checkpoint.save(run_dir, world, global_step, args.keep_checkpoints,
                               {"model": agent.state_dict(), "logger": logger.state(),
                                "optimizer": (central or optimizer).state_dict(),
                                "asynchronous": args.asynchronous, "env_id": args.env_id,
                                "script": "a2c_multigpu"})

    def evaluate():  # whole games, actions sampled from the policy (common/evaluation.py)
        return evaluation.evaluate(lambda obs: policy(obs)[0], eval_env, args, world, global_step)

    saved_at, logged_at, last_eval = global_step, global_step, None

    stopped = False  # by a signal: no final evaluation, the job must end quickly
    stat_sums, stat_count = {}, 0  # device tensors, summed over the iterations between logs
    iteration = 0
    while global_step < args.total_timesteps:
        iteration += 1
        if central is not None:  # the ranks meet only at the logging cadence: look each time
            central.check_peers()
        # The schedule follows the global step, so a resume with other ranks or batches goes on
        # where it stopped. A3C: the central count, other ranks' steps included. Every rank runs
        # the same iterations between the meetings (logging, checkpoints), so `global_step`, all
        # ranks' steps as A2C counts them, is the central count whenever the ranks meet.
        lr = base_lr * (max(0.0, 1.0 - central_step / args.total_timesteps)
                        if args.anneal_lr else 1.0)
        optimizer.param_groups[0]["lr"] = lr

        # ---- sampling: T steps of B envs, one batched forward pass per step ----
        rollout = sampler.collect(policy, value_fn=lambda o: agent(o)[1])
        global_step += global_batch
        central_step = central.add_steps(batch_per_rank) if central else global_step

        # ---- learning: n-step returns on this rank's rollout, one step on averaged gradients ----
        with phases("learn"):
            stats, seconds = a2c_update(agent, optimizer, rollout, sampler.next_obs, args, central)
        phases.add("comm", seconds, taken_from="learn")
        for k, v in stats.items():
            stat_sums[k] = stat_sums.get(k, 0.0) + v
        stat_count += 1

        # ---- evaluation, logging and checkpoints ----
        if crossed(args.checkpoint_interval, global_step, global_step - global_batch):
            save()
            saved_at = global_step
        if iteration % log_every and global_step < args.total_timesteps:
            continue  # not a logging iteration: keep accumulating stats and phase times
        if eval_env and crossed(args.eval_interval, global_step, logged_at):
            with phases("eval"):
                last_eval = logger.eval(global_step, evaluate())
        means = (torch.stack(list(stat_sums.values())) / stat_count).tolist()  # one host sync
        logger.log(global_step,
                   {**{f"losses/{k}": m for k, m in zip(stat_sums, means)},
                    "charts/learning_rate": lr},
                   sampler.pop_episodes(), phases.pop())
        logged_at, stat_sums, stat_count = global_step, {}, 0
        if stopped := stop(world, global_step):  # all ranks agree; rank 0 says how to continue
            break
        if stop.checkpoint_due and saved_at != global_step:  # --checkpoint-minutes
            save()
            saved_at = global_step

    if saved_at != global_step:
        path = save()
        if world.is_main:
            print(f"\ncheckpoint: {path}", flush=True)
    if eval_env and not stopped and (last_eval is None
                                     or last_eval["global_step"] != global_step):
        last_eval = logger.eval(global_step, evaluate())  # the final evaluation
    logger.summary(global_step, last_eval,
                   **({"central_step": central.add_steps(0)} if central else {}))
    logger.close()
    if central is not None:
        central.close()
    for e in env_groups + ([eval_env] if eval_env else []):
        e.close()
    dist.finish()


if __name__ == "__main__":
    main()
