"""Every numeric flag of every script and benchmark has an allowed range (common/flag_ranges.py),
and a value outside it is refused in one line naming the flag, the value and the range: table
driven, flag by flag, in-process; then end to end for the two mistakes a user makes most (a
negative learning rate, a discount above 1): exit 2, one line, no run directory."""

import dataclasses
import typing

import pytest

from benchmarks import evaluate, experiments, gpu_check, plot, scaling, sprint, throughput
from common.cli import POSITIVE
from common.flag_ranges import FREE, RANGES, out_of_range
from tests.conftest import expect_error, load_algo

SCRIPTS = ("ppo_multigpu", "a2c_multigpu", "appo_async", "dqn_multigpu", "cat_dqn")
OWN = {s: {"max_grad_norm": POSITIVE} for s in ("ppo_multigpu", "a2c_multigpu", "appo_async")}
BENCHMARKS = (evaluate, experiments, gpu_check, plot, scaling, sprint, throughput)


def _args_classes():
    out = [(s, load_algo(s).Args) for s in SCRIPTS]
    return out + [(m.__name__.split(".")[-1], m.Args) for m in BENCHMARKS]


def _numeric(cls, prefix=""):
    """(flag prefix + field name, field name, int or float, is a tuple) of every numeric field,
    nested dataclasses (throughput's --ppo.*) included."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        t = hints[f.name]
        if dataclasses.is_dataclass(t):
            yield from _numeric(t, f"{prefix}{f.name}.")
            continue
        kinds = [a for a in typing.get_args(t) or (t,) if a is not type(None)]
        is_tuple = typing.get_origin(kinds[0]) is tuple
        inner = typing.get_args(kinds[0])[0] if is_tuple else kinds[0]
        if inner in (int, float):
            yield prefix + f.name, f.name, inner, is_tuple


def _instance(cls):
    """cls with its defaults; required fields (positional paths and names) get a placeholder."""
    hints = typing.get_type_hints(cls)
    need = {f.name: ("x",) if typing.get_origin(hints[f.name]) is tuple else "x"
            for f in dataclasses.fields(cls) if f.default is dataclasses.MISSING
            and f.default_factory is dataclasses.MISSING}
    return cls(**need)


def _outside(interval: str, kind):
    """Values just outside an interval: below its low end and, if finite, above its high end."""
    lo, hi = (float(x) for x in interval[1:-1].split(", "))
    step = 1 if kind is int else 0.5
    out = [lo - step if interval[0] == "[" else lo]
    if hi != float("inf"):
        out.append(hi + step if interval[-1] == "]" else hi)
    return [kind(v) for v in out]


CLASSES = _args_classes()


@pytest.mark.parametrize("name, cls", CLASSES, ids=[n for n, _ in CLASSES])
def test_every_numeric_flag_has_a_range_and_its_default_is_in_it(name, cls):
    for flag, field, _, _ in _numeric(cls):
        assert field in RANGES or field in FREE, f"{name}: --{flag} has no range"
    assert out_of_range(_instance(cls), OWN.get(name)) is None


@pytest.mark.parametrize("name, cls", CLASSES, ids=[n for n, _ in CLASSES])
def test_each_flag_outside_its_range_is_refused_naming_flag_value_and_range(name, cls):
    tried = 0
    for flag, field, kind, is_tuple in _numeric(cls):
        if field in FREE:
            continue
        interval = {**RANGES, **OWN.get(name, {})}[field]
        for bad in _outside(interval, kind):
            args = _instance(cls)
            holder, *path = flag.split(".")[::-1]  # nested: set it on throughput's --ppo etc.
            target = args
            for part in reversed(path):
                target = getattr(target, part)
            setattr(target, holder, (bad,) if is_tuple else bad)
            message = out_of_range(args, OWN.get(name))
            dashed = "--" + flag.replace("_", "-")
            assert message is not None and message.startswith(f"{dashed} must be "), (flag, bad)
            assert message.endswith(f", got {bad}") and "\n" not in message, message
            allowed = message[len(dashed) + 9:-len(f", got {bad}")]
            assert allowed in ("positive", f"in {interval}") or allowed.startswith(">= "), message
            tried += 1
    assert tried or name == "gpu_check"


@pytest.mark.parametrize("script", SCRIPTS)
def test_a_bad_hyperparameter_ends_the_script_in_one_line_with_no_run_directory(script, tmp_path):
    run = tmp_path / "run"
    assert expect_error(script, "--learning-rate", "-1", "--run-dir", str(run)) == \
        "error: --learning-rate must be positive, got -1.0"
    assert expect_error(script, "--gamma", "2", "--run-dir", str(run)) == \
        "error: --gamma must be in [0, 1], got 2.0"
    assert not run.exists()


def test_a_resumed_run_s_tuples_come_back_as_lists_and_are_checked_the_same():
    """A resume takes its flags from args.json, where tuples are JSON lists."""
    args = _instance(load_algo("dqn_multigpu").Args)
    args.sampler_cores = [0, 1]
    assert out_of_range(args) is None
    args.sampler_cores = [0, -1]
    assert out_of_range(args) == "--sampler-cores must be >= 0, got 0 -1"
