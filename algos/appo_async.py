"""Asynchronous PPO on Atari: sampling overlaps learning, and GPUs never wait for each other.

APPO from "Accelerated Methods for Deep Reinforcement Learning" (Stooke & Abbeel 2018, Sec. 3.2,
Table 2): PPO (Schulman et al. 2017) with two asynchronies. Within a rank, a sampler process
(common/async_sampler.py) fills the next rollout while the learner trains, so the behaviour policy
lags one update and the loss is decoupled PPO's (Hilton et al. 2021). Across ranks, each minibatch
gradient steps a central Adam in shared memory (common/central_optim.py), no all-reduce. One
machine; docs/policy-gradient.md says more.

Launch:
    python algos/appo_async.py --env-id Pong-v5                           # one GPU (or the CPU)
    torchrun --standalone --nproc_per_node 8 algos/appo_async.py          # 8 GPUs, one machine
    python algos/appo_async.py --no-cuda --sampler-cores 0  # sampler on core 0, learner on the rest
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
from common import async_sampler, central_optim, cli, dist, envs, evaluation
from common import gpu, grad_step
from common.async_sampler import AsyncSampler, SamplerDied
from common.gpu import Upload
from common.advantages import gae  # GAE, eq. 16 of Schulman et al. 2016
from common.run import Run, RunArgs
from common.running_norm import RunningNorm


@dataclass
class Args(RunArgs):  # the flags every script shares: common/run.py
    total_timesteps: int = 10_000_000
    """environment steps trained on, over all ranks (frames are 4x this; dropped rollouts are
    not counted)"""
    num_envs: int = 8
    """environments per rank (paper: 8 per GPU for PPO and APPO)"""

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
    """minibatches per epoch, each a central Adam step (PPO paper: 4 x 256)"""
    update_epochs: int = 4
    """passes over each rollout (Atari: 3 in the PPO paper, 4 in CleanRL and baselines' ppo2)"""
    norm_adv: bool = True
    """normalise advantages with this rank's rollout statistics (ranks never wait for each
    other inside an update)"""
    clip_coef: float = 0.1
    """surrogate clipping epsilon (PPO paper, Atari); it also bounds what a stale rollout can
    do"""
    clip_vloss: bool = True
    """clip the value function update like the policy's (baselines' ppo2)"""
    ent_coef: float = 0.01
    """entropy bonus coefficient (PPO paper, Atari)"""
    vf_coef: float = 0.5
    """value loss coefficient (baselines' ppo2)"""
    max_grad_norm: float = 0.5
    """this rank's gradient-norm clip before its central Adam step (baselines' ppo2)"""
    target_kl: float | None = None
    """stop this rank's epochs on a rollout early when its approximate KL exceeds this"""
    kl_threshold: float | None = None
    """adapt this rank's learning rate to keep each epoch's approximate KL (to the proximal
    policy) near this (rl_games' lr_schedule adaptive; its Pong configs: 0.01; adaptive_lr);
    replaces --anneal-lr; a resume goes on at the adapted rate"""
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
    imp_samp_max: float = 100.0
    """cap on the importance ratio of the learner's policy to the behaviour policy, pi / mu, that
    weights each sample (openai/ppo-ewma's flag and default: only extreme ratios of very stale
    samples); 0: no cap"""

    num_buffers: int = 2
    """shared-memory rollout buffers per rank: 2 lets the sampler fill one while the learner
    trains on the other; more absorb jitter at the price of older rollouts"""
    max_policy_lag: int = 4
    """drop (and count) a rollout whose parameters are more than this many of the rank's updates
    older than the learner's; with 2 buffers the lag is 1 in steady state"""
    num_chunks: int = 3
    """chunks of the central parameters, each under its own lock (paper: 3)"""
    sampler_cores: tuple[int, ...] = ()
    """CPU cores for the sampler processes (emulators and inference), dealt out to the ranks of
    the machine (local rank r of n takes every n-th from the r-th); the learners run on the
    other cores. Empty: no pinning, everything shares the cores"""


def layer_init(layer: nn.Module, std: float = math.sqrt(2), bias: float = 0.0) -> nn.Module:
    nn.init.orthogonal_(layer.weight, std)  # orthogonal init as in baselines' Atari policies
    nn.init.constant_(layer.bias, bias)
    return layer


class Agent(nn.Module):
    """Nature-DQN torso (Mnih et al. 2015), policy and value heads; forward in --precision
    and --channels-last. With --normalize-input / --normalize-value it holds the running
    statistics (buffers: checkpoints carry them, and the sampler gets them with the parameters)
    and returns the value in the returns' units."""

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
        """Fold a batch (obs uint8 [N, 4, 84, 84], returns [N]) into the running statistics,
        averaged over ranks (every rank calls this once per rollout, with the same N)."""
        if self.obs_norm is not None:
            self.obs_norm.update(obs, scale=1 / 255.0)
        if self.value_norm is not None:
            self.value_norm.update(returns)


def act(agent: Agent, obs: torch.Tensor, cols: slice | None = None):
    """The sampler process's policy: obs uint8 [n, 4, 84, 84] -> actions [n], {logprob, value}
    (the same for every environment column)."""
    logits, value = agent(obs)
    pi = Categorical(logits=logits)
    action = pi.sample()
    return action, {"logprob": pi.log_prob(action), "value": value}


def value(agent: Agent, obs: torch.Tensor) -> torch.Tensor:
    """obs uint8 [n, 4, 84, 84] -> the behaviour policy's values [n] (bootstrapping)."""
    return agent(obs)[1]


def adaptive_lr(lr: float, kl: float, threshold: float) -> float:
    """rl_games' adaptive schedule: the learning rate / 1.5 after an epoch whose KL exceeds twice
    the threshold, x 1.5 after one under half of it, kept within [1e-6, 1e-2]."""
    if kl > 2 * threshold:
        return max(lr / 1.5, 1e-6)
    if kl < threshold / 2:
        return min(lr * 1.5, 1e-2)
    return lr


@torch.no_grad()
def proximal(agent: Agent, obs: torch.Tensor, actions: torch.Tensor,
             chunk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The proximal policy, the learner's before the update: obs [n, 4, 84, 84] uint8, actions
    [n] -> (log-probabilities of the actions [n], values [n])."""
    out = [agent(o) for o in obs.split(chunk)]
    logits, values = torch.cat([x[0] for x in out]), torch.cat([x[1] for x in out])
    return Categorical(logits=logits).log_prob(actions), values


def decoupled_pg_loss(logprob: torch.Tensor, behav_logprob: torch.Tensor,
                      prox_logprob: torch.Tensor, adv: torch.Tensor, clip_coef: float,
                      imp_samp_max: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Decoupled PPO's clipped surrogate (Hilton et al. 2021, Sec. 3), per sample
    max(-A w r, -A w clip(r, 1 - eps, 1 + eps)), r = pi / pi_prox, w = pi_prox / mu, r w = pi / mu
    capped at imp_samp_max -> (mean, r). With pi_prox = mu it is PPO's loss, bit for bit, while
    the cap does not bind (pi / mu <= imp_samp_max everywhere, or imp_samp_max 0)."""
    if imp_samp_max > 0:  # raising mu caps pi / mu; its gradient stays that of log pi
        behav_logprob = torch.maximum(behav_logprob, logprob.detach() - math.log(imp_samp_max))
    ratio = (logprob - prox_logprob).exp()
    weighted = -adv * (prox_logprob - behav_logprob).exp()
    return torch.max(weighted * ratio,
                     weighted * ratio.clamp(1 - clip_coef, 1 + clip_coef)).mean(), ratio


def appo_loss(agent: Agent, mb: dict[str, torch.Tensor], args: Args
              ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Decoupled PPO's loss of one minibatch -> (loss, statistics); the value clip is around
    the proximal values (with --normalize-value, all in the returns' standard deviations)."""
    logits, value = agent(mb["obs"])
    pi = Categorical(logits=logits)
    new_logprob, behav_logprob = pi.log_prob(mb["actions"]), mb["logprob"]
    pg_loss, ratio = decoupled_pg_loss(new_logprob, behav_logprob, mb["prox_logprob"],
                                       mb["advantages"], args.clip_coef, args.imp_samp_max)
    s = agent.value_scale()
    value, ret, old_v = value / s, mb["returns"] / s, mb["prox_value"] / s
    if args.clip_vloss:
        v_clipped = old_v + (value - old_v).clamp(-args.clip_coef, args.clip_coef)
        v_loss = 0.5 * torch.max((value - ret) ** 2, (v_clipped - ret) ** 2).mean()
    else:
        v_loss = 0.5 * ((value - ret) ** 2).mean()
    entropy = pi.entropy().mean()
    loss = pg_loss - args.ent_coef * entropy + args.vf_coef * v_loss
    logratio = (new_logprob - mb["prox_logprob"]).detach()  # joschu.net/blog/kl-approx
    behav_logratio = (new_logprob - behav_logprob).detach()  # what PPO's loss as is would clip
    ratio = ratio.detach()
    return loss, {"policy_loss": pg_loss.detach(), "value_loss": v_loss.detach(),
                  "entropy": entropy.detach(), "old_approx_kl": (-logratio).mean(),
                  "approx_kl": ((ratio - 1) - logratio).mean(),
                  "clipfrac": ((ratio - 1).abs() > args.clip_coef).float().mean(),
                  "clipfrac_behaviour": ((behav_logratio.exp() - 1).abs()
                                         > args.clip_coef).float().mean(),
                  "imp_samp_clipfrac": (behav_logratio > math.log(
                      args.imp_samp_max or math.inf)).float().mean()}


def appo_update(agent: Agent, step: grad_step.CentralStep, batch: dict[str, torch.Tensor],
                args: Args) -> tuple[dict[str, float], float]:
    """ppo_multigpu.ppo_update with appo_loss, each minibatch a central Adam step (Sec. 3.2);
    returns (stats, seconds waiting for chunks other ranks held)."""
    adv = batch["advantages"]
    if args.norm_adv:  # this rank's statistics: global ones would make ranks wait for each other
        mean, sq = adv.mean(), (adv * adv).mean()
        adv = (adv - mean) / (torch.sqrt(torch.clamp(sq - mean ** 2, min=0.0)) + 1e-8)
    data = {**batch, "advantages": adv}
    n = adv.shape[0]
    mb_size = n // args.num_minibatches
    loss_fn = gpu.compiled(appo_loss, args.compile)
    sums: dict[str, torch.Tensor | float] = {}
    updates, waited = 0, 0.0
    for _ in range(args.update_epochs):
        perm = torch.randperm(n, device=adv.device)
        epoch_kl = 0.0  # summed into a new tensor: a compiled output lives until the next call
        for start in range(0, n, mb_size):
            idx = perm[start:start + mb_size]
            loss, stats = loss_fn(agent, {k: v[idx] for k, v in data.items()}, args)
            waited += step(loss)[1]
            epoch_kl = epoch_kl + stats["approx_kl"]
            for k, v in stats.items():
                sums[k] = sums.get(k, 0.0) + v  # device tensors: no host sync per minibatch
            updates += 1
        if args.target_kl is None and args.kl_threshold is None:
            continue
        kl = (epoch_kl / args.num_minibatches).item()  # this rank's: ranks never wait here
        if args.kl_threshold is not None:
            step.lr = adaptive_lr(step.lr, kl, args.kl_threshold)
        if args.target_kl is not None and kl > args.target_kl:
            break
    return {k: float(v) / updates for k, v in sums.items()}, waited


def main() -> None:
    run = Run(Args, ranges={"max_grad_norm": cli.POSITIVE})
    args, world, device = run.args, run.world, run.device
    batch_per_rank = args.num_envs * args.num_steps
    central_optim.check(args, world, instead="use ppo_multigpu.py")
    if batch_per_rank % args.num_minibatches:
        dist.fail(f"batch per rank (--num-envs x --num-steps = {batch_per_rank}) is not divisible "
                  f"by --num-minibatches {args.num_minibatches}")
    if args.imp_samp_max != 0 and args.imp_samp_max < 1:
        dist.fail(f"--imp-samp-max must be 0 (no cap) or at least 1, got {args.imp_samp_max}")
    cores = async_sampler.pin(args, world)

    # ---- set-up: model, central optimizer, sampler process ----
    num_actions, eval_env = evaluation.probe(args)
    torch.manual_seed(args.seed)  # same initial parameters on every rank
    network = partial(Agent, num_actions, args.precision, args.channels_last, args.activation,
                      args.normalize_input, args.normalize_value)
    agent = network().to(device)
    torch.manual_seed(args.seed * 1000 + world.rank)  # per-rank minibatches
    np.random.seed(args.seed * 1000 + world.rank)
    global_step = run.restore(model=agent)
    step = central_optim.make_step(agent, None, run, asynchronous=True, eps=1e-5,
                                   max_grad_norm=args.max_grad_norm, num_chunks=args.num_chunks)
    step.lr = args.learning_rate
    if args.kl_threshold is not None and run.state:  # a resume goes on at the adapted rate
        step.lr = run.state.get("learning_rate", args.learning_rate)
    global_batch = batch_per_rank * world.world_size
    seeds = np.random.SeedSequence([args.seed, world.rank, global_step]).generate_state(1)
    env_kwargs = dict(env_id=args.env_id, num_envs=args.num_envs,
                      groups=2 if args.alternate else 1, episodic_life=args.episodic_life,
                      sticky_actions=args.sticky_actions, fire_reset=args.fire_reset,
                      num_threads=len(cores))
    sampler = AsyncSampler(network, act, value, env_kwargs, args.num_steps,
                           envs.env_seeds(args.seed, world.rank, args.num_envs, offset=global_step),
                           agent, device, extras=("logprob", "value"),
                           clip_rewards=args.clip_rewards, num_buffers=args.num_buffers,
                           seed=int(seeds[0]), cores=cores, threads=max(1, len(cores)),
                           compile=args.compile)
    upload = Upload(device)
    version = 0  # updates this rank's learner has published to its sampler
    lag = run.state["lag"] if run.state else [0, 0, 0, 0]  # sum, max, rollouts, dropped
    run.begin(global_step, global_batch, eval_env=eval_env,
              policy=lambda obs: act(agent, obs)[0],  # evaluation
              checkpoint=lambda: {"model": agent.state_dict(), "optimizer": step.state_dict(),
                                  "lag": list(lag), "learning_rate": step.lr})

    try:
        while global_step < args.total_timesteps:
            if args.kl_threshold is None:  # on the global step, so that a resume goes on exactly
                step.lr = args.learning_rate * (
                    max(0.0, 1.0 - global_step / args.total_timesteps) if args.anneal_lr else 1.0)

            # ---- sampling runs in the sampler process: take the next rollout fresh enough ----
            episodes, my_dropped = [], 0
            while True:
                i, info = sampler.get()
                for k, key in (("env", "time_env"), ("inference", "time_inference"),
                               ("sampler_wait", "sampler_wait"), ("learner_wait", "learner_wait")):
                    run.phases.add(k, info[key])  # the sampler's, overlapping learning
                episodes += info["episodes"]
                my_lag = version - info["version"]
                if my_lag <= args.max_policy_lag:
                    break
                my_dropped += 1  # too stale: its importance weights would be extreme
                sampler.release(i)
            rollout = upload(sampler.rollout(i))  # pinned copy to a GPU
            global_step += global_batch

            # ---- learning: GAE on the behaviour values, the proximal pass, PPO epochs ----
            with run.phases("learn"):
                with torch.no_grad():
                    advantages = gae(rollout["rewards"], rollout["value"], rollout["terminated"],
                                     rollout["truncated"], rollout["final_values"],
                                     rollout["next_value"], args.gamma, args.gae_lambda)
                batch = {"obs": rollout["obs"].flatten(0, 1),  # [T * B, 4, 84, 84] uint8
                         "actions": rollout["actions"].flatten(),
                         "logprob": rollout["logprob"].flatten(),
                         "value": rollout["value"].flatten(), "advantages": advantages.flatten(),
                         "returns": (advantages + rollout["value"]).flatten()}
                # rl_games' order: the statistics take in the batch before the epochs learn from
                # it; with them, ranks meet here too (the statistics are averaged over ranks)
                agent.update_norms(batch["obs"], batch["returns"])
                step.refresh()  # the proximal policy: other ranks' steps since our last included
                batch["prox_logprob"], batch["prox_value"] = proximal(
                    agent, batch["obs"], batch["actions"], batch_per_rank // args.num_minibatches)
                stats, comm = appo_update(agent, step, batch, args)
                version += 1
                sampler.publish(agent, version)
                sampler.release(i)  # only now: on the CPU the batch is a view of buffer i
            run.phases.add("comm", comm, taken_from="learn")

            # ---- logging, evaluation, checkpoints, stop: the once-per-rollout meeting ----
            with run.phases("comm"):  # waiting for slower ranks included
                lags = dist.all_gather((my_lag, my_dropped))
            lag[0] += sum(x for x, _ in lags)
            lag[1] = max(lag[1], *(x for x, _ in lags))
            lag[2] += len(lags)
            lag[3] += sum(d for _, d in lags)
            y, y_pred = batch["returns"], batch["value"]
            run.record({**stats, "explained_variance":
                        1 - torch.var(y - y_pred) / torch.var(y).clamp(min=1e-8)})
            if run.end_iteration(global_step, {
                    "charts/learning_rate": step.lr,
                    "charts/policy_lag_mean": sum(x for x, _ in lags) / len(lags),
                    "charts/policy_lag_max": max(x for x, _ in lags),
                    "charts/dropped_rollouts": lag[3]}, lambda: episodes):
                break
    except SamplerDied as e:
        print(f"error: rank {world.rank}: {e}; ending the run", file=sys.stderr, flush=True)
        step.close()
        dist.finish(1)  # leaves the group (NCCL peers fail at once) and kills the sampler
    finally:
        sampler.close()
    run.close(global_step, eval_env, step, policy_lag_mean=lag[0] / max(lag[2], 1),
              policy_lag_max=lag[1], dropped_rollouts=lag[3])


if __name__ == "__main__":
    main()
