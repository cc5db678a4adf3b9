"""A progress bar for loaders: counts the tensors handed to `build_params`, on stderr, and
appears only once loading has taken `DELAY_S` (quick loads stay silent)."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator

import numpy as np
from tqdm import tqdm

DELAY_S = 2.0

Get = Callable[[str, tuple[int, ...]], np.ndarray]


@contextlib.contextmanager
def counting(get: Get, total: int, desc: str, enabled: bool = True) -> Iterator[Get]:
    """`get`, advancing a bar of `total` tensors on each call; `enabled=False`: no bar at all."""
    with tqdm(total=total, desc=desc, unit="tensor", delay=DELAY_S, disable=not enabled, file=sys.stderr) as bar:

        def counted(name: str, shape: tuple[int, ...]) -> np.ndarray:
            array = get(name, shape)
            bar.update()
            return array

        yield counted
