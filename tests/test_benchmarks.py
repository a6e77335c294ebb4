"""The paper-reproduction benchmarks: experiments runner, plots and scores, scaling table,
throughput, and where they write.

Kept small for CI: two tiny PPO configurations of the smoke experiment on the synthetic Catch
game, a scaling table of PPO on Catch at 1 and 2 gloo ranks with a few seconds each, and the
throughput entry point's ppo, dqn and catdqn parts at toy sizes.
"""

import ast
import csv
import json
import re
import subprocess
import sys
import tempfile
from types import SimpleNamespace

import pytest
import torch

from tests.conftest import ROOT, run_python

from benchmarks import atari_scores, experiments, outputs, plot, registry, scaling  # noqa: E402
from benchmarks import throughput, training  # noqa: E402

CATCH = "tests.catch_env:Catch-v0"


def bench(script: str, *args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    return run_python(ROOT / "benchmarks" / script, *args, timeout=timeout)


def last_logged_step(run_dir) -> int:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    steps = []
    for f in run_dir.glob("events.out.tfevents.*"):
        acc = EventAccumulator(str(f), size_guidance={"scalars": 0})
        acc.Reload()
        steps += [e.step for e in acc.Scalars("charts/episodic_return")]
    return max(steps)


@pytest.mark.slow
def test_smoke_experiment_end_to_end(tmp_path):
    runs = tmp_path / "runs"
    sweep = ("smoke", "--only", "ppo-4env", "ppo-16env", "--runs", str(runs))
    printed = bench("experiments.py", *sweep, "--print-commands")
    assert printed.returncode == 0, printed.stderr
    lines = printed.stdout.strip().splitlines()
    assert len(lines) == 2 and all("--resume auto" in line and CATCH in line for line in lines)

    first = bench("experiments.py", *sweep, "--parallel", "2")
    assert first.returncode == 0, first.stdout + first.stderr
    run_dirs = {c: runs / "smoke" / CATCH.replace(":", "_") / c / "seed1"
                for c in ("ppo-4env", "ppo-16env")}
    summaries = {c: json.loads((d / "summary.json").read_text()) for c, d in run_dirs.items()}
    assert summaries["ppo-16env"]["args"]["num_envs"] == 16  # the configuration's flag won
    assert summaries["ppo-4env"]["args"]["num_envs"] == 4
    assert all(s["global_step"] == 512 for s in summaries.values())

    again = bench("experiments.py", *sweep)  # a restarted sweep skips finished runs
    assert again.returncode == 0, again.stderr
    assert again.stdout.count("(finished: summary.json exists)") == 2
    assert "nothing to run" in again.stdout
    assert bench("experiments.py", *sweep, "--print-commands").stdout == ""

    out = tmp_path / "plots"
    drawn = bench("plot.py", str(runs / "smoke"), "--out", str(out))
    assert drawn.returncode == 0, drawn.stderr
    png = out / f"{CATCH.replace(':', '_')}.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    rows = list(csv.DictReader(open(out / "curves.csv")))
    for config, run_dir in run_dirs.items():
        mine = [r for r in rows if r["config"] == config and r["axis"] == "env_steps"]
        assert mine and all(r["game"] == CATCH and r["seeds"] == "1" for r in mine)
        # the curve ends at the run's last logged game, on the run's own last-100 mean
        assert float(mine[-1]["x"]) == last_logged_step(run_dir)
        assert float(mine[-1]["mean"]) == pytest.approx(
            summaries[config]["mean_return_last100"], abs=1e-4)
        assert [r for r in rows if r["config"] == config and r["axis"] == "hours"]
    assert "| ppo-4env | " in drawn.stdout  # the per-run score table


@pytest.mark.slow
def test_scaling_table_one_and_two_gloo_ranks(tmp_path):
    prefix = tmp_path / "scaling"
    proc = bench("scaling.py", "--algos", "ppo", "--ranks", "1", "2", "--env-id", CATCH,
                 "--no-cuda", "--warmup", "1", "--seconds", "2", "--out", str(prefix),
                 "--flags=--num-envs 2 --num-steps 16 --update-epochs 1 --num-minibatches 1")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    res = json.loads(prefix.with_suffix(".json").read_text())
    one, two = res["results"]
    assert (one["ranks"], two["ranks"]) == (1, 2) and not one["error"] and not two["error"]
    assert one["summary"]["world_size"] == 1 and two["summary"]["world_size"] == 2
    for r in (one, two):
        assert r["returncode"] == 0  # every rank stopped by SIGTERM with a checkpoint
        assert r["steady_sps"] > 0 and r["steady_steps"] > 0
        assert r["steady_sps"] == pytest.approx(r["steady_steps"] / r["steady_seconds"])
        assert r["hours_50m"] == pytest.approx(50e6 / r["steady_sps"] / 3600)
        assert set(r["phase_share"]) >= {"env", "inference", "learn", "comm"}
        assert r["summary"]["global_step"] >= r["steady_steps"]  # stopped with a summary
    assert one["speedup"] == 1.0
    assert two["speedup"] == pytest.approx(two["steady_sps"] / one["steady_sps"])
    assert two["efficiency"] == pytest.approx(two["speedup"] / 2)
    table = prefix.with_suffix(".md").read_text()
    assert f"| ppo | {one['hours_50m']:,.1f} (4.4) | {two['hours_50m']:,.1f} (2.6) | - (1.5) |" \
        in table
    assert prefix.with_suffix(".png").read_bytes()[:4] == b"\x89PNG"
    assert_no_machine_paths(prefix.with_suffix(".json"), tmp_path)
    assert one["cmd"].startswith("-m torch.distributed.run --standalone --nproc_per_node=1 "
                                 "algos/ppo_multigpu.py ") and " --run-dir <tmp>/" in one["cmd"]


def test_human_normalised_scores(tmp_path, capsys, monkeypatch):
    hns = atari_scores.human_normalised
    assert hns("Pong-v5", 0.0) == pytest.approx(20.7 / 35.3)  # (0 + 20.7) / (14.6 + 20.7)
    assert hns("ALE/Breakout-v5", 16.1) == pytest.approx(0.5)  # (16.1 - 1.7) / (30.5 - 1.7)
    assert hns("SpaceInvadersNoFrameskip-v4", 1668.7) == pytest.approx(1.0)
    assert hns("Skiing-v5", -17098.1) == pytest.approx(0.0)
    assert hns(CATCH, 1.0) is None and len(atari_scores.SCORES) == 57
    # Runs as experiments.py lays them out, with hand-made summaries: configuration A scores
    # Pong 14.6 and -20.7 (seed mean of HNS 0.5), Breakout 16.1 (0.5), SpaceInvaders 1668.7 (1.0):
    # median 0.5; B: Breakout 59.3 (2.0) and Pong 32.25 (1.5): median 1.75.
    made = [("A", "Pong-v5", 1, 14.6), ("A", "Pong-v5", 2, -20.7), ("A", "Breakout-v5", 1, 16.1),
            ("A", "SpaceInvaders-v5", 1, 1668.7), ("B", "Breakout-v5", 1, 59.3),
            ("B", "Pong-v5", 1, 32.25), ("dqn-512", "Pong-v5", 1, -20.7)]
    for config, game, seed, score in made:
        d = tmp_path / "runs" / game / config / f"seed{seed}"
        d.mkdir(parents=True)
        (d / "summary.json").write_text(json.dumps(
            {"mean_return_last100": score, "args": {"env_id": game, "seed": seed}}))
    monkeypatch.setattr(sys, "argv", ["plot.py", str(tmp_path / "runs")])
    plot.main()
    out = capsys.readouterr().out
    assert "| A | 3 | 0.500 | - |" in out
    assert "| B | 2 | 1.750 | - |" in out
    assert "| dqn-512 | 1 | 0.000 | 1.4 |" in out  # beside the paper's median
    assert "| A | Pong-v5 | 2 | -20.70 | 0.000 |" in out
    assert "| B | Breakout-v5 | 1 | 59.30 | 2.000 |" in out


def test_plot_names_each_run_and_how_it_ended(tmp_path, capsys, monkeypatch):
    """`plot.py runs`: three runs of one script, game and seed are told apart by their folders,
    and the two that ended early say how (stopped by a signal; no summary.json: crashed)."""
    from torch.utils.tensorboard import SummaryWriter
    runs = tmp_path / "runs"
    for t, summary in ((1, {"global_step": 640, "mean_return_last100": -20.5}),
                       (2, {"global_step": 128, "mean_return_last100": -21.0}), (3, None)):
        d = runs / f"Pong-v5__ppo_multigpu__1__{t}"
        d.mkdir(parents=True)
        args = {"env_id": "Pong-v5", "seed": 1, "total_timesteps": 640}
        (d / "args.json").write_text(json.dumps(args))
        if summary:
            (d / "summary.json").write_text(json.dumps({**summary, "args": args}))
        else:  # crashed: events, no summary
            with SummaryWriter(str(d)) as w:
                w.add_scalar("charts/SPS", 100.0, 64)
    monkeypatch.setattr(sys, "argv", ["plot.py", str(runs)])
    plot.main()
    rows = [ln for ln in capsys.readouterr().out.splitlines()
            if ln.startswith("| ppo_multigpu | Pong")]
    assert rows == [
        "| ppo_multigpu | Pong-v5 | 1 | -20.50 | 0.006 | Pong-v5__ppo_multigpu__1__1 | finished |",
        "| ppo_multigpu | Pong-v5 | 1 | -21.00 | -0.008 | Pong-v5__ppo_multigpu__1__2 | "
        "stopped at step 128 of 640 |",
        "| ppo_multigpu | Pong-v5 | 1 | n/a | n/a | Pong-v5__ppo_multigpu__1__3 | no summary.json: "
        "crashed, killed or running (last log at step 64) |"]
    assert "(required: one or more)" in subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "plot.py"), "--help"], capture_output=True,
        text=True, env={"COLUMNS": "200"}).stdout


