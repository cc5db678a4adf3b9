"""benchmarks/device_check.py: without a device it says what it would run and exits 0; its
checks themselves run here in interpret mode (the script's code path, not a device's)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).parent.parent / "benchmarks" / "device_check.py"


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "JAX_PLATFORMS": "cpu"})


def test_without_a_device_it_says_what_it_would_run_and_exits_0():
    run = _run()
    assert run.returncode == 0, run.stderr
    lines = run.stdout.strip().splitlines()
    assert lines[0].startswith("no GPU or TPU found (JAX backend: cpu)")
    assert "50 correctness checks" in run.stdout and "kernels_gpu.py --skip-checks" in run.stdout
    assert "on a Hopper GPU 28 more" in run.stdout  # Mosaic GPU: dense x 2 heads, int8 / fp8 / KIVI x 32/8
    assert json.loads(lines[-1]) == dict(device=None, checks=0, failures=0, seconds=0.0)


def test_interpret_smoke_runs_the_checks():
    run = _run("--interpret-smoke")
    assert run.returncode == 0, run.stdout + run.stderr
    rows = [line for line in run.stdout.splitlines() if line.startswith("| cpu |")]
    assert len(rows) == 5 and all(row.endswith("| ok |") for row in rows), rows  # Triton x 3, Mosaic GPU x 2
    assert json.loads(run.stdout.strip().splitlines()[-1])["failures"] == 0
