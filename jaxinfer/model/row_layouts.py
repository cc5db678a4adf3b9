"""Which stored layout a product of one row, and of a few rows, reads fastest on this CPU.

An engine on XLA:CPU keeps every dense weight as `nk`, `panels` and `kn`
(`jaxinfer.model.layers.LinearLayouts`). Which of them a batch-1 gemv or a verify block's
few rows read fastest is a property of the machine, not only of the shapes
(BENCHMARKS.md, "Which layout each row count reads"): on the AMD EPYC machines one row read
`nk` (`x @ w.T`, XLA's fused loop gemv) 1.4x faster than `kn`, and 2-6 rows read `panels`
fastest; on an AMX-capable Xeon one row reads `kn` (a library gemv) 2-3x faster than
`nk`, and a few rows `kn` too.

`measure_reads` times the candidates over the model's own weights: every dense product and
the LM head in one dependent chain, in forward order, so the bytes come from where a real
step finds them (a single weight read again and again sits in cache and flatters whichever
form is timed). `choose_reads` does that once per machine, weight shapes and jax version and
keeps the answer in `$JAXINFER_CACHE/row_layouts.json`, so a second start measures nothing.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer import layer_stack
from jaxinfer.model.layers import DEFAULT_READS, PANEL_MAX_ROWS, READS, LinearLayouts, check_reads, linear, rms_norm
from jaxinfer.model.params import GEMM_WEIGHTS, LayerParams, ModelParams, with_gemm_weights

logger = logging.getLogger(__name__)

MEASURE_MIN_BYTES = 64 * 2**20  # smaller models keep DEFAULT_READS: their products cost dispatch, not reads
FEW_ROWS = 4  # the rows a "few rows" product is timed at (a k = 3 verify block at batch 1)
MARGIN = 0.95  # a candidate replaces the default only when this much faster or more: no flapping on noise
_CHOSEN: dict[str, tuple[str, str]] = {}  # this process's answers, by `_key`


def choose_reads(params: ModelParams, setting: str | tuple[str, str] = "auto") -> tuple[str, str]:
    """The `LinearLayouts.reads` an engine on this machine uses: `setting` itself when it
    names the layouts, else (for "auto") `DEFAULT_READS` for models under
    `MEASURE_MIN_BYTES` of dense weights or with weights other than f32 (XLA:CPU's bf16
    few-row products are slow enough that timing them took minutes, and the f32 answer is
    what was measured), else the answer measured once per machine and model shapes
    (`measure_reads`, remembered in `$JAXINFER_CACHE/row_layouts.json`). `params` must be in
    all layouts (`with_gemm_weights`)."""
    if setting != "auto":
        return check_reads(setting)
    weights = _chain_weights(params)
    if sum(w.nk.nbytes for w, _ in weights) < MEASURE_MIN_BYTES or any(w.nk.dtype != np.float32 for w, _ in weights):
        return DEFAULT_READS
    key = _key(weights)
    if key not in _CHOSEN:
        remembered = _read_cache().get(key)
        if _valid(remembered):
            _CHOSEN[key] = tuple(remembered)
        else:  # never measured here (or the file was damaged): measure
            try:
                _CHOSEN[key] = measure_reads(params)["reads"]
            except Exception as e:  # noqa: BLE001 - a failed timing must not stop an engine: keep the default
                logger.warning("could not time the row layouts (%s: %s); products keep %s", type(e).__name__, e,
                               DEFAULT_READS)
                return DEFAULT_READS
            _write_cache(key, _CHOSEN[key])
            logger.info("products of 1 row read %s, of 2-%d rows %s on this machine (measured; kept in %s)",
                        _CHOSEN[key][0], PANEL_MAX_ROWS, _CHOSEN[key][1], _cache_path())
    return _CHOSEN[key]


def measure_reads(params: ModelParams, rounds: int = 5) -> dict:
    """Time every candidate layout for one row and for `FEW_ROWS` rows over the model's weight
    chain (`rounds` interleaved rounds, medians) -> {"reads": the faster pair, "ms": {(rows,
    layout): median ms}}. A candidate beats the default only when `MARGIN` or faster."""
    base = with_gemm_weights(params, DEFAULT_READS)
    if not _chain_weights(base):  # nothing stored in several layouts (MLA layers, experts)
        return {"reads": DEFAULT_READS, "ms": {}}
    candidates = [(1, layout) for layout in READS[0]] + [(FEW_ROWS, layout) for layout in READS[1]]


    def program(candidate):
        rows, layout = candidate
        reads = (layout, DEFAULT_READS[1]) if rows == 1 else (DEFAULT_READS[0], layout)
        return _chain_program(_chain_weights(with_gemm_weights(base, reads)), rows)

    with ThreadPoolExecutor(2) as pool:  # compiling is most of the cost, and XLA releases the GIL
        programs = dict(zip(candidates, pool.map(program, candidates)))
    times = {c: [] for c in programs}
    for run in programs.values():
        run()  # compile and touch once
    for _ in range(rounds):
        for c, run in programs.items():
            t0 = time.perf_counter()
            run()
            times[c].append(time.perf_counter() - t0)
    ms = {c: 1e3 * statistics.median(t) for c, t in times.items()}
    return {"reads": pick_reads(ms), "ms": ms}


def pick_reads(ms: dict[tuple[int, str], float]) -> tuple[str, str]:
    """{(rows, layout): time} for 1 and `FEW_ROWS` rows -> the pair of fastest layouts, the
    default's kept unless another is faster by `MARGIN`."""
    chosen = []
    for rows, default in ((1, DEFAULT_READS[0]), (FEW_ROWS, DEFAULT_READS[1])):
        best = min((c for c in ms if c[0] == rows), key=ms.get)
        chosen.append(best[1] if ms[best] < MARGIN * ms[rows, default] else default)
    return tuple(chosen)