@pytest.mark.parametrize("module, argv, message", [
    (experiments, ["smoke-x"], "unknown experiment 'smoke-x'"),
    (experiments, ["smoke", "--games", "Pongg"], "unknown Atari game 'Pongg-v5'"),
    (experiments, ["smoke", "--only", "dqn-9"], "smoke has no configuration 'dqn-9'"),
    (scaling, ["--ranks", "0"], "--ranks must be positive, got 0"),
    (scaling, ["--ranks", "4096", "--no-cuda"], "no rank count fits this machine"),
    (scaling, ["--algos", "ddpg"], "unknown configuration 'ddpg'"),
    (scaling, ["--env-id", "NoSuchGame-v5"], "unknown Atari game 'NoSuchGame-v5'"),
    (plot, ["/no/such/runs"], "no such path"),
    (plot, [], "give one or more run directories"),
    (plot, ["runs", "--window", "0"], "--window must be >= 1, got 0"),
    (throughput, ["ppo", "ddpg"],
     "unknown part 'ddpg'; choose from ppo, a2c, dqn, dqn-async, catdqn, appo"),
    (throughput, ["ppo", "--env-id", "NoSuchGame-v5"], "unknown Atari game 'NoSuchGame-v5'"),
    (throughput, ["dqn", "--seconds", "0"], "--seconds must be positive"),
    (throughput, ["appo", "--appo.sampler-cores", "4096"], "must be a strict subset"),
])
def test_bad_input_gives_one_line_error(module, argv, message, capsys, monkeypatch):
    monkeypatch.setattr(sys, "argv", [module.__name__, *argv])
    with pytest.raises(SystemExit) as exit_info:
        module.main()
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and message in err[0], err


