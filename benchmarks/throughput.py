"""Throughput of accelrl's parts on this machine, and how close end-to-end training gets to them.

    python benchmarks/throughput.py [PART ...] [--no-cuda] [--seconds S] [--e2e-seconds S] ...

More: docs/benchmarks.md, `benchmarks/throughput.py`.
"""

from __future__ import annotations

import json
import sys
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from types import SimpleNamespace
from typing import Annotated

import tyro

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchmarks import outputs  # noqa: E402
from benchmarks.errors import UserError, fail  # noqa: E402
from benchmarks.throughput_parts import appo as appo_part  # noqa: E402
from benchmarks.throughput_parts import cat_dqn as catdqn_part  # noqa: E402
from benchmarks.throughput_parts import dqn as dqn_part  # noqa: E402
from benchmarks.throughput_parts import modes as modes_part  # noqa: E402
from benchmarks.throughput_parts import ppo as ppo_part  # noqa: E402
from benchmarks.throughput_parts.measure import split_problem  # noqa: E402  # sets OMP_WAIT_POLICY
from benchmarks.training import typed_path  # noqa: E402
from common.flag_ranges import out_of_range  # noqa: E402
import torch  # noqa: E402
from common import envs  # noqa: E402

# Families by their option group; each writes one JSON and measures the parts it lists.
FAMILIES = {"ppo": ppo_part, "dqn": dqn_part, "catdqn": catdqn_part, "appo": appo_part,
            "modes": modes_part}
PARTS = {name: key for key, family in FAMILIES.items() for name in family.PARTS}
HELP = ("Throughput of accelrl's parts on this machine, and how close end-to-end training gets "
        "to them.\n\nParts (any subset; none named: all of them): ppo (raw env, sampler, PPO's "
        "learner, PPO end to end), a2c (A2C end to end), dqn, dqn-async, catdqn, appo, modes "
        "(each learner in each speed mode); what each "
        "measures: "
        "benchmarks/throughput_parts/*.py. One JSON per family in --out DIR; by default in "
        "runs/benchmarks/, numbered -2, -3, ... rather than over an existing file.")


@dataclass
class Args:
    parts: Annotated[tuple[str, ...], tyro.conf.Positional, tyro.conf.arg(metavar="PART")] = \
        tuple(PARTS)
    """parts to measure, any of ppo a2c dqn dqn-async catdqn appo modes; none named: all"""
    env_id: str = "Pong-v5"
    """game to measure (environments, and every end-to-end run)"""
    cuda: bool = True
    """use the GPU when one exists (inference, learning, end-to-end runs); --no-cuda forces CPU"""
    torch_threads: int = 0
    """torch CPU threads; 0 keeps torch's default, like the training scripts"""
    seed: int = 1
    """seed for environments, actions, parameters and the synthetic batches"""
    out: str | None = None
    """folder for the JSON files, written as given (overwriting); default runs/benchmarks, where
    the next free name (-2, -3, ...) is taken rather than overwrite a file"""
    seconds: float | None = None
    """timed seconds of every part's in-process measurements; default: each family's --*.seconds"""
    e2e_seconds: float | None = None
    """seconds every end-to-end run trains after its first progress line; default: each
    family's --*.e2e-seconds"""
    ppo: ppo_part.Args = field(default_factory=ppo_part.Args)
    dqn: dqn_part.Args = field(default_factory=dqn_part.Args)
    catdqn: catdqn_part.Args = field(default_factory=catdqn_part.Args)
    appo: appo_part.Args = field(default_factory=appo_part.Args)
    modes: modes_part.Args = field(default_factory=modes_part.Args)


def settings(args: Args, key: str) -> SimpleNamespace:
    """One family's settings as a flat record (the shared options, then its own, with
    --seconds and --e2e-seconds applied): what its JSON stores as "args"."""
    own = getattr(args, key)
    own = replace(own, **{k: v for k, v in (("seconds", args.seconds),
                                            ("e2e_seconds", args.e2e_seconds)) if v is not None})
    return SimpleNamespace(env_id=args.env_id, cuda=args.cuda, torch_threads=args.torch_threads,
                           seed=args.seed, out=args.out, **asdict(own))


def output_path(stem: str, device: torch.device, out: str | None) -> Path:
    if out:
        return Path(out) / f"{stem}-{outputs.host()}-{device.type}.json"
    free = outputs.unused(outputs.RUNS / f"{stem}-{outputs.host()}-{device.type}", (".json",))
    return Path(f"{free}.json")  # not with_suffix: a host name may hold dots


def run_parts(names, args: Args, write: bool = True) -> dict[str, dict]:
    """Measure the named parts (none: all) as args say; print each family's table and, if write,
    its JSON (see output_path). Returns each family's result by its key in FAMILIES. Raises
    UserError for bad input before anything is measured. Sets torch's thread count when
    args.torch_threads is set."""
    names = list(dict.fromkeys(names)) or list(PARTS)
    if bad := [n for n in names if n not in PARTS]:
        raise UserError(f"unknown part {bad[0]!r}; choose from {', '.join(PARTS)}")
    if problem := out_of_range(args):
        raise UserError(problem)
    chosen = {key: settings(args, key) for key in FAMILIES if key in {PARTS[n] for n in names}}
    if "appo" in chosen and (problem := appo_part.check(chosen["appo"])):
        raise UserError(problem)
    if "modes" in chosen and (problem := modes_part.check(chosen["modes"])):
        raise UserError(problem)
    if "dqn-async" in names and (problem := split_problem("--dqn.sampler-cores",
                                                          chosen["dqn"].sampler_cores)):
        raise UserError(problem)
    try:
        num_actions = envs.num_actions(args.env_id)
    except envs.EnvError as e:
        raise UserError(str(e)) from None

    if args.torch_threads:
        torch.set_num_threads(args.torch_threads)
    device = torch.device("cuda" if args.cuda and torch.cuda.is_available() else "cpu")
    hw = outputs.hardware(device)
    print(f"hardware: {hw['line']}", flush=True)
    results = {}
    for key, a in chosen.items():
        res = results[key] = {"hardware": hw, "device": str(device),
                              "args": {**vars(a), "out": typed_path(a.out)}}
        FAMILIES[key].run(res, a, set(names), device, num_actions)
        res["table_markdown"] = FAMILIES[key].report(res, a)
        print("\n" + res["table_markdown"])
        if write:
            path = output_path(FAMILIES[key].STEM, device, args.out)
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(res, indent=2, default=str))
            print(f"\nwrote {path}\n", flush=True)
    return results


def main() -> None:
    args = tyro.cli(Args, description=HELP)
    try:
        run_parts(args.parts, args)
    except UserError as e:
        fail(str(e))


if __name__ == "__main__":
    main()
