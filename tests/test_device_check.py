"""benchmarks/device_check.py: without a device it says what it would run and exits 0; its
checks themselves run here in interpret mode (the script's code path, not a device's)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

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


@pytest.mark.extended
def test_interpret_smoke_runs_the_checks():
    run = _run("--interpret-smoke")
    assert run.returncode == 0, run.stdout + run.stderr
    rows = [line for line in run.stdout.splitlines() if line.startswith("| cpu |")]
    assert len(rows) == 5 and all(row.endswith("| ok |") for row in rows), rows  # Triton x 3, Mosaic GPU x 2
    assert json.loads(run.stdout.strip().splitlines()[-1])["failures"] == 0


def test_a_worker_that_dies_fails_its_row_and_the_rest_still_run(tmp_path, monkeypatch):
    """run_in_workers against a stand-in worker that prints row 0 and then dies of SIGSEGV when
    started at row 0 (as the Triton KIVI decode did on an H200): row 1 is a failed row naming
    the signal, and a new worker runs row 2."""
    sys.path.insert(0, str(SCRIPT.parent))
    import device_check

    worker = tmp_path / "worker.py"
    worker.write_text(
        "import os, signal, sys\n"
        "start = int(sys.argv[sys.argv.index('--child-from') + 1])\n"
        "for i in range(start, 3):\n"
        "    print(f'| dev | row{i} | ok |', flush=True)\n"
        "    if start == 0:\n"
        "        os.kill(os.getpid(), signal.SIGSEGV)\n")
    monkeypatch.setattr(device_check, "__file__", str(worker))
    rows = [("decode", fmt, (8, 1), False, "triton") for fmt in ("dense", "int4", "int8")]
    table = list(device_check.run_in_workers(rows, interpret=False, device="dev", target="gpu"))
    assert table[0] == "| dev | row0 | ok |" and table[2] == "| dev | row2 | ok |"
    assert table[1] == "| dev | decode | triton | int4 | 8/1 | off | nan | FAILED the process died (exit -11) |"
