"""A trained agent from a checkpoint, ready to play in your own code (docs/evaluate.md):

    from common.trained import load
    agent = load("runs/Pong-v5__ppo_multigpu__1__1765000000")  # a run directory or a step_*.pt
    env = agent.make_envs(num_envs=2)          # the run's game and preprocessing, whole games
    obs = env.reset(seeds=[0, 1])               # uint8 [2, 4, 84, 84]
    env.send(agent.act(obs)); obs, reward, terminated, truncated, _ = env.recv()

A checkpoint names its script ("script"); the network is rebuilt from the weights and the run's
flags (args.json beside checkpoints/; a flag it lacks takes the script's default, and a named
--preset's values first). `benchmarks/evaluate.py` loads with the same call. Problems a user can
cause raise CheckpointError with a one-line message.
"""

from __future__ import annotations

import importlib.util
import sys
from dataclasses import dataclass, replace
from functools import cache
from pathlib import Path

import numpy as np
import torch

from common import checkpoint, envs, evaluation, runs
from common.exploration import epsilon_greedy

ROOT = Path(__file__).resolve().parents[1]
# What each script's network is: a policy-gradient Agent, a Q network, or C51's atom network.
SCRIPTS = {"a2c_multigpu": "pg", "ppo_multigpu": "pg", "appo_async": "pg",
           "dqn_multigpu": "dqn", "cat_dqn": "c51"}


class CheckpointError(ValueError):
    """A path, checkpoint or run a user gave that cannot be loaded: the message says why."""


@dataclass
class Trained:
    """A checkpoint's agent (`load`). `network`: the script's module, in eval mode on `device`;
    `args`: the run's flags (the script's Args); `kind`: "pg" (A2C, PPO, APPO: a policy), "dqn"
    or "c51" (epsilon-greedy on Q values)."""
    script: str
    kind: str
    args: object
    network: torch.nn.Module
    checkpoint: Path
    global_step: int
    device: torch.device

    def policy(self, greedy: bool = False, epsilon: float | None = None):
        """obs uint8 [n, 4, 84, 84] on `device` -> actions [n], as the run's evaluations act: a
        policy-gradient agent samples (greedy: its most likely action); the DQN family is
        epsilon-greedy at `epsilon` (default the run's --eval-epsilon; greedy: 0)."""
        if self.kind != "pg" and epsilon is None:
            epsilon = 0.0 if greedy else self.args.eval_epsilon
        return make_policy(self.kind, self.network, greedy, epsilon, self.device)

    @torch.no_grad()
    def act(self, obs: np.ndarray, greedy: bool = False,
            epsilon: float | None = None) -> np.ndarray:
        """Actions [n] (int64) for observations uint8 [n, 4, 84, 84] (numpy or torch)."""
        obs = torch.as_tensor(obs, device=self.device)
        return self.policy(greedy, epsilon)(obs).cpu().numpy()

    def make_envs(self, num_envs: int = 1) -> envs.Envs:
        """Environments of the run's game as its evaluations play it: whole games (episodic
        lives off), FIRE after a lost life as the run had it, its sticky actions, games cut at
        its --eval-max-steps. `reset(seeds)`, then `send(actions)` / `recv()` (common/envs.py)."""
        return evaluation.make_envs(replace(self.args, eval_envs=num_envs,
                                            eval_episodes=num_envs))


def load(path: str | Path, device: str | torch.device = "cpu") -> Trained:
    """The agent of a checkpoint file, or of a run directory's newest good checkpoint."""
    ckpt = find_checkpoint(Path(path))
    state = read_checkpoint(ckpt)
    script = state["script"]
    if script not in SCRIPTS:
        raise CheckpointError(f"checkpoint {ckpt} was written by {script!r}, which accelrl does "
                              f"not know (known: {', '.join(SCRIPTS)})")
    module = load_algo(script)
    run = run_args(module, ckpt, state)
    try:
        num_actions = envs.num_actions(run.env_id)
    except envs.EnvError as e:
        raise CheckpointError(str(e)) from None
    network = build_network(module, SCRIPTS[script], state["model"], num_actions, run)
    try:
        network.load_state_dict(state["model"])
    except RuntimeError as e:
        raise CheckpointError(f"checkpoint {ckpt} does not fit {script}'s network on "
                              f"{run.env_id} ({num_actions} actions): "
                              f"{str(e).splitlines()[0]}") from None
    device = torch.device(device)
    return Trained(script, SCRIPTS[script], run, network.to(device).eval(), ckpt,
                   state.get("global_step", 0), device)


