"""What a result file records about how it was made, so that a figure quoted from it can be traced
to the code and the command that produced it (and seen to be older than the code it describes)."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def git(*args: str) -> str:
    """A git command's output in the checkout; "" where there is no git or no repository."""
    try:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def provenance() -> dict:
    """The commit (and whether the tree differed from it), the command line, the date and the machine."""
    return {"commit": git("rev-parse", "HEAD") or None,
            "dirty": bool(git("status", "--porcelain", "--untracked-files=no")),
            # (paths in the checkout written relative to it: no machine's paths in a committed file)
            "command": " ".join(["python", os.path.relpath(sys.argv[0], ROOT),
                                 *(arg.replace(f"{ROOT}{os.sep}", "") for arg in sys.argv[1:])]),
            "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "torch": torch.__version__,
                        "platform": platform.platform()}}
