"""Server metrics in the Prometheus text exposition format (hand-written, no global registry).

Counters and histograms are updated by the engine loop thread and read by `/metrics`
on the event loop, so every update and every render holds one lock.
"""

from __future__ import annotations

import bisect
import threading

import math

from jaxinfer.engine import EngineMetrics
from jaxinfer.speculative.config import SpeculativeStats

TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


class Histogram:
    """Cumulative-bucket histogram: `counts[i]` observations <= `bounds[i]` (the last is +Inf)."""

    def __init__(self, name: str, help_text: str, bounds: tuple[float, ...]):
        self.name, self.help, self.bounds = name, help_text, bounds
        self.counts = [0] * (len(bounds) + 1)  # per bucket, not cumulative; the last is +Inf
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.sum += value

    def render(self) -> list[str]:
        lines = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} histogram"]
        total = 0
        for bound, count in zip((*self.bounds, float("inf")), self.counts):
            total += count
            le = "+Inf" if bound == float("inf") else repr(bound)
            lines.append(f'{self.name}_bucket{{le="{le}"}} {total}')
        return lines + [f"{self.name}_sum {self.sum!r}", f"{self.name}_count {total}"]


class ServerMetrics:
    """What the server counts on top of the engine's own gauges."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.finished: dict[str, int] = {}  # finish_reason -> requests
        self.rejected: dict[str, int] = {}  # reason -> requests refused before reaching the engine
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.ttft = Histogram("jaxinfer_time_to_first_token_seconds", "Arrival to first generated token.", TTFT_BUCKETS)
        self.itl = Histogram("jaxinfer_inter_token_latency_seconds", "Time between consecutive tokens of a request.", ITL_BUCKETS)
        self.e2e = Histogram("jaxinfer_e2e_request_latency_seconds", "Arrival to finish.", E2E_BUCKETS)

    def reject(self, reason: str) -> None:
        with self.lock:
            self.rejected[reason] = self.rejected.get(reason, 0) + 1

    def render(self, engine: EngineMetrics | None, queued: int) -> str:
        with self.lock:
            lines = _counter("jaxinfer_requests_finished_total", "Requests finished, by finish reason.",
                             "finish_reason", self.finished)
            lines += _counter("jaxinfer_requests_rejected_total", "Requests the engine loop refused: queue full, or "
                              "invalid by the engine's checks (requests the HTTP layer answers 400 are not counted).",
                              "reason", self.rejected)
            lines += _scalar("counter", "jaxinfer_prompt_tokens_total", "Prompt tokens of admitted requests.", self.prompt_tokens)
            lines += _scalar("counter", "jaxinfer_generation_tokens_total", "Generated tokens.", self.generation_tokens)
            for h in (self.ttft, self.itl, self.e2e):
                lines += h.render()
        lines += _scalar("gauge", "jaxinfer_requests_outstanding", "Requests accepted and not yet finished.", queued)
        if engine is not None:
            lines += _engine_lines(engine)
            if engine.speculative is not None:
                lines += _speculative_lines(engine.speculative)
        return "\n".join(lines) + "\n"


def _engine_lines(m: EngineMetrics) -> list[str]:
    return [
        *_scalar("gauge", "jaxinfer_requests_running", "Requests holding a slot.", m.running),
        *_scalar("gauge", "jaxinfer_requests_waiting", "Requests waiting for a slot.", m.waiting),
        *_scalar("gauge", "jaxinfer_kv_pages_used", "KV pages referenced by a request.", m.pages_used),
        *_scalar("gauge", "jaxinfer_kv_pages_free", "KV pages an allocation can take (free + evictable cached).", m.pages_free),
        *_scalar("gauge", "jaxinfer_kv_pages_cached", "KV pages registered in the prefix cache.", m.pages_cached),
        *_scalar("gauge", "jaxinfer_kv_window_pages_used", "Windowed layers' ring pages held by running requests.",
                 m.window_pages_used),
        *_scalar("gauge", "jaxinfer_kv_window_pages_total", "Windowed layers' ring pages (all slots).",
                 m.window_pages_total),
        *_scalar("gauge", "jaxinfer_prefix_cache_hit_rate", "Cached full prompt pages / pages looked up.", m.prefix_hit_rate),
        *_scalar("counter", "jaxinfer_prefix_cache_hits_total", "Full prompt pages found in the prefix cache.", m.prefix_hits),
        *_scalar("counter", "jaxinfer_prefix_cache_queries_total", "Full prompt pages looked up.", m.prefix_queries),
        *_scalar("counter", "jaxinfer_preemptions_total", "Requests preempted for pages.", m.preemptions),
        *_scalar("counter", "jaxinfer_engine_steps_total", "Engine steps run.", m.steps),
    ]


def _speculative_lines(s: SpeculativeStats) -> list[str]:
    name = "jaxinfer_spec_acceptance"
    per_position = [f'{name}{{position="{i}"}} {_number(a)}' for i, a in enumerate(s.acceptance_per_position)]
    return [
        *_scalar("counter", "jaxinfer_spec_draft_tokens_total", "Draft tokens verified by the target.", int(s.drafted.sum())),
        *_scalar("counter", "jaxinfer_spec_accepted_tokens_total", "Draft tokens accepted.", int(s.accepted.sum())),
        # NaN (no value yet), as the per-position gauges, until something is verified
        *_scalar("gauge", "jaxinfer_spec_acceptance_rate", "Accepted / verified draft tokens; NaN until one is verified.",
                 s.acceptance_rate if s.drafted.any() else math.nan),
        *_scalar("gauge", "jaxinfer_spec_tokens_per_call", "Tokens emitted per target forward of a decoding row; NaN "
                 "until a row decodes.", s.tokens_per_call if s.target_calls else math.nan),
        f"# HELP {name} Share of the drafts at position i (0: the first) accepted, drafts 0..i all accepted; NaN "
        "until one is verified.",
        f"# TYPE {name} gauge",
        *per_position,
    ]


def _number(value: float) -> str:
    """A sample value as Prometheus writes it (NaN, not Python's nan)."""
    return "NaN" if math.isnan(value) else str(value)


def _scalar(kind: str, name: str, help_text: str, value: float) -> list[str]:
    return [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}", f"{name} {_number(value)}"]


def _counter(name: str, help_text: str, label: str, values: dict[str, int]) -> list[str]:
    lines = [f"# HELP {name} {help_text}", f"# TYPE {name} counter"]
    return lines + [f'{name}{{{label}="{key}"}} {value}' for key, value in sorted(values.items())]