def test_registry_has_every_script_and_paper_numbers():
    scripts = {a.script for a in registry.ALGOS.values()}
    assert scripts == {"a2c_multigpu", "ppo_multigpu", "appo_async", "dqn_multigpu", "cat_dqn"}
    assert all(a.kind in registry.ITERATION and len(a.paper_hours) == 4
               for a in registry.ALGOS.values())
    assert registry.ALGOS["a2c"].paper_hours == (3.8, 2.2, 1.2, 0.59)
    assert registry.steps_per_iteration(registry.ALGOS["ppo"], {"num_envs": 8, "num_steps": 128},
                                        4) == 4096
    assert registry.warm_steps(registry.ALGOS["dqn-512"], {"learning_starts": 500}) == 500


def key_paths(d: dict, prefix: tuple = ()) -> set[tuple]:
    """Every key of a result, nested; the keys inside per-run dicts of names (phases, variables)
    depend on the run, so those dicts count as one key."""
    out = set()
    for k, v in d.items():
        out.add(prefix + (k,))
        if isinstance(v, dict) and k not in ("env_vars", "phase_seconds", "phase_share"):
            out |= key_paths(v, prefix + (k,))
    return out


@pytest.mark.slow
def test_throughput_parts_write_the_committed_fields(tmp_path):
    out = tmp_path / "results"
    proc = bench("throughput.py", "ppo", "dqn", "dqn-async", "catdqn", "--env-id", CATCH,
                 "--no-cuda",
                 "--seconds", "0.2", "--e2e-seconds", "0.5", "--out", str(out),
                 "--ppo.num-envs", "2", "--ppo.num-steps", "16",
                 "--dqn.replay-size", "1024", "--dqn.num-envs", "2", "--dqn.batch-size", "32",
                 "--dqn.samples", "2", "--dqn.no-e2e",
                 "--catdqn.batch-size", "32", "--catdqn.repeats", "2", "--catdqn.no-e2e")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    host = outputs.host()
    written = {p.name for p in out.iterdir()}
    assert written == {f"{s}-{host}-cpu.json" for s in ("throughput", "throughput-dqn",
                                                       "throughput-cat-dqn")}
    not_run = {"throughput": {"a2c_e2e_plain", "a2c_e2e_alternating"},
               "throughput-dqn": {"dqn_e2e"},
               "throughput-cat-dqn": {"cat_dqn_e2e", "load_average_at_end"}}
    families = {f.STEM: f for f in throughput.FAMILIES.values()}
    for stem, skipped in not_run.items():
        res = json.loads((out / f"{stem}-{host}-cpu.json").read_text())
        committed = json.loads((ROOT / "benchmarks" / "results" / f"{stem}-vm-cpu.json")
                               .read_text())
        expected = {p for p in key_paths(committed) if p[0] not in skipped}
        assert expected <= key_paths(res), sorted(expected - key_paths(res))
        assert not skipped & set(res)
        assert res["device"] == "cpu" and res["args"]["env_id"] == CATCH
        assert res["args"]["seconds"] == 0.2 and res["args"]["e2e_seconds"] == 0.5
        assert res["hardware"]["line"] in res["table_markdown"]
        assert res["table_markdown"] == families[stem].report(res, SimpleNamespace(**res["args"]))
        assert res["table_markdown"] in proc.stdout
        assert_no_machine_paths(out / f"{stem}-{host}-cpu.json", tmp_path)
    res = json.loads((out / f"throughput-{host}-cpu.json").read_text())
    assert res["args"]["ppo"] and not res["args"]["a2c"]
    assert res["ppo_e2e_plain"]["cmd"].startswith("algos/ppo_multigpu.py --env-id ")
    for alt in ("plain", "alternating"):
        e = res[f"ppo_e2e_{alt}"]
        assert e["returncode"] == 0 and "error" not in e and e["steady_sps"] > 0
        assert e["steady_sps"] == pytest.approx(e["steady_steps"] / e["steady_seconds"])
        assert res["ratios"][f"ppo_e2e_over_bound_{alt}"] == pytest.approx(
            e["steady_sps"] / res["ratios"][f"ppo_bound_{alt}"])
        assert f"| PPO, 2 envs, end to end, {alt} | " in res["table_markdown"]
    assert res["learner"]["batch_size"] == 32 and res["raw_env"]["steps_per_s"] > 0
    dqn = json.loads((out / f"throughput-dqn-{host}-cpu.json").read_text())
    assert dqn["sample_prioritized"]["batches"] == 2 and dqn["replay_transitions"] > 0
    e = dqn["dqn_async_e2e"]  # --async-sampling, sampler pinned to core 0
    assert e["returncode"] == 0 and "error" not in e and e["steady_sps"] > 0, e
    assert "--async-sampling --sampler-cores 0" in e["cmd"]
    assert dqn["overlap"]["async_over_min"] == pytest.approx(
        e["steady_sps"] / min(dqn["sampling_alone"]["steps_per_s"],
                              dqn["learning_alone"]["steps_per_s"]))
    assert "| dqn_multigpu --async-sampling end to end |" in dqn["table_markdown"]
    c51 = json.loads((out / f"throughput-cat-dqn-{host}-cpu.json").read_text())
    assert c51["projection"]["max_abs_diff_vs_per_atom"] < 1e-4  # the references agree


