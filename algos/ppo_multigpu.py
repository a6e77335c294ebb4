"""PPO on Atari, synchronous and data-parallel over GPUs.

Proximal Policy Optimization (Schulman et al. 2017, arXiv 1707.06347) as run in "Accelerated
Methods for Deep Reinforcement Learning" (Stooke & Abbeel 2018, arXiv 1803.02811): one process per
GPU, each driving its own emulators with batched inference (paper Sec. 3.1), and every optimizer
step taken on gradients averaged over all GPUs (Sec. 3.2), so all ranks hold the same parameters.
Hyperparameters follow CleanRL's `ppo_atari.py`, which matches the PPO paper's Atari settings.

Launch:
    python algos/ppo_multigpu.py --env-id Pong-v5                         # one process
    torchrun --standalone --nproc_per_node 8 algos/ppo_multigpu.py        # 8 GPUs, one machine
    (several machines: README, Launching)
"""

from __future__ import annotations

import math
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch starts OpenMP; docs/results.md
import numpy as np
import torch
import torch.nn as nn
from torch.distributions import Categorical

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout, no install
from common import cli, dist, envs, evaluation, gpu
from common.advantages import gae  # GAE, eq. 16 of Schulman et al. 2016
from common.grad_step import AllReduceStep
from common.run import Run, RunArgs
from common.running_norm import RunningNorm
from common.sampler import Sampler


@dataclass
class Args(RunArgs):  # the flags every script shares: common/run.py
    num_envs: int = 8
    """environments per rank (paper: 8 per GPU for PPO)"""
    num_steps: int = 128
    """steps per environment per rollout (PPO paper, Atari)"""
    learning_rate: float = 2.5e-4
    """Adam learning rate (PPO paper, Atari)"""
    anneal_lr: bool = True
    """decay the learning rate linearly to 0 over --total-timesteps (PPO paper, Atari)"""
    gamma: float = 0.99
    """discount factor (PPO paper)"""
    gae_lambda: float = 0.95
    """GAE lambda (PPO paper)"""
    num_minibatches: int = 4
    """minibatches per epoch, each rank splitting its own batch (PPO paper: 4 x 256)"""
    update_epochs: int = 4
    """passes over each batch (Atari: 3 in the PPO paper, 4 in CleanRL and baselines' ppo2)"""
    norm_adv: bool = True
    """normalise advantages, with statistics over the global batch (see ppo_update)"""
    clip_coef: float = 0.1
    """surrogate clipping epsilon (PPO paper, Atari)"""
    clip_vloss: bool = True
    """clip the value function update like the policy's (baselines' ppo2)"""
    ent_coef: float = 0.01
    """entropy bonus coefficient (PPO paper, Atari)"""
    vf_coef: float = 0.5
    """value loss coefficient (baselines' ppo2)"""
    max_grad_norm: float = 0.5
    """global gradient-norm clip, applied after averaging over ranks (baselines' ppo2)"""
    target_kl: float | None = None
    """stop an update's epochs early when the rank-averaged approximate KL exceeds this"""
    kl_threshold: float | None = None
    """adapt the learning rate to keep each epoch's rank-averaged approximate KL near this
    (rl_games' lr_schedule adaptive; its Pong configs: 0.01; adaptive_lr); replaces --anneal-lr;
    a resume goes on at the adapted rate"""
    normalize_input: bool = False
    """feed the network each input element normalised by its running mean and standard deviation,
    clipped to +-5 (rl_games' normalize_input; common/running_norm.py); off: frames / 255 (PPO
    paper)"""
    normalize_value: bool = False
    """learn the value in units of the returns' running standard deviation (rl_games'
    normalize_value, without its +-5 clips and with statistics of the returns alone:
    docs/results.md); the value loss, any clipping of it and --vf-coef apply in those units"""
    activation: Literal["relu", "elu"] = "relu"
    """the torso's nonlinearity (Nature DQN: relu; rl_games' Atari configs: elu)"""


def layer_init(layer: nn.Module, std: float = math.sqrt(2), bias: float = 0.0) -> nn.Module:
    nn.init.orthogonal_(layer.weight, std)  # orthogonal init as in baselines' Atari policies
    nn.init.constant_(layer.bias, bias)
    return layer


class Agent(nn.Module):
    """Nature-DQN torso (Mnih et al. 2015), policy and value heads; forward in --precision
    and --channels-last. With --normalize-input / --normalize-value it holds the running
    statistics (buffers, so checkpoints carry them) and returns the value in the returns' units."""

    def __init__(self, num_actions: int, precision: str = "fp32", channels_last: str = "auto",
                 activation: str = "relu", normalize_input: bool = False,
                 normalize_value: bool = False):
        super().__init__()
        self.precision, self.channels_last = precision, channels_last
        act = {"relu": nn.ReLU, "elu": nn.ELU}[activation]
        self.torso = nn.Sequential(
            layer_init(nn.Conv2d(4, 32, 8, stride=4)), act(),
            layer_init(nn.Conv2d(32, 64, 4, stride=2)), act(),
            layer_init(nn.Conv2d(64, 64, 3, stride=1)), act(), nn.Flatten(),
            layer_init(nn.Linear(64 * 7 * 7, 512)), act())
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