@cache  # one module per script: two copies would hold two sets of dataclasses
def load_algo(name: str):
    """algos/<name>.py as a module (the scripts are launched by path, not installed)."""
    spec = importlib.util.spec_from_file_location(name, ROOT / "algos" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses resolve string annotations through sys.modules
    spec.loader.exec_module(module)
    return module


def find_checkpoint(path: Path) -> Path:
    """The checkpoint file a path names: itself, or a run directory's newest good one (damaged
    newer ones are named in warnings and skipped)."""
    if path.is_dir():
        found = checkpoint.checkpoints(path)
        if not found:
            raise CheckpointError(f"no checkpoint (step_*.pt) in {path}")
        skipped = []
        for ckpt in reversed(found):
            problem = checkpoint.verify(ckpt)
            if problem is None:
                for bad, why in skipped:
                    print(f"warning: skipping checkpoint {bad}: {why}", file=sys.stderr)
                return ckpt
            skipped.append((ckpt, problem))
        raise CheckpointError(f"no readable checkpoint in {path}: {found[-1].name}"
                              + (f" and {len(found) - 1} earlier" if len(found) > 1 else "")
                              + f" failed ({skipped[0][1]})")
    if not path.exists():
        raise CheckpointError(f"no such run directory or checkpoint: {path}")
    if problem := checkpoint.verify(path):
        raise CheckpointError(f"cannot read checkpoint {path}: {problem}")
    return path


def read_checkpoint(ckpt: Path) -> dict:
    """The checkpoint's state, checked to be an accelrl checkpoint."""
    try:
        state = checkpoint.load(ckpt)
    except ValueError as e:
        raise CheckpointError(str(e)) from None
    if not isinstance(state, dict) or "model" not in state or "script" not in state:
        raise CheckpointError(f"{ckpt} is not an accelrl checkpoint (it has no 'model' and "
                              "'script')")
    return state


def run_args(module, ckpt: Path, state: dict):
    """The run's flags as the script's Args: its defaults, then the run's --preset, then
    args.json (which holds the resolved flags; the earlier layers only fill what it lacks)."""
    try:
        saved = runs.saved_args(ckpt)
    except (OSError, ValueError) as e:
        raise CheckpointError(f"cannot read {checkpoint.run_of(ckpt) / 'args.json'}: {e}") \
            from None
    if not saved:
        print(f"warning: no args.json beside {ckpt.parent}; using {state['script']}'s defaults",
              file=sys.stderr)
    fields = module.Args.__dataclass_fields__
    preset = getattr(module, "PRESETS", {}).get(saved.get("preset"), {})
    merged = {**preset, **{k: tuple(v) if isinstance(v, list) else v
                           for k, v in saved.items() if k in fields},
              "env_id": state.get("env_id") or saved.get("env_id") or module.Args.env_id}
    return module.Args(**merged)


def build_network(module, kind: str, weights: dict, num_actions: int,
                  run=None) -> torch.nn.Module:
    """The script's network for `weights`. Dueling heads, C51's atoms and the policy-gradient
    scripts' running normalisers are read from the weights themselves (they are what was trained,
    whatever a flag says); PPO's and APPO's activation from the run's flags."""
    dueling = any(k.startswith("value.") for k in weights)
    if kind == "pg":
        options = dict(normalize_input="obs_norm.mean" in weights,
                       normalize_value="value_norm.mean" in weights)
        if "activation" in module.Args.__dataclass_fields__:
            options["activation"] = getattr(run, "activation", "relu")
        return module.Agent(num_actions, **options)
    if kind == "dqn":
        return module.QNetwork(num_actions, dueling)
    if "support" not in weights:
        raise CheckpointError("cat_dqn checkpoint without the model's 'support' (its atoms)")
    return module.C51Network(num_actions, weights["support"], dueling)


def make_policy(kind: str, model: torch.nn.Module, greedy: bool, epsilon: float | None,
                device: torch.device):
    """obs uint8 [n, 4, 84, 84] on device -> actions [n], as training's evaluations act: the
    policy-gradient scripts sample (greedy: argmax), the DQN family is epsilon-greedy."""
    if kind == "pg":
        if greedy:
            return lambda obs: model(obs)[0].argmax(1)
        return lambda obs: torch.distributions.Categorical(logits=model(obs)[0]).sample()
    q = model if kind == "dqn" else model.q_values
    return lambda obs: epsilon_greedy(q(obs), torch.full((len(obs),), epsilon, device=device))
