"""Every GPU path of accelrl and its headline numbers, in one call of at most 8 minutes.

    python benchmarks/gpu_check.py                        # on a GPU: at most 8 minutes
    python benchmarks/gpu_check.py --no-cuda --quick      # the same steps on a CPU, small: on
                                                          # 2 cores about 200 s of CPU time
    python benchmarks/gpu_check.py --steps ppo dqn --timeouts dqn=120

More: docs/benchmarks.md, `benchmarks/gpu_check.py`.
"""

from __future__ import annotations

import json
import os
import resource
import sys
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import tyro

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchmarks import outputs  # noqa: E402
from benchmarks.errors import UserError, fail, stop_on_sigterm  # noqa: E402
from benchmarks.training import Training, command, phase_shares, summary  # noqa: E402

ENV_ID = "Breakout-v5"
FAIL_VAR = "GPU_CHECK_FAIL_STEP"
QUICK_TIMEOUT = 240.0  # per step on a CPU: a guard against hangs, not a budget
GRACE = 15.0  # seconds a timed-out step gets to stop its runs (SIGTERM) before SIGKILL


@dataclass
class Args:
    cuda: bool = True
    """run on the GPU (refused when none is visible); --no-cuda: every step on the CPU"""
    quick: bool = False
    """small budgets, for a CPU (each end-to-end run to its second 2,048-step log line at most)
    or a first look"""
    out: str | None = None
    """folder for the JSON, the table and the step folder; default runs/benchmarks"""
    steps: tuple[str, ...] = ()
    """steps to run, in their usual order (none named: all): sprint ale sampler ppo a2c dqn catdqn
    appo resume two_ranks"""
    timeouts: tuple[str, ...] = ()
    """per-step timeouts as NAME=SECONDS (e.g. dqn=120), replacing the defaults"""
    step: str | None = None
    """internal: run this one step in this process (the parent starts one per step)"""
    work: str | None = None
    """internal: the step folder a --step process writes into"""


@dataclass(frozen=True)
class Sizes:
    """Budgets of one mode: the GPU's fit its step timeouts, the quick ones a 2-core CPU."""
    sprint: tuple[str, ...]  # benchmarks/sprint.py's flags
    envs: int  # the ceiling's envs, also PPO's, A2C's and APPO's
    num_steps: int  # PPO's rollout length
    appo_steps: int  # APPO's (its learner keeps 4 epochs x 4 minibatches)
    seconds: float  # each in-process measurement (throughput.py --seconds)
    e2e_seconds: float  # each end-to-end run after its first progress line
    replay: int  # the replay sampled from in process
    batch: int  # DQN's batch
    cat_batch: int  # C51's batch
    repeats: int  # projection calls, and DQN sample batches, timed
    ppo_flags: tuple[str, ...]  # PPO's learner settings
    modes_epochs: int  # PPO's epochs per call in the modes step (a minibatch step is timed)
    a2c_flags: tuple[str, ...]
    q_flags: tuple[str, ...]  # both DQN scripts' end-to-end flags
    small: tuple[int, int, int]  # envs, steps, total of the torchrun steps (resume: 2x total)


def cores() -> int:
    return len(os.sched_getaffinity(0))