MACHINE_PATH = re.compile(r"(?<![\w<>.-])/(?:tmp|home|work|root|usr|opt|var|mnt)/")


def assert_no_machine_paths(path, *folders):
    """An output names paths as a user types them (relative to the checkout, <tmp>/..., <out>/...),
    never this machine's: the committed ones are read on other machines."""
    text = path.read_text()
    for folder in (ROOT, *folders):
        assert str(folder) not in text, (path.name, str(folder))
    assert not MACHINE_PATH.search(text), (path.name, MACHINE_PATH.search(text))


def test_committed_results_carry_no_machine_paths():
    files = sorted((ROOT / "benchmarks" / "results").glob("*.json"))
    assert len(files) >= 10
    for path in files:
        assert_no_machine_paths(path)


def test_paths_an_output_records_are_typed_ones(tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    assert training.typed_path(str(ROOT / "benchmarks" / "results")) == "benchmarks/results"
    assert training.typed_path(str(tmp_path / "m" / "bench")) == "<tmp>/m/bench"
    assert training.typed_path(None) is None


def test_committed_throughput_results_still_render():
    for family in throughput.FAMILIES.values():
        res = json.loads((ROOT / "benchmarks" / "results" / f"{family.STEM}-vm-cpu.json")
                         .read_text())
        table = family.report(res, SimpleNamespace(**res["args"]))
        assert table.splitlines()[0] == res["table_markdown"].splitlines()[0]
        assert table.splitlines()[-1] == res["table_markdown"].splitlines()[-1]  # hardware
        if family is not throughput.ppo_part:  # its committed table predates the quartiles
            assert table == res["table_markdown"]


def test_no_benchmark_writes_into_results_by_default():
    runs = ROOT / "runs"
    defaults = [throughput.output_path(f.STEM, torch.device(d), None)
                for f in throughput.FAMILIES.values() for d in ("cpu", "cuda")]
    defaults += [scaling.output_prefix(scaling.Args(), use_cuda) for use_cuda in (False, True)]
    defaults.append(plot.output_dir(plot.Args(paths=(str(runs / "experiments" / "smoke"),))))
    defaults.append(ROOT / experiments.Args(name="smoke").runs)  # relative: cwd is the root here
    for path in defaults:
        resolved = path.resolve()
        assert resolved.is_relative_to(runs.resolve()), path
        assert not resolved.is_relative_to(outputs.RESULTS.resolve()), path
    # Nothing else in benchmarks/ names the results folder in code (docstrings may): a new
    # script's default cannot point there either.
    for script in (ROOT / "benchmarks").rglob("*.py"):
        if script.name == "outputs.py":
            continue
        tree = ast.parse(script.read_text())
        docs = {id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Expr)}
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) \
                    and id(node) not in docs:
                assert "benchmarks/results" not in node.value, (script, node.lineno)


