"""How a benchmark refuses bad input and how it stops: one error class, one exit line, and
SIGTERM taken as Ctrl-C.

A mistake a user can fix (a bad flag, a missing file, a name already taken) raises UserError
before anything is measured or written; the script's main() turns it into one line,
`error: <message>` on stderr, and exit status 2 (fail). Runners that launch training runs treat
SIGTERM as Ctrl-C (stop_on_sigterm), so a scheduler's stop ends the current run cleanly, with
its checkpoint, instead of killing it.
"""

from __future__ import annotations

import signal
import sys
from pathlib import Path
from typing import NoReturn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from common.flag_ranges import out_of_range  # noqa: E402


class UserError(ValueError):
    """Input a user can fix: its message is the one line printed."""


def fail(message: str) -> NoReturn:
    print(f"error: {message}", file=sys.stderr)
    sys.exit(2)


def checked(args):
    """`args` (a parsed Args) if every numeric flag is in its range (common/flag_ranges.py), else
    fail with the one line naming the first that is not."""
    if problem := out_of_range(args):
        fail(problem)
    return args


def _interrupt(signum, frame):
    raise KeyboardInterrupt


def stop_on_sigterm() -> None:
    """From now on SIGTERM raises KeyboardInterrupt in the main thread, as Ctrl-C does."""
    signal.signal(signal.SIGTERM, _interrupt)
