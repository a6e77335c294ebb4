"""A2C on Atari, synchronous and data-parallel over GPUs; with --asynchronous, A3C on one machine.

Advantage actor-critic (Mnih et al. 2016) as run in "Accelerated Methods for Deep Reinforcement
Learning" (Stooke & Abbeel 2018, Sec. 3): batched inference over 16 emulators per GPU, one step
per 5-step rollout on gradients averaged over GPUs; A3C steps a central optimizer in shared memory
instead. Settings: OpenAI baselines' `a2c`; the rest in docs/policy-gradient.md.

Launch:
    python algos/a2c_multigpu.py --env-id Pong-v5                         # one process
    torchrun --standalone --nproc_per_node 8 algos/a2c_multigpu.py        # 8 GPUs, one machine
    torchrun --standalone --nproc_per_node 8 algos/a2c_multigpu.py --asynchronous   # A3C
    (several machines: README, Launching)
"""

from __future__ import annotations

import math
import os
import sys
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Literal

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch starts OpenMP; docs/results.md
import numpy as np
import torch
import torch.nn as nn
from torch.distributions import Categorical

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout, no install
from common import central_optim, cli, dist, envs, evaluation, gpu, grad_step
from common.advantages import gae  # GAE, eq. 16 of Schulman et al. 2016
from common.run import Run, RunArgs
from common.running_norm import RunningNorm
from common.sampler import Sampler


@dataclass
class Args(RunArgs):  # the flags every script shares: common/run.py
    num_envs: int = 16
    """environments per rank (paper: 16 per GPU for A2C)"""

    num_steps: int = 5
    """steps per environment per rollout (A3C paper's t_max, baselines' a2c, the paper's code)"""
    learning_rate: float = 7e-4
    """learning rate for one rank (baselines' a2c, the paper's code); see --lr-scaling"""
    lr_scaling: Literal["none", "linear", "sqrt"] = "none"
    """multiply --learning-rate by 1, the ranks or their square root (docs/policy-gradient.md)"""
    anneal_lr: bool = True
    """decay the learning rate linearly to 0 over --total-timesteps (baselines' a2c 'linear')"""
    optimizer: Literal["rmsprop", "adam"] = "rmsprop"
    """RMSprop as in the A3C paper and baselines' a2c; Adam as rlpyt's A2C default"""
    adam_eps: float = 1e-5
    """Adam epsilon (rlpyt's A2C: 1e-5); a large one (Lapan's Pong A2C: 1e-3) damps the steps of
    parameters whose gradients are small, as under a tight --max-grad-norm"""
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
    normalize_input: bool = False
    """feed the network each input element normalised by its running mean and standard deviation,
    clipped to +-5 (rl_games' normalize_input; common/running_norm.py); off: frames / 255 (PPO
    paper)"""
    normalize_value: bool = False
    """learn the value in units of the returns' running standard deviation (rl_games'
    normalize_value, without its +-5 clips and with statistics of the returns alone:
    docs/results.md); the value loss, any clipping of it and --vf-coef apply in those units"""


def layer_init(layer: nn.Module, std: float = math.sqrt(2), bias: float = 0.0) -> nn.Module:
    nn.init.orthogonal_(layer.weight, std)  # orthogonal init as in baselines' Atari policies
    nn.init.constant_(layer.bias, bias)
    return layer


