"""Host vs device time of an `Engine`'s steps, for the benchmarks.

The engine is synchronous: each step builds its batch on the host, runs one jitted program and
waits for its tokens, so the device idles while the host works. `StepTimer` times each program
call to completion (the engine blocks on its tokens right after anyway) and each `Engine.step`.
"""

from __future__ import annotations

import time

import jax
import numpy as np


class StepTimer:
    def __init__(self, engine):
        self.engine = engine
        self.device: list[float] = []  # seconds per program call
        self.host: list[float] = []  # seconds per Engine.step that ran a program, minus its programs
        self._call, self._step = engine._compiles.call, engine.step

    def __enter__(self) -> StepTimer:
        def call(fn, *args):
            start = time.perf_counter()
            out = jax.block_until_ready(self._call(fn, *args))
            self.device.append(time.perf_counter() - start)
            return out

        def step():
            start, calls = time.perf_counter(), len(self.device)
            out = self._step()
            if len(self.device) > calls:  # a step that ran a program
                self.host.append(time.perf_counter() - start - sum(self.device[calls:]))
            return out

        self.engine._compiles.call, self.engine.step = call, step
        self.start = time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        self.wall = time.perf_counter() - self.start
        self.engine._compiles.call, self.engine.step = self._call, self._step

    def reset(self) -> None:
        self.device.clear()
        self.host.clear()
        self.start = time.perf_counter()

    @property
    def host_ms_per_step(self) -> float:
        """p50 of (Engine.step wall time - its program's time), ms."""
        return 1e3 * float(np.median(self.host))

    @property
    def device_idle_frac(self) -> float:
        """Fraction of the wall time no program ran."""
        return 1 - sum(self.device) / self.wall