def sizes(quick: bool) -> Sizes:
    envs = 4 * cores()  # enough per emulator thread that none waits on a slow one
    if quick:  # learning dominates on a CPU: one PPO epoch, few updates per 2,048-step log line
        return Sizes(sprint=("--env-id", "tests.catch_env:Catch-v0", "--minutes", "0.25",
                             "--no-speed-mode",
                             "--window", "20", "--targets", "-1", "-0.95", "--eval-episodes", "4",
                             "--extra=--num-steps 32 --learning-rate 1e-3"),
                     envs=envs, num_steps=16, appo_steps=8, seconds=0.5, e2e_seconds=0.5,
                     replay=10_000, batch=64, cat_batch=64, repeats=2,
                     ppo_flags=("--update-epochs", "1", "--num-minibatches", "1"),
                     modes_epochs=1,  # a CPU without bf16 units emulates it: 10x fp32's step
                     a2c_flags=("--num-steps", str(max(5, 2048 // envs))),  # one update a line
                     q_flags=("--num-envs", "16", "--num-steps", "16", "--replay-ratio", "0.25",
                              "--learning-starts", "1024", "--replay-size", "10000"),
                     small=(4, 16, 128))
    return Sizes(sprint=("--minutes", "3", "--eval-episodes", "4"),
                 envs=envs, num_steps=128, appo_steps=128, seconds=2.0, e2e_seconds=3.0,
                 replay=1_000_000, batch=512, cat_batch=2048, repeats=20, ppo_flags=(),
                 modes_epochs=4,
                 a2c_flags=(), q_flags=("--num-envs", "16", "--learning-starts", "2048",
                                        "--replay-size", "200000"), small=(8, 32, 1024))


class StepError(RuntimeError):
    """A step's own check failed: its message ends the step's log."""


# ---- rows: what a step reports, one per measurement ----

def row(measurement: str, steps_per_s: float | None = None, *, vs_ceiling: bool = True,
        notes: str = "", phase_share: dict | None = None, gpu_memory_bytes: int | None = None,
        key: str | None = None, value: float | None = None, in_process: bool = False) -> dict:
    """key/value: a number the targets read (e.g. updates/s); vs_ceiling: steps/s is env steps
    comparable with the ALE ceiling; in_process: the step's own process did the work."""
    return {"measurement": measurement, "steps_per_s": steps_per_s,
            "vs_ceiling": vs_ceiling and steps_per_s is not None, "ratio": None,
            "phase_share": phase_share, "gpu_memory_bytes": gpu_memory_bytes, "notes": notes,
            "key": key, "value": value, "in_process": in_process}


def tail(text: str, lines: int = 12) -> str:
    return "\n".join(text.strip().splitlines()[-lines:])


def check_parts(res: dict) -> None:
    """A run_parts result with a failed end-to-end run (run_e2e records, never raises)."""
    for name, v in res.items():
        if isinstance(v, dict) and "error" in v:
            raise StepError(f"{name}: {tail(str(v['error']))}")


def run_parts(c, part: str, **families) -> dict:
    """throughput.py's run_parts for one part at this mode's sizes; its family's result."""
    from benchmarks import throughput as tp

    args = tp.Args(env_id=ENV_ID, cuda=c.cuda, seconds=c.s.seconds, e2e_seconds=c.s.e2e_seconds,
                   **families)
    (res,) = tp.run_parts([part], args, write=False).values()
    c.results[part] = res
    check_parts(res)
    return res


def e2e(c, script: str, flags: list[str], name: str, measurement: str,
        key: str | None = None) -> dict:
    """One end-to-end run through measure.run_e2e, in this step's run folder."""
    from benchmarks.throughput_parts.measure import run_e2e

    run_dir = c.work / "runs" / name
    a = SimpleNamespace(env_id=ENV_ID, seed=1, torch_threads=0, e2e_seconds=c.s.e2e_seconds)
    print(f"{measurement}: {script} {' '.join(flags)}", flush=True)
    r = c.results[name] = run_e2e(script, [*flags, "--eval-episodes", "0"], a, c.cuda, run_dir)
    if "error" in r:
        raise StepError(f"{script} ({name}): {tail(r['error'])}")
    print(f"  {r['steady_sps']:,.0f} steps/s", flush=True)
    return row(measurement, r["steady_sps"], phase_share=r.get("phase_share"), key=key,
               gpu_memory_bytes=summary(run_dir).get("gpu_memory_bytes"))


def launch(cmd: list[str], what: str) -> str:
    """Run a command to its end (the step's timeout bounds it), its output copied into the
    step's log as it comes (a timed-out step's log then shows how far it got); its output."""
    print(f"{what}: {' '.join(cmd[1:])}", flush=True)
    t = Training(cmd, echo=True, env={"PYTHONFAULTHANDLER": "1"}).run()
    if t.returncode:
        raise StepError(f"{what} exited {t.returncode}: {t.tail()}")
    return "".join(t.lines)


def shares(s: dict) -> dict | None:
    return phase_shares(s.get("phase_seconds") or {}, s.get("wall_seconds"))


def small_ppo(c) -> list[str]:
    """Flags of the torchrun steps' tiny PPO runs."""
    envs, steps, _ = c.s.small
    return ["--env-id", ENV_ID, "--num-envs", str(envs), "--num-steps", str(steps),
            "--eval-episodes", "0", *c.s.ppo_flags]


# ---- the steps ----

def step_sprint(c) -> list[dict]:
    out = c.work / "runs" / "sprint"
    launch([sys.executable, str(ROOT / "benchmarks" / "sprint.py"), *c.s.sprint, "--out", str(out),
            "--cuda" if c.cuda else "--no-cuda"], "sprint")
    r = c.results["sprint"] = json.loads((out / "sprint.json").read_text())
    game = r["env_id"].split(":")[-1]
    rows = [row(f"{game} sprint: mean of last {r['window']} games >= {t['target']:g}", None,
                key=f"sprint_target_{i}", value=t["minutes"],
                notes="not reached" if t["minutes"] is None else
                f"{t['minutes']:.2f} min from launch, step {t['step']:,}")
            for i, t in enumerate(r["targets"], 1)]
    ev = r["final_eval"] or {}
    rows.append(row(f"{game} sprint: {r['minutes']:g} min, {r['envs']} envs",
                    r["steps_per_s_overall"], vs_ceiling=False,
                    notes=f"{r['steps']:,} steps; final evaluation "
                    + (f"{ev['mean']:.2f} over {ev['games']} game{'s' * (ev['games'] != 1)}"
                     if "mean" in ev else "n/a")))
    return rows


def step_ale(c) -> list[dict]:
    from benchmarks.throughput_parts import ppo as ppo_part

    a = ppo_part.Args(num_envs=c.s.envs, num_steps=c.s.num_steps, raw=True, sampler=False,
                      learner=False, e2e=False)
    res = run_parts(c, "ppo", ppo=a)
    raw, triv = res["raw_env"], res["sampler_trivial"]
    return [row(f"raw ALE, {c.s.envs} envs on {res['env_threads']} threads, random actions",
                raw["steps_per_s"], key="ceiling", in_process=True),
            row("sampler, trivial policy, same envs", triv["steps_per_s"], in_process=True,
                notes=f"sampler/raw {triv['paired_ratio_median']:.2f} (>= 0.95), median of "
                      "paired blocks")]


def step_sampler(c) -> list[dict]:
    from benchmarks.throughput_parts import ppo as ppo_part

    a = ppo_part.Args(num_envs=c.s.envs, num_steps=c.s.num_steps, raw=False, sampler=True,
                      learner=True, e2e=False)
    res = run_parts(c, "ppo", ppo=a)
    plain, alt = (res[f"sampler_ppo_{k}"]["steps_per_s"] for k in ("plain", "alternating"))
    lr, bound = res["learner"], res["ratios"].get("ppo_bound_plain")
    return [row("sampler, PPO network, plain", plain, in_process=True),
            row("sampler, PPO network, alternating", alt, in_process=True,
                notes=f"alternating/plain {alt / plain:.2f}"),
            row(f"PPO learner, batch {lr['batch_size']}", None, in_process=True,
                key="ppo_learner", value=lr["epoch_samples_per_s"],
                notes=f"{lr['epoch_samples_per_s']:,.0f} epoch-samples/s; sampling then "
                      f"learning bound {bound:,.0f} steps/s")]


def pair(c, script: str, flags: list[str], label: str, key: str) -> list[dict]:
    """Plain and alternating end-to-end rows of one script."""
    rows = [e2e(c, script, [*flags, f"--{'' if alt else 'no-'}alternate"],
                f"{key}_{'alternating' if alt else 'plain'}",
                f"{label} end to end, {'alternating' if alt else 'plain'}",
                key=f"{key}_{'alternating' if alt else 'plain'}") for alt in (False, True)]
    rows[1]["notes"] = (f"alternating/plain {rows[1]['steps_per_s'] / rows[0]['steps_per_s']:.2f}"
                        " (>= 1.3 where inference and env take similar time)")
    return rows


def step_ppo(c) -> list[dict]:
    flags = ["--num-envs", str(c.s.envs), "--num-steps", str(c.s.num_steps), *c.s.ppo_flags]
    return pair(c, "ppo_multigpu", flags, f"PPO, {c.s.envs} envs", "ppo")


def step_a2c(c) -> list[dict]:
    return pair(c, "a2c_multigpu", ["--num-envs", str(c.s.envs), *c.s.a2c_flags],
                f"A2C, {c.s.envs} envs", "a2c")


def step_dqn(c) -> list[dict]:
    from benchmarks.throughput_parts import dqn as dqn_part

    a = dqn_part.Args(replay_size=c.s.replay, batch_size=c.s.batch, samples=c.s.repeats,
                      e2e=False)
    res = run_parts(c, "dqn", dqn=a)
    rows = [row(f"sample {c.s.batch} from {res['replay_transitions']:,}, {k}", None,
                in_process=True, key=f"dqn_sample_{k}", value=res["sample_over_update"][k],
                notes=f"{1e3 * res[f'sample_{k}']['seconds_per_batch']:.2f} ms = "
                      f"{100 * res['sample_over_update'][k]:.1f}% of a DQN update (< 5%)")
            for k in ("prioritized", "uniform")]
    rows += [row(f"DQN learner, batch {c.s.batch}, {p}", None, in_process=True, key=f"dqn_{p}",
                 value=res[f"learner_{p}"]["updates_per_s"],
                 notes=f"{res[f'learner_{p}']['updates_per_s']:,.2f} updates/s")
             for p in ("dqn-512", "eps-rainbow-512")]
    flags = [*c.s.q_flags, "--batch-size", str(c.s.batch), "--prioritized"]
    rows.append(e2e(c, "dqn_multigpu", [*flags, "--replay-device", "auto"], "dqn_e2e",
                    "DQN end to end, replay on the device, prioritized"))
    if c.cuda:  # a host replay: batches go up in one pinned copy, priorities come back pinned
        rows.append(e2e(c, "dqn_multigpu", [*flags, "--replay-device", "cpu"], "dqn_e2e_host",
                        "DQN end to end, replay in host memory, prioritized"))
    pinned = (0,) if not c.cuda and cores() > 1 else ()  # on a CPU, overlap needs own cores
    a = dqn_part.Args(batch_size=c.s.batch, sampler_cores=pinned,
                      replay_ratio=0.25 if c.s.replay < 1_000_000 else 8.0)  # quick: fewer updates
    res = run_parts(c, "dqn-async", dqn=a)
    o, run = res["overlap"], res["dqn_async_e2e"]
    if "error" in run:
        raise StepError(f"dqn_multigpu --async-sampling: {tail(run['error'])}")
    return rows + [
        row("DQN sampler process alone", res["sampling_alone"]["steps_per_s"]),
        row(f"DQN learner alone (replay append, ratio {a.replay_ratio:g})",
            res["learning_alone"]["steps_per_s"], in_process=True),
        row("DQN end to end, --async-sampling", run["steady_sps"], key="dqn_async_over_min",
            value=o["async_over_min"], phase_share=run.get("phase_share"),
            notes=f"async/min(alone) {o['async_over_min']:.2f} (>= 0.9); plain bound "
                  f"1/(1/S + 1/L) = {o['plain_bound']:,.0f}")]


def step_catdqn(c) -> list[dict]:
    from benchmarks.throughput_parts import cat_dqn as cat_part

    b = c.s.cat_batch
    a = cat_part.Args(batch_size=b, repeats=c.s.repeats, e2e=False)
    res = run_parts(c, "catdqn", catdqn=a)
    p = res["projection"]
    rows = [row(f"C51 projection of {b}", None, in_process=True, key="cat_projection_share",
                value=res["projection_share_of_update"],
                notes=f"{1e3 * p['vectorised_s']:.2f} ms = "
                      f"{100 * res['projection_share_of_update']:.2f}% of an update; "
                      f"{p['per_sample_loop_s'] / p['vectorised_s']:,.0f}x faster than "
                      "Algorithm 1 per sample; max difference "
                      f"{p['max_abs_diff_vs_per_atom']:.1e}")]
    rows += [row(f"C51 learner, batch {b}, {v}", None, in_process=True, key=f"cat_{v}",
                 value=res[f"learner_{v}"]["updates_per_s"],
                 notes=f"{res[f'learner_{v}']['updates_per_s']:,.2f} updates/s")
             for v in ("catdqn-2k", "double-dueling-prioritized")]
    flags = [*c.s.q_flags, "--batch-size", str(b)]
    return rows + [e2e(c, "cat_dqn", flags, "cat_dqn_e2e", f"CatDQN end to end, batch {b}")]


def step_appo(c) -> list[dict]:
    from benchmarks.throughput_parts import appo as appo_part

    pinned = (0,) if not c.cuda and cores() > 1 else ()  # on a CPU, overlap needs own cores
    a = appo_part.Args(num_envs=c.s.envs, num_steps=c.s.appo_steps, sampler_cores=pinned)
    res = run_parts(c, "appo", appo=a)
    r, appo, ppo = res["ratios"], res["appo_e2e"], res["ppo_e2e"]
    lag = r["policy_lag_mean"]
    return [row("APPO sampler process alone", res["sampling_alone"]["steps_per_s"]),
            row("APPO learner alone, central Adam", res["learning_alone"]["steps_per_s"],
                in_process=True),
            row("APPO end to end", appo["steady_sps"], phase_share=appo.get("phase_share"),
                notes=f"APPO/min(alone) {r['appo_over_min']:.2f} (>= 0.9); mean policy lag "
                      + ("n/a" if lag is None else f"{lag:.2f}")),
            row("PPO end to end, same settings", ppo["steady_sps"],
                phase_share=ppo.get("phase_share"),
                notes=f"APPO/PPO {r['appo_over_ppo']:.2f}")]


def step_modes(c) -> list[dict]:
    from benchmarks.throughput_parts import modes as modes_part

    a = modes_part.Args(algos=("ppo",), e2e=False, update_epochs=c.s.modes_epochs)
    res = run_parts(c, "modes", modes=a)["ppo"]
    for mode, r in res["learner"].items():  # the compiled learner's statistics drove the rate
        lr = r["learning_rate"]
        if not r["finite"] or r["optimizer_steps"] < 3 or lr[0] == lr[1]:
            raise StepError(f"PPO learner, {mode}: statistics finite {r['finite']}, "
                            f"{r['optimizer_steps']} timed optimizer steps, KL-adapted "
                            f"learning rate {lr[0]:g} -> {lr[1]:g}")
    epochs, minibatch = 4, 256  # PPO's defaults, which the modes part measures
    # steps/s: environment steps per second the learner absorbs (a minibatch step per 256
    # samples, each sample seen in 4 epochs)
    return [row(f"PPO learner, {mode}", 1000 * minibatch / epochs / r["ms_per_step"],
                vs_ceiling=False, in_process=True, key=f"ppo_learner_{mode}",
                value=res["speedup"][mode],
                notes=f"{r['ms_per_step']:.1f} ms per minibatch step = "
                      f"{res['speedup'][mode]:.2f}x fp32 eager"
                      + (f"; compiled in {r['compile_seconds']:.0f} s" if r["compile_seconds"]
                         else ""))
            for mode, r in res["learner"].items()]


def step_resume(c) -> list[dict]:
    run, first = c.work / "runs" / "resume", c.s.small[2]
    device = ["--cuda"] if c.cuda else ["--no-cuda"]
    launch(command("ppo_multigpu", [*small_ppo(c), *device, "--total-timesteps", str(first),
                                     "--checkpoint-interval", str(first // 2), "--run-dir",
                                     str(run)], ranks=1), "1 rank under torchrun")
    s1 = summary(run)
    out = launch(command("ppo_multigpu", ["--no-cuda", "--resume", str(run),
                                          "--total-timesteps", str(2 * first)]),
                 "resumed on the CPU")
    s2 = summary(run)
    said = "resumed from" in out
    if not said or s2.get("global_step", 0) < 2 * first or s2.get("device") != "cpu":
        raise StepError(f"did not resume: global_step {s2.get('global_step')} on "
                        f"{s2.get('device')}, 'resumed from' {'' if said else 'not '}printed")
    return [row(f"1 rank, torchrun, {s1['device']}, to step {s1['global_step']:,}", s1["sps"],
                vs_ceiling=False, phase_share=shares(s1),
                gpu_memory_bytes=s1.get("gpu_memory_bytes"),
                notes="summary.json sps (start-up included)"),
            row(f"resumed on {s2['device']} to step {s2['global_step']:,}", s2["sps"],
                vs_ceiling=False, phase_share=shares(s2),
                notes=f"resumed from step {s1['global_step']:,}")]


def step_two_ranks(c) -> list[dict]:
    run, total = c.work / "runs" / "two_ranks", c.s.small[2]
    device = ["--cuda", "--backend", "gloo"] if c.cuda else ["--no-cuda"]
    launch(command("ppo_multigpu", [*small_ppo(c), *device, "--total-timesteps",
                                     str(2 * total), "--run-dir", str(run)], ranks=2),
           "2 ranks under torchrun")
    s = summary(run)
    if s.get("world_size") != 2 or s.get("global_step", 0) < 2 * total:
        raise StepError(f"2-rank run ended at step {s.get('global_step')} with world size "
                        f"{s.get('world_size')}")
    how = f"{s['device']}{' over gloo' if c.cuda else ''}, {c.s.small[0]} envs each"
    return [row(f"2 ranks on {how}", s["sps"], vs_ceiling=False, phase_share=shares(s),
                gpu_memory_bytes=s.get("gpu_memory_bytes"),
                notes="summary.json sps (start-up included)")]


# name: (what it runs, its timeout on the GPU in seconds, the function); the timeouts add up to
# 480 s (tests/test_gpu_check.py checks it), so the whole check fits in a 10-minute command. The
# sprint's 3 minutes and 4 evaluation games leave the other steps 270 s: their measurements are
# 2-3 s each, and the modes step's two compilations the rest of its minute.
STEPS = {
    "sprint": ("PPO's Pong sprint: minutes to 18 and 20, final evaluation", 210, step_sprint),
    "ale": ("raw ALE ceiling and the trivial sampler", 15, step_ale),
    "sampler": ("sampler with PPO's network, PPO's learner", 15, step_sampler),
    "modes": ("PPO's learner in fp32, bf16, channels-last, compiled and all three", 60,
              step_modes),
    "ppo": ("PPO end to end, plain and alternating", 30, step_ppo),
    "a2c": ("A2C end to end, plain and alternating", 15, step_a2c),
    "dqn": ("DQN replay sampling, learners, end to end (GPU: and a host replay), "
            "--async-sampling's overlap", 50, step_dqn),
    "catdqn": ("C51 projection, learners, end to end", 25, step_catdqn),
    "appo": ("APPO sampler process, central Adam, end to end", 30, step_appo),
    "resume": ("1-rank torchrun on the GPU, resumed on the CPU", 15, step_resume),
    "two_ranks": ("2 ranks sharing the GPU over gloo", 15, step_two_ranks),
}


def run_step_here(args: Args) -> None:
    """The --step process: run one step and write its rows to WORK/steps/NAME.json."""
    c = SimpleNamespace(cuda=args.cuda, s=sizes(args.quick), work=Path(args.work), results={})
    stop_on_sigterm()  # the parent's stop: the step's training runs stop cleanly
    try:
        if os.environ.get(FAIL_VAR) == args.step:
            raise StepError(f"forced failure ({FAIL_VAR}={args.step})")
        rows = STEPS[args.step][2](c)
    except StepError as e:
        print(f"step {args.step} failed: {e}", file=sys.stderr, flush=True)
        sys.exit(1)
    peak = None
    if args.cuda and "torch" in sys.modules:
        import torch
        peak = torch.cuda.max_memory_allocated() if torch.cuda.is_initialized() else None
    for r in rows:
        if r.pop("in_process") and r["gpu_memory_bytes"] is None:
            r["gpu_memory_bytes"] = peak
    out = c.work / "steps" / f"{args.step}.json"
    out.write_text(json.dumps({"rows": rows, "gpu_memory_bytes": peak, "results": c.results},
                              indent=2, default=str))


# ---- the parent: run the steps, collect the table ----

def cpu_seconds() -> float:
    """CPU time of the finished steps' processes, their children included: against the wall
    time it shows how much of the machine a step had (a shared machine slows it)."""
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def run_step(name: str, args: Args, work: Path, timeout: float) -> dict:
    """One step as `gpu_check.py --step NAME` in its own session, output to its log; at its
    timeout it is stopped as benchmarks/training.py stops a run, with every run it started."""
    log = work / "logs" / f"{name}.log"
    cmd = [sys.executable, str(Path(__file__).resolve()), "--step", name, "--work", str(work),
           "--cuda" if args.cuda else "--no-cuda", *(["--quick"] if args.quick else [])]
    cpu0 = cpu_seconds()
    t = Training(cmd, log=log).run(limit=timeout, grace=GRACE)
    status = "timeout" if t.stopped else "ok" if t.returncode == 0 else "failed"
    result_file = work / "steps" / f"{name}.json"
    step = {"name": name, "title": STEPS[name][0], "status": status, "timeout_s": timeout,
            "seconds": t.seconds, "cpu_seconds": cpu_seconds() - cpu0,
            "returncode": t.returncode,
            "log": str(log), "rows": [], "gpu_memory_bytes": None, "error": None}
    if status == "ok" and result_file.is_file():
        res = json.loads(result_file.read_text())
        step.update(rows=res["rows"], gpu_memory_bytes=res["gpu_memory_bytes"])
    else:
        step["status"] = "failed" if status == "ok" else status  # exit 0 but nothing written
        step["error"] = (f"timed out after {timeout:g} s; the log ends:\n" if status == "timeout"
                         else "") + t.tail()
    return step


def parse_timeouts(items: tuple[str, ...], quick: bool) -> dict[str, float]:
    timeouts = {n: QUICK_TIMEOUT if quick else float(t) for n, (_, t, _) in STEPS.items()}
    for item in items:
        name, _, value = item.partition("=")
        try:
            seconds = float(value)
        except ValueError:
            seconds = 0.0
        if name not in STEPS or seconds <= 0:
            raise UserError(f"--timeouts takes NAME=SECONDS with NAME one of {', '.join(STEPS)} "
                             f"and SECONDS > 0, got {item!r}")
        timeouts[name] = seconds
    return timeouts


def chosen_steps(names: tuple[str, ...]) -> list[str]:
    if bad := [n for n in names if n not in STEPS]:
        raise UserError(f"unknown step {bad[0]!r}; choose from {', '.join(STEPS)}")
    return [n for n in STEPS if n in names] if names else list(STEPS)


def output_stem(out: str | None, device: str) -> Path:
    """gpu-check-<host>-<device> in the folder, numbered past any existing file or folder;
    its step folder is made here, which also proves the folder writable."""
    folder = Path(out).resolve() if out else outputs.RUNS  # the steps run from the repository
    stem = outputs.unused(folder / f"gpu-check-{outputs.host()}-{device}", (".json", ".md", ""))
    try:
        for sub in ("logs", "steps", "runs"):
            (stem / sub).mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UserError(f"cannot write to --out {folder}: {e.strerror or e}") from None
    return stem


def with_ratios(steps: list[dict]) -> float | None:
    """Each env-steps row over the ALE ceiling of this run; the ceiling (None without it)."""
    rows = [r for s in steps for r in s["rows"]]
    ceiling = next((r["steps_per_s"] for r in rows if r["key"] == "ceiling"), None)
    for r in rows:
        if ceiling and r["vs_ceiling"]:
            r["ratio"] = r["steps_per_s"] / ceiling
    return ceiling


def targets(steps: list[dict], ceiling: float | None) -> list[dict]:
    """The GPU targets as read from this run (met: None where not measured or a figure)."""
    v = {r["key"]: r["value"] if r["value"] is not None else r["steps_per_s"]
         for s in steps for r in s["rows"] if r["key"]}
    div = lambda a, b: a / b if a is not None and b else None  # noqa: E731
    out = [("Sprint: minutes from launch to its first target (Pong: 18 over 100 games)",
            v.get("sprint_target_1"), "<", 3.0),
           ("Sprint: minutes from launch to its second target (Pong: 20 over 100 games)",
            v.get("sprint_target_2"), "<", 5.0)]
    for algo in ("ppo", "a2c"):
        for alt in ("plain", "alternating"):
            out.append((f"{algo.upper()} {alt} end to end / ALE ceiling",
                        div(v.get(f"{algo}_{alt}"), ceiling), ">=", 0.70))
        out.append((f"{algo.upper()} alternating / plain (where inference ~ env)",
                     div(v.get(f"{algo}_alternating"), v.get(f"{algo}_plain")), ">=", 1.3))
    out.append(("DQN: sampling a batch (prioritized) / one update; on the GPU 512 from 1M",
                v.get("dqn_sample_prioritized"), "<", 0.05))
    out.append(("DQN --async-sampling end to end / min(sampling alone, learning alone)",
                v.get("dqn_async_over_min"), ">=", 0.9))
    out += [("PPO's learner, bf16 / fp32 eager per minibatch step", v.get("ppo_learner_bf16"),
             ">=", 1.6),
            ("PPO's learner, bf16 + channels-last + compiled / fp32 eager (LeanRL: 6.8x)",
             v.get("ppo_learner_best"), ">=", 3.0)]
    out += [("DQN updates/s (dqn-512 preset; batch as in the table)", v.get("dqn_dqn-512"),
             None, None),
            ("CatDQN updates/s (catdqn-2k preset; batch as in the table)",
             v.get("cat_catdqn-2k"), None, None)]
    return [{"name": n, "value": x, "target": None if op is None else f"{op} {t}",
             "met": None if x is None or op is None else (x >= t if op == ">=" else x < t)}
            for n, x, op, t in out]


def markdown(report: dict) -> str:
    from benchmarks.throughput_parts.measure import e2e_shares, fmt, table

    rows = [("step", "status", "seconds", "measurement", "steps/s", "/ ceiling", "phases",
             "GPU memory", "notes")]
    for s in report["steps"]:
        head = (s["name"], s["status"], f"{s['seconds']:.0f}")
        for i, r in enumerate(s["rows"] or [None]):
            lead = head if i == 0 else ("", "", "")
            if r is None:  # a step without rows: why
                why = (s["error"] or "").splitlines()
                why = why[0] if s["status"] == "timeout" else why[-1] if why else ""
                rows.append((*lead, s["title"], "", "", "", "", why.replace("|", "/")))
                continue
            mem = r["gpu_memory_bytes"]
            rows.append((*lead, r["measurement"], fmt(r["steps_per_s"])
                         if r["steps_per_s"] is not None else "",
                         f"{r['ratio']:.2f}" if r["ratio"] is not None else "",
                         e2e_shares(r), f"{mem / 2**20:,.0f} MiB" if mem else "", r["notes"]))
    lines = [f"- {t['name']}: " + ("n/a" if t["value"] is None else f"{t['value']:,.3g}")
             + (f" (target {t['target']}: {'met' if t['met'] else 'not met'})"
                if t["met"] is not None else "") for t in report["targets"]]
    return (table(rows, report, f"; {report['mode']}.") + "\n\nTargets (figures, not tests):\n"
            + "\n".join(lines) + "\n")


def write_report(stem: Path, report: dict) -> None:
    report["ceiling_steps_per_s"] = with_ratios(report["steps"])
    report["targets"] = targets(report["steps"], report["ceiling_steps_per_s"])
    report["failed"] = [s["name"] for s in report["steps"] if s["status"] != "ok"]
    report["table_markdown"] = markdown(report)
    Path(f"{stem}.json").write_text(json.dumps(report, indent=2, default=str))
    Path(f"{stem}.md").write_text(report["table_markdown"])


def main_parent(args: Args) -> int:
    stop_on_sigterm()  # a command's timeout stops the step running now, which has its own session
    names = chosen_steps(args.steps)
    timeouts = parse_timeouts(args.timeouts, args.quick)
    import torch

    if args.cuda:
        if not torch.cuda.is_available():
            raise UserError("no CUDA GPU is visible; pass --no-cuda (with --quick for the small "
                             "CPU check)")
    device = "cuda" if args.cuda else "cpu"
    stem = output_stem(args.out, device)
    report = {"hardware": outputs.hardware(torch.device(device)), "device": device,
              "mode": f"{'quick' if args.quick else 'full'} budgets on {device}, {ENV_ID}",
              "args": vars(args), "sizes": vars(sizes(args.quick)), "steps": []}
    print(f"hardware: {report['hardware']['line']}\nwriting {stem}.json, {stem}.md", flush=True)
    for i, name in enumerate(names, 1):
        print(f"[{i}/{len(names)}] {name}: {STEPS[name][0]} (timeout {timeouts[name]:g} s) ...",
              flush=True)
        step = run_step(name, args, stem, timeouts[name])
        report["steps"].append(step)
        print(f"  {step['status']} in {step['seconds']:.1f} s ({step['cpu_seconds']:.1f} s of "
              "CPU)" + ("\n    " + step["error"].replace("\n", "\n    ") if step["error"] else ""),
              flush=True)
        write_report(stem, report)
    print("\n" + report["table_markdown"] + f"\nwrote {stem}.json and {stem}.md", flush=True)
    if report["failed"]:
        print(f"failed: {', '.join(report['failed'])} (logs in {stem}/logs)", file=sys.stderr)
    return 1 if report["failed"] else 0


def main() -> None:
    args = tyro.cli(Args, description=__doc__.split("\n\n")[0])
    if args.step:
        if args.step not in STEPS or not args.work:
            fail(f"--step takes one of {', '.join(STEPS)}, with --work")
        run_step_here(args)
        return
    try:
        sys.exit(main_parent(args))
    except UserError as e:
        fail(str(e))
    except KeyboardInterrupt:  # Ctrl-C or SIGTERM: the step running was stopped
        print("stopped; the report holds the steps that ended", file=sys.stderr)
        sys.exit(130)


if __name__ == "__main__":
    main()
