"""Where a benchmark writes when it is given no --out, how it avoids overwriting anything, and
the hardware line every output carries beside its numbers.

benchmarks/results/ holds the committed numbers the docs quote, so no benchmark writes there
unless --out names it: a default output goes under runs/benchmarks/ (git ignores runs/). A
default path that exists already is never overwritten: the new output takes the next free name
(-2, -3, ... before the extension), so a rerun keeps the last one. An explicit --out is written
as given: naming a path is how the committed results are refreshed.
"""

from __future__ import annotations

import os
import platform
import re
import socket
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
RUNS = ROOT / "runs" / "benchmarks"


def host() -> str:
    """This machine's name as it appears in file names."""
    return re.sub(r"[^A-Za-z0-9_.-]", "_", socket.gethostname())


def unused(stem: Path, suffixes: tuple[str, ...] = ("",)) -> Path:
    """stem, or the first free stem-2, stem-3, ... when stem + any of suffixes exists (a prefix
    that names several files must be free for all of them)."""
    taken = lambda p: any(Path(f"{p}{s}").exists() for s in suffixes)  # noqa: E731
    candidate, k = stem, 1
    while taken(candidate):
        k += 1
        candidate = Path(f"{stem}-{k}")
    return candidate


def hardware(device) -> dict:
    """The machine a measurement runs on (`device`: a torch.device), with the one-line summary
    written beside every number: CPU, cores, GPUs, torch, ale-py, CUDA and driver, the OMP
    variables in force and the load average (other work on the machine slows every number)."""
    import ale_py
    import torch

    cpu = platform.processor() or platform.machine()
    try:
        names = re.findall(r"^model name\s*:\s*(.+)$", Path("/proc/cpuinfo").read_text(), re.M)
        cpu = names[0].strip() if names else cpu
    except OSError:
        pass
    gpus = ([torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
            if device.type == "cuda" else [])
    try:
        smi = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30)
        driver = smi.stdout.split()[0] if smi.returncode == 0 and smi.stdout.strip() else None
    except (OSError, subprocess.TimeoutExpired):
        driver = None
    hw = {"host": socket.gethostname(), "cpu": cpu, "cores": os.cpu_count(),
          "gpu": gpus[device.index or 0] if gpus else None, "gpus": gpus,
          "torch": torch.__version__, "ale_py": ale_py.__version__, "cuda": torch.version.cuda,
          "driver": driver, "torch_threads": torch.get_num_threads(),
          "load_average_1min": os.getloadavg()[0],
          "env_vars": {k: os.environ[k] for k in ("OMP_NUM_THREADS", "OMP_WAIT_POLICY",
                                                   "MKL_NUM_THREADS") if k in os.environ}}
    hw["line"] = (f"{cpu}, {hw['cores']} cores"
                  + (f", {len(gpus)} x {hw['gpu']}" if gpus else ", no GPU used")
                  + f"; torch {hw['torch']} ({hw['torch_threads']} threads), ale-py {hw['ale_py']}"
                  + f", CUDA {hw['cuda'] or 'n/a'}, driver {driver or 'n/a'}"
                  + "".join(f", {k}={v}" for k, v in hw["env_vars"].items())
                  + f"; load average {hw['load_average_1min']:.1f} at the start")
    return hw