def act(agent: Agent, obs: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The sampler's policy: obs uint8 [n, 4, 84, 84] -> actions [n], {logprob [n], value [n]}."""
    logits, value = agent(obs)
    pi = Categorical(logits=logits)
    action = pi.sample()
    return action, {"logprob": pi.log_prob(action), "value": value}


def adaptive_lr(lr: float, kl: float, threshold: float) -> float:
    """rl_games' adaptive schedule: the learning rate / 1.5 after an epoch whose KL exceeds twice
    the threshold, x 1.5 after one under half of it, kept within [1e-6, 1e-2]."""
    if kl > 2 * threshold:
        return max(lr / 1.5, 1e-6)
    if kl < threshold / 2:
        return min(lr * 1.5, 1e-2)
    return lr


def ppo_loss(agent: Agent, mb: dict[str, torch.Tensor], args: Args
             ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The clipped-surrogate loss of one minibatch (obs [M, 4, 84, 84] uint8; actions, logprob,
    value, advantages, returns [M]) -> (loss, statistics); one graph under --compile."""
    logits, value = agent(mb["obs"])
    pi = Categorical(logits=logits)
    logratio = pi.log_prob(mb["actions"]) - mb["logprob"]
    ratio = logratio.exp()
    adv = mb["advantages"]
    pg_loss = torch.max(-adv * ratio,
                        -adv * ratio.clamp(1 - args.clip_coef, 1 + args.clip_coef)).mean()
    s = agent.value_scale()  # --normalize-value: value errors in the returns' standard deviations
    value, ret, old_v = value / s, mb["returns"] / s, mb["value"] / s
    if args.clip_vloss:
        v_clipped = old_v + (value - old_v).clamp(-args.clip_coef, args.clip_coef)
        v_loss = 0.5 * torch.max((value - ret) ** 2, (v_clipped - ret) ** 2).mean()
    else:
        v_loss = 0.5 * ((value - ret) ** 2).mean()
    entropy = pi.entropy().mean()
    loss = pg_loss - args.ent_coef * entropy + args.vf_coef * v_loss
    logratio, ratio = logratio.detach(), ratio.detach()  # KL estimators: joschu.net/blog/kl-approx
    return loss, {"policy_loss": pg_loss.detach(), "value_loss": v_loss.detach(),
                  "entropy": entropy.detach(), "old_approx_kl": (-logratio).mean(),
                  "approx_kl": ((ratio - 1) - logratio).mean(),
                  "clipfrac": ((ratio - 1).abs() > args.clip_coef).float().mean()}


def ppo_update(agent: Agent, step: AllReduceStep, batch: dict[str, torch.Tensor],
               args: Args) -> tuple[dict[str, float], float]:
    """PPO epochs over this rank's flat batch; returns (stats, comm seconds).

    Each minibatch's gradient is averaged over ranks before clipping and the Adam step, so with
    R ranks a step sees R x (batch / num_minibatches) samples and every rank stays identical.
    """
    adv = batch["advantages"]
    if args.norm_adv:
        # Global statistics, once per batch: per-rank (or per-minibatch) statistics would make the
        # R-rank update differ from a 1-rank update on the same data.
        m = dist.all_reduce_mean(torch.stack([adv.mean(), (adv * adv).mean()]))
        adv = (adv - m[0]) / (torch.sqrt(torch.clamp(m[1] - m[0] ** 2, min=0.0)) + 1e-8)
    data = {**batch, "advantages": adv}
    n = adv.shape[0]
    mb_size = n // args.num_minibatches
    loss_fn = gpu.compiled(ppo_loss, args.compile)
    sums: dict[str, torch.Tensor | float] = {}
    updates, comm = 0, 0.0
    for _ in range(args.update_epochs):
        perm = torch.randperm(n, device=adv.device)
        epoch_kl = 0.0  # summed into a new tensor: a compiled output lives until the next call
        for start in range(0, n, mb_size):
            idx = perm[start:start + mb_size]
            loss, stats = loss_fn(agent, {k: v[idx] for k, v in data.items()}, args)
            comm += step(loss)[1]
            epoch_kl = epoch_kl + stats["approx_kl"]
            for k, v in stats.items():
                sums[k] = sums.get(k, 0.0) + v  # device tensors: no host sync per minibatch
            updates += 1
        if args.target_kl is None and args.kl_threshold is None:
            continue
        # ranks must agree, or they would step different counts or rates
        kl = dist.all_reduce_mean((epoch_kl / args.num_minibatches).reshape(1)).item()
        if args.kl_threshold is not None:
            step.lr = adaptive_lr(step.lr, kl, args.kl_threshold)
        if args.target_kl is not None and kl > args.target_kl:
            break
    return {k: float(v) / updates for k, v in sums.items()}, comm


def main() -> None:
    run = Run(Args, ranges={"max_grad_norm": cli.POSITIVE})
    args, world, device = run.args, run.world, run.device
    batch_per_rank = args.num_envs * args.num_steps
    if batch_per_rank % args.num_minibatches:
        dist.fail(f"batch per rank (--num-envs x --num-steps = {batch_per_rank}) is not divisible "
                  f"by --num-minibatches {args.num_minibatches}")

    # ---- set-up: environments, model, optimizer, resume ----
    try:
        env_groups = envs.make_envs(args.env_id, args.num_envs, groups=2 if args.alternate else 1,
                                    episodic_life=args.episodic_life,
                                    sticky_actions=args.sticky_actions, fire_reset=args.fire_reset)
        eval_env = evaluation.make_envs(args)
    except envs.EnvError as e:
        dist.fail(str(e))
    torch.manual_seed(args.seed)  # same initial parameters on every rank (broadcast too)
    agent = Agent(env_groups[0].num_actions, args.precision, args.channels_last, args.activation,
                  args.normalize_input, args.normalize_value).to(device)
    optimizer = gpu.adam(agent.parameters(), lr=args.learning_rate, eps=1e-5)
    torch.manual_seed(args.seed * 1000 + world.rank)  # per-rank action sampling and minibatches
    np.random.seed(args.seed * 1000 + world.rank)
    global_step = run.restore(model=agent, optimizer=optimizer)
    step = AllReduceStep(agent, optimizer, args.max_grad_norm)  # the paper's synchronous step
    if args.kl_threshold is not None and run.state:  # a resume goes on at the adapted rate
        step.lr = run.state.get("learning_rate", args.learning_rate)

    global_batch = batch_per_rank * world.world_size
    sampler = Sampler(env_groups, args.num_steps, device, extras=("logprob", "value"),
                      clip_rewards=args.clip_rewards)
    sampler.reset(envs.env_seeds(args.seed, world.rank, args.num_envs, offset=global_step))
    sample = gpu.compiled(agent, args.compile)
    run.begin(global_step, global_batch, sampler=sampler, eval_env=eval_env,
              checkpoint=lambda: {"model": agent.state_dict(), "optimizer": step.state_dict(),
                                  "learning_rate": step.lr},
              policy=lambda obs: Categorical(logits=agent(obs)[0]).sample())  # evaluation

    while global_step < args.total_timesteps:
        if args.kl_threshold is None:  # on the global step, so that a resume goes on exactly
            step.lr = args.learning_rate * (
                max(0.0, 1.0 - global_step / args.total_timesteps) if args.anneal_lr else 1.0)

        # ---- sampling: T steps of B envs, one batched forward pass per step ----
        rollout = sampler.collect(lambda obs, _: act(sample, obs), value_fn=lambda o: agent(o)[1])
        global_step += global_batch

        # ---- learning: GAE on this rank's rollout, then PPO epochs on averaged gradients ----
        with run.phases("learn"):
            with torch.no_grad():
                next_value = agent(sampler.next_obs)[1]
                advantages = gae(rollout["rewards"], rollout["value"], rollout["terminated"],
                                 rollout["truncated"], rollout["final_values"], next_value,
                                 args.gamma, args.gae_lambda)
            batch = {"obs": rollout["obs"].flatten(0, 1),  # [T * B, 4, 84, 84] uint8
                     "actions": rollout["actions"].flatten(),
                     "logprob": rollout["logprob"].flatten(), "value": rollout["value"].flatten(),
                     "advantages": advantages.flatten(),
                     "returns": (advantages + rollout["value"]).flatten()}
            # rl_games' order: the statistics take in the batch before the epochs learn from it
            agent.update_norms(batch["obs"], batch["returns"])
            stats, comm = ppo_update(agent, step, batch, args)
        run.phases.add("comm", comm, taken_from="learn")

        # ---- logging, evaluation, checkpoints, stop ----
        y, y_pred = batch["returns"], batch["value"]
        run.record({**stats, "explained_variance":
                    1 - torch.var(y - y_pred) / torch.var(y).clamp(min=1e-8)})
        if run.end_iteration(global_step, {"charts/learning_rate": step.lr},
                             sampler.pop_episodes):
            break
    run.close(global_step, *env_groups, eval_env)


if __name__ == "__main__":
    main()
