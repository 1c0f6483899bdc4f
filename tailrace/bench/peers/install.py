"""Installing a peer into a directory of its own, once per pinned version.

A peer's directory (bench/.peers/NAME) carries a stamp with the pins it was installed with. A
matching stamp means installed; any other state (no stamp, other pins, an install cut short) means
the directory is wiped and installed again. The stamp is written last for that reason.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path
from time import monotonic
from typing import Any

from tailrace.bench.serve import BenchError

PEERS_DIR = Path(__file__).resolve().parents[3] / "bench" / ".peers"
STAMP = ".tailrace-installed"


def is_installed(directory: Path, pins: Any) -> bool:
    stamp = directory / STAMP
    return stamp.exists() and stamp.read_text() == json.dumps(pins)


def mark_installed(directory: Path, pins: Any) -> None:
    (directory / STAMP).write_text(json.dumps(pins))


def start_install(directory: Path) -> None:
    """An empty directory for a fresh install: whatever an older pin left there goes."""
    if directory.exists():
        shutil.rmtree(directory)
    directory.mkdir(parents=True)


def step(peer: str, what: str, command: list[str], cwd: Path | None = None) -> None:
    """One set-up step, announced on one line first: some take minutes (a build, a large wheel)."""
    print(f"{peer}: {what} ...", flush=True)
    started = monotonic()
    result = subprocess.run(command, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if result.returncode != 0:
        raise BenchError(f"{peer}: {what} failed ({' '.join(command)}):\n{result.stdout[-3000:]}")
    print(f"{peer}: {what} took {monotonic() - started:.0f} s", flush=True)


def make_venv(peer: str, venv: Path, requirement_steps: tuple[tuple[str, ...], ...]) -> Path:
    """A virtual environment with each step's requirements installed in order; its python."""
    step(peer, f"creating {venv}", [sys.executable, "-m", "venv", str(venv)])
    python = venv / "bin" / "python"
    for requirements in requirement_steps:
        step(peer, f"pip install {' '.join(requirements)}",
             [str(python), "-m", "pip", "install", "--disable-pip-version-check", "-q", *requirements])
    return python