def _valid(reads) -> bool:
    try:
        check_reads(tuple(reads))
    except (TypeError, ValueError):
        return False
    return True


def _chain_weights(params: ModelParams) -> list[tuple[LinearLayouts, int | None]]:
    """Every dense weight and the LM head in forward order, as (weight, layer index within
    its stacked run or None)."""
    out = []
    for run in params.layers:
        stacked = isinstance(run, layer_stack.LayerStack)
        layer = run.stacked if stacked else run
        if not isinstance(layer, LayerParams):
            continue
        ws = [w for name in GEMM_WEIGHTS if isinstance(w := getattr(layer, name), LinearLayouts)]
        for i in range(layer.attn_norm.shape[0] if stacked else 1):
            out += [(w, i if stacked else None) for w in ws]
    if isinstance(params.lm_head, LinearLayouts):
        out.append((params.lm_head, None))
    return out


def _chain_program(weights: list[tuple[LinearLayouts, int | None]], rows: int):
    """A jitted chain: each product's input depends on the one before (as in a forward, so
    nothing runs side by side), `rows` rows each. -> a callable that runs it once."""
    index = [i for _, i in weights]
    arrays = [w for w, _ in weights]
    rng = np.random.default_rng(0)
    inputs = {k: jnp.asarray(rng.standard_normal((rows, k)), arrays[0].nk.dtype)
              for k in {w.nk.shape[-1] for w in arrays}}

    def chain(arrays, inputs):
        s = jnp.zeros((), jnp.float32)
        for w, i in zip(arrays, index):
            if i is not None:
                w = jax.tree.map(lambda a: a[i], w)
            x = inputs[w.nk.shape[-1]]
            # normed, as most products' inputs are in a forward: XLA:CPU fuses the norm into
            # `nk`'s loop gemv, which then recomputes it per output (the engine's step pays that)
            x = rms_norm(x + s.astype(x.dtype), jnp.ones(x.shape[-1], x.dtype), 1e-6)
            s = s + 1e-30 * jnp.sum(linear(x, w).astype(jnp.float32))
        return s

    compiled = jax.jit(chain).lower(arrays, inputs).compile()
    return lambda: compiled(arrays, inputs).block_until_ready()


def _key(weights: list[tuple[LinearLayouts, int | None]]) -> str:
    shapes = repr([(w.nk.shape, str(w.nk.dtype), i) for w, i in weights]).encode()
    return f"{_cpu_name()} x{os.cpu_count()} | jax {jax.__version__} | {hashlib.sha1(shapes).hexdigest()[:16]}"


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _cache_path() -> Path:
    from jaxinfer.default_model import cache_dir

    return cache_dir() / "row_layouts.json"


def _read_cache() -> dict:
    try:
        entries = json.loads(_cache_path().read_text())
    except (OSError, ValueError):
        return {}
    return entries if isinstance(entries, dict) else {}


def _write_cache(key: str, reads: tuple[str, str]) -> None:
    """Best effort: a cache that cannot be written only means measuring again next start."""
    try:
        path = _cache_path()
        path.parent.mkdir(parents=True, exist_ok=True)
        entries = _read_cache()
        entries[key] = list(reads)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(entries, indent=1, sort_keys=True))
        tmp.replace(path)
    except OSError as e:
        logger.warning("could not remember the measured row layouts in %s: %s", _cache_path(), e)