class Agent(nn.Module):
    """Nature-DQN torso (Mnih et al. 2015), policy and value heads; forward in --precision
    and --channels-last. With --normalize-input / --normalize-value it holds the running
    statistics (buffers, so checkpoints carry them) and returns the value in the returns' units."""

    def __init__(self, num_actions: int, precision: str = "fp32", channels_last: str = "auto",
                 normalize_input: bool = False, normalize_value: bool = False):
        super().__init__()
        self.precision, self.channels_last = precision, channels_last
        self.torso = nn.Sequential(
            layer_init(nn.Conv2d(4, 32, 8, stride=4)), nn.ReLU(),
            layer_init(nn.Conv2d(32, 64, 4, stride=2)), nn.ReLU(),
            layer_init(nn.Conv2d(64, 64, 3, stride=1)), nn.ReLU(), nn.Flatten(),
            layer_init(nn.Linear(64 * 7 * 7, 512)), nn.ReLU())
        self.actor = layer_init(nn.Linear(512, num_actions), std=0.01)  # near-uniform first policy
        self.critic = layer_init(nn.Linear(512, 1), std=1.0)
        self.obs_norm = RunningNorm(envs.OBS_SHAPE) if normalize_input else None
        self.value_norm = RunningNorm(()) if normalize_value else None

    @gpu.in_modes
    def forward(self, obs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """obs uint8 [N, 4, 84, 84] -> logits [N, A], value [N] (float32)."""
        x = obs.float() / 255.0
        h = self.torso(self.obs_norm(x) if self.obs_norm is not None else x)
        value = gpu.float32(self.critic, h).squeeze(-1)
        if self.value_norm is not None:
            value = self.value_norm.denormalize(value)
        return gpu.float32(self.actor, h), value

    def value_scale(self) -> torch.Tensor | float:
        """The unit the value is learned in: the returns' running standard deviation, or 1."""
        return self.value_norm.std() if self.value_norm is not None else 1.0

    def update_norms(self, obs: torch.Tensor, returns: torch.Tensor) -> None:
        """Fold a batch (obs uint8 [N, 4, 84, 84], returns [N]) into the running statistics."""
        if self.obs_norm is not None:
            self.obs_norm.update(obs, scale=1 / 255.0)
        if self.value_norm is not None:
            self.value_norm.update(returns)


def nstep_returns(rewards, terminated, truncated, final_values, next_value, gamma):
    """n-step returns over a [T, B] rollout (A3C paper, Algorithm S3), bootstrapped from
    next_value [B], 0 after a termination, the true last observation's value after a truncation."""
    returns = torch.empty_like(rewards)  # [T, B]
    running = next_value  # [B]: the return from the state after step t
    for t in reversed(range(rewards.shape[0])):
        running = torch.where(truncated[t], final_values[t], running)
        running = torch.where(terminated[t], torch.zeros_like(running), running)
        running = rewards[t] + gamma * running
        returns[t] = running
    return returns


def optimizer_rule(args: Args) -> dict:
    """The update rule and its settings, for make_optimizer and A3C's central optimizer alike."""
    if args.optimizer == "adam":
        return dict(rule="adam", eps=args.adam_eps)
    # TensorFlow's RMSprop: sqrt(eps) outside the root for eps inside (docs/policy-gradient.md)
    return dict(rule="rmsprop", alpha=args.rmsprop_alpha, eps=math.sqrt(args.rmsprop_eps))


def make_optimizer(agent: Agent, args: Args, lr: float) -> torch.optim.Optimizer:
    settings = optimizer_rule(args)
    make = gpu.adam if settings.pop("rule") == "adam" else torch.optim.RMSprop
    return make(agent.parameters(), lr=lr, **settings)


def a2c_loss(agent: Agent, rollout: dict[str, torch.Tensor], next_obs: torch.Tensor, args: Args
             ) -> tuple[torch.Tensor, dict[str, torch.Tensor], torch.Tensor]:
    """A2C's loss on a [T, B] rollout and next_obs [B] -> (loss, statistics, returns [T * B]):
    one forward pass, by the parameters that sampled the rollout, gives the terms and the
    bootstrap value."""
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

    # A3C paper Sec. 4: advantage-weighted policy gradient, value error, entropy bonus
    pi = Categorical(logits=logits)
    pg_loss = -(advantages * pi.log_prob(rollout["actions"].flatten())).mean()
    s = agent.value_scale()  # --normalize-value: value errors in the returns' standard deviations
    v_loss = 0.5 * (((values - returns) / s) ** 2).mean()
    entropy = pi.entropy().mean()
    loss = pg_loss - args.ent_coef * entropy + args.vf_coef * v_loss
    with torch.no_grad():
        explained_var = 1 - torch.var(returns - values) / torch.var(returns).clamp(min=1e-8)
    return loss, {"policy_loss": pg_loss.detach(), "value_loss": v_loss.detach(),
                  "entropy": entropy.detach(), "explained_variance": explained_var}, returns


def a2c_update(agent: Agent, step: grad_step.AllReduceStep, rollout: dict[str, torch.Tensor],
               next_obs: torch.Tensor, args: Args) -> tuple[dict[str, torch.Tensor], float]:
    """One step (all-reduced or central: common/grad_step.py) on this rank's [T, B] rollout;
    returns (stats as device tensors, comm seconds)."""
    loss, stats, returns = gpu.compiled(a2c_loss, args.compile)(agent, rollout, next_obs, args)
    grad_norm, comm = step(loss)
    # the statistics take in a rollout after its step, so its loss and bootstrap saw one set
    agent.update_norms(rollout["obs"].flatten(0, 1), returns)
    return {**stats, "grad_norm": grad_norm}, comm


def main() -> None:
    run = Run(Args, ranges={"max_grad_norm": cli.POSITIVE})
    args, world, device = run.args, run.world, run.device
    batch_per_rank = args.num_envs * args.num_steps
    if args.asynchronous:
        central_optim.check(args, world)
    if args.asynchronous and (args.normalize_input or args.normalize_value):
        dist.fail("--normalize-input and --normalize-value keep statistics that every rank updates "
                  "together after each step; A3C's ranks never meet: leave them off with "
                  "--asynchronous")
    if args.asynchronous and args.lr_scaling != "none":
        dist.fail("--lr-scaling scales the step of the synchronous global batch; with "
                  "--asynchronous each rank steps on its own batch: leave it at none")

    # ---- set-up: environments, model, optimizer (all-reduced or central), resume ----
    try:
        env_groups = envs.make_envs(args.env_id, args.num_envs, groups=2 if args.alternate else 1,
                                    episodic_life=args.episodic_life,
                                    sticky_actions=args.sticky_actions, fire_reset=args.fire_reset)
        eval_env = evaluation.make_envs(args)
    except envs.EnvError as e:
        dist.fail(str(e))
    base_lr = args.learning_rate * {"none": 1.0, "linear": world.world_size,
                                    "sqrt": math.sqrt(world.world_size)}[args.lr_scaling]
    torch.manual_seed(args.seed)  # same initial parameters on every rank (broadcast too)
    agent = Agent(env_groups[0].num_actions, args.precision, args.channels_last,
                  args.normalize_input, args.normalize_value).to(device)
    optimizer = make_optimizer(agent, args, base_lr)
    torch.manual_seed(args.seed * 1000 + world.rank)  # per-rank action sampling
    np.random.seed(args.seed * 1000 + world.rank)
    global_step = run.restore(partial(central_optim.refusal, args), model=agent)
    step = central_optim.make_step(agent, optimizer, run, asynchronous=args.asynchronous,
                                   max_grad_norm=args.max_grad_norm, num_chunks=args.num_chunks,
                                   **optimizer_rule(args))
    schedule_step = global_step  # schedules' step (A3C: the machine's, at this rank's rollout)

    global_batch = batch_per_rank * world.world_size
    sampler = Sampler(env_groups, args.num_steps, device, clip_rewards=args.clip_rewards)
    sampler.reset(envs.env_seeds(args.seed, world.rank, args.num_envs, offset=global_step))
    sample = gpu.compiled(agent, args.compile)

    def policy(obs, cols=None):  # obs uint8 [n, 4, 84, 84] -> actions [n]; values: recomputed
        return Categorical(logits=sample(obs)[0]).sample(), {}

    run.begin(global_step, global_batch, sampler=sampler, eval_env=eval_env,
              log_every=max(1, 2048 // batch_per_rank),
              policy=lambda obs: Categorical(logits=agent(obs)[0]).sample(),  # eager: own shape
              checkpoint=lambda: {"model": agent.state_dict(), "optimizer": step.state_dict(),
                                  "asynchronous": args.asynchronous})

    while global_step < args.total_timesteps:
        step.lr = base_lr * (max(0.0, 1.0 - schedule_step / args.total_timesteps)
                             if args.anneal_lr else 1.0)

        # ---- sampling: T steps of B envs, one batched forward pass per step ----
        rollout = sampler.collect(policy, value_fn=lambda o: agent(o)[1])
        global_step += global_batch
        schedule_step = step.count(batch_per_rank, global_step)

        # ---- learning: n-step returns on this rank's rollout, one step on averaged gradients ----
        with run.phases("learn"):
            stats, seconds = a2c_update(agent, step, rollout, sampler.next_obs, args)
        run.phases.add("comm", seconds, taken_from="learn")

        # ---- logging, evaluation, checkpoints, stop ----
        run.record(stats)
        if run.end_iteration(global_step, {"charts/learning_rate": step.lr},
                             sampler.pop_episodes):
            break
    run.close(global_step, *env_groups, eval_env, step, **step.summary())


if __name__ == "__main__":
    main()
