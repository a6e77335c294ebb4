"""The flags the five scripts share are one set of copies that must not drift: the same name,
type, default and help text in every script that has them (guide: flags shared by all scripts
have the same names and meaning everywhere)."""

import ast
import itertools

import pytest

from tests.conftest import ROOT

SCRIPTS = ("a2c_multigpu", "ppo_multigpu", "appo_async", "dqn_multigpu", "cat_dqn")
# Hyperparameters that several scripts have but whose defaults and sources are each algorithm's
# own (the paper's 16 environments for A2C, 8 for PPO; batch 512 for DQN, 2048 for C51; ...).
# Their kind of type must still agree (a Literal's choices are the algorithm's own too).
ALGORITHM_OWN = {
    "total_timesteps", "num_envs", "num_steps", "learning_rate", "gamma", "max_grad_norm",
    "anneal_lr", "optimizer", "gae_lambda", "ent_coef", "vf_coef", "num_minibatches",
    "update_epochs", "norm_adv", "clip_coef", "target_kl", "kl_threshold", "preset", "batch_size",
    "target_update_interval", "n_step", "double", "dueling", "prioritized", "adam_eps",
    "eps_schedule", "eps_end", "eps_decay_steps",
}


def _flags(script: str) -> dict[str, tuple[str, str, str]]:
    """{field: (type, default, help)} of a script's Args, read from its source, with those of the
    shared base classes it extends (common/run.py's RunArgs, common/replay_feed.py's...)."""
    tree = ast.parse((ROOT / "algos" / f"{script}.py").read_text())
    return _with_bases(next(n for n in tree.body if isinstance(n, ast.ClassDef)
                            and n.name == "Args"))


def _with_bases(cls: ast.ClassDef) -> dict[str, tuple[str, str, str]]:
    out = {}
    for base in map(ast.unparse, cls.bases):
        for module in sorted((ROOT / "common").glob("*.py")):
            tree = ast.parse(module.read_text())
            found = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == base]
            if found:
                out.update(_with_bases(found[0]))
    return {**out, **_fields(cls)}


def _fields(cls: ast.ClassDef) -> dict[str, tuple[str, str, str]]:
    out = {}
    for field, doc in zip(cls.body, cls.body[1:]):
        if isinstance(field, ast.AnnAssign):
            help_text = " ".join(doc.value.value.split())
            out[field.target.id] = (ast.unparse(field.annotation), ast.unparse(field.value),
                                    help_text)
    return out


FLAGS = {s: _flags(s) for s in SCRIPTS}


def test_every_flag_has_help():
    for script, flags in FLAGS.items():
        assert all(h for _, _, h in flags.values()), script


@pytest.mark.parametrize("a,b", list(itertools.combinations(SCRIPTS, 2)))
def test_shared_flags_are_identical(a, b):
    for name in sorted(FLAGS[a].keys() & FLAGS[b].keys()):
        if name in ALGORITHM_OWN:
            kind = [FLAGS[s][name][0].split("[")[0] for s in (a, b)]
            assert kind[0] == kind[1], (name, a, b)
        else:
            assert FLAGS[a][name] == FLAGS[b][name], (name, a, b)


def test_the_flags_every_script_needs_are_in_every_script():
    shared = {"env_id", "seed", "total_timesteps", "num_envs", "cuda", "run_dir", "alternate",
              "checkpoint_interval", "checkpoint_minutes", "resume", "keep_checkpoints",
              "collective_timeout",
              "episodic_life", "sticky_actions", "clip_rewards", "fire_reset", "eval_interval",
              "eval_episodes", "eval_envs", "eval_max_steps", "backend", "compile"}
    for script, flags in FLAGS.items():
        assert shared <= flags.keys(), (script, shared - flags.keys())


def test_an_unknown_flag_names_the_flags_it_may_stand_for():
    """One line naming the flag and what it may abbreviate (tyro's own guess for --lr was
    --anneal-lr); flags as tyro takes them (--no-x, --x=v) are known."""
    from common import cli
    from tests.conftest import load_algo
    Args = load_algo("ppo_multigpu").Args
    assert cli.unknown_flag(Args, ["--lr", "1e-3"]) == \
        "unknown flag --lr; did you mean --learning-rate?"
    assert cli.unknown_flag(Args, ["--ent", "0.1"]) == \
        "unknown flag --ent; did you mean --ent-coef?"
    assert "did you mean --num-envs" in cli.unknown_flag(Args, ["--num-env", "4"])
    assert cli.unknown_flag(Args, ["--zzz"]) == "unknown flag --zzz; --help lists the flags"
    assert cli.unknown_flag(Args, ["--no-cuda", "--total-timesteps=5", "--num-envs", "4",
                                   "--help"]) is None