def test_default_outputs_are_never_overwritten(tmp_path, monkeypatch):
    monkeypatch.setattr(outputs, "RUNS", tmp_path)
    cpu, host = torch.device("cpu"), outputs.host()
    first = throughput.output_path("throughput-dqn", cpu, None)
    assert first == tmp_path / f"throughput-dqn-{host}-cpu.json"
    first.write_text("{}")
    second = throughput.output_path("throughput-dqn", cpu, None)
    assert second == tmp_path / f"throughput-dqn-{host}-cpu-2.json"
    second.write_text("{}")
    assert throughput.output_path("throughput-dqn", cpu, None).name.endswith("-cpu-3.json")
    explicit = tmp_path / "asked"
    assert throughput.output_path("throughput-dqn", cpu, str(explicit)) == \
        explicit / f"throughput-dqn-{host}-cpu.json"  # --out is written as given

    prefix = scaling.output_prefix(scaling.Args(), False)
    assert prefix == tmp_path / f"scaling-{host}-cpu"
    prefix.with_name(prefix.name + ".png").write_bytes(b"")  # any one of its three files
    assert scaling.output_prefix(scaling.Args(), False) == tmp_path / f"scaling-{host}-cpu-2"
    assert scaling.output_prefix(scaling.Args(out=str(prefix)), False) == prefix

    (tmp_path / "runs" / "plots").mkdir(parents=True)
    assert plot.output_dir(plot.Args(paths=(str(tmp_path / "runs"),))) == \
        tmp_path / "runs" / "plots-2"


def test_phase_shares_leave_a_sampler_process_out_of_the_rest():
    """A synchronous run's phases take turns; a sampler process's (env, inference, its wait)
    overlap the learner's, so the time no phase took is what the learner's leave."""
    from benchmarks.training import phase_shares
    plain = phase_shares({"env": 2.0, "inference": 1.0, "learn": 6.0}, 10.0)
    assert plain == pytest.approx({"env": 0.2, "inference": 0.1, "learn": 0.6, "other": 0.1})
    overlapped = phase_shares({"env": 1.0, "inference": 0.5, "sampler_wait": 8.0, "learn": 9.0,
                               "learner_wait": 0.5}, 10.0)
    assert overlapped["other"] == pytest.approx(0.05) and overlapped["sampler_wait"] == 0.8
    assert phase_shares({}, 0) is None
