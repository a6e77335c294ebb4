"""Where a benchmark writes when it is given no --out, and how it avoids overwriting anything.

benchmarks/results/ holds the committed numbers the docs quote, so no benchmark writes there
unless --out names it: a default output goes under runs/benchmarks/ (git ignores runs/). A
default path that exists already is never overwritten: the new output takes the next free name
(-2, -3, ... before the extension), so a rerun keeps the last one. An explicit --out is written
as given: naming a path is how the committed results are refreshed.
"""

from __future__ import annotations

import re
import socket
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
