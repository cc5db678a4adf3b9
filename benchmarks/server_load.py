"""Server under load vs the same trace offline: `jaxinfer serve` with SmolLM2 on 127.0.0.1.

`--repeats` fixed-seed, long-tailed traces (log-normal prompt and output lengths, greedy, EOS
ignored so every request generates exactly its length; seeds seed, seed + 1, ...) are each run
both ways, one right after the other (so both see the same machine):
  offline: every request added to an `Engine` in this process, stepped to completion;
  server:  `jaxinfer serve` in a subprocess (same engine config, warmed up before /health
           answers; idle while the offline run goes), the trace sent by `--clients`
           concurrent streaming clients (httpx, asyncio); SIGTERM after the last trace.
tok/s counts generated tokens over the wall time from the first request to the last token.
`server_over_offline` is the median over traces of server / offline on the same trace (one
15-20 s run on 2 shared cores swings by 30 %, and traces differ in difficulty); the tok/s
figures are medians too, and every run is listed. TTFT is send -> first streamed token; ITL
is the gap between consecutive streamed chunks (over all traces).

Last line: {"server_tok_s", "offline_tok_s", "server_over_offline", "ttft_p50_ms",
"ttft_p99_ms", "itl_p50_ms", "itl_p99_ms", "completed", "failed", "server_tok_s_runs",
"offline_tok_s_runs", "server_over_offline_runs", "client_cpu_share" (CPU the clients
used, as a share of all cores over the server runs)}.

    python benchmarks/server_load.py                  # 64 requests, 64 clients
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time

import httpx
import numpy as np


def trace(n: int, seed: int, max_len: int) -> list[tuple[list[int], int]]:
    """(prompt ids, output tokens) per request; log-normal lengths, prompt + output < max_len."""
    rng = np.random.default_rng(seed)
    prompts = np.clip(rng.lognormal(np.log(24), 0.8, n), 4, max_len // 2).astype(int)
    outputs = np.clip(rng.lognormal(np.log(20), 0.9, n), 2, max_len // 2 - 1).astype(int)
    return [(rng.integers(100, 20_000, p).tolist(), int(o)) for p, o in zip(prompts, outputs)]


def engine_config(args):
    from jaxinfer.engine import EngineConfig

    return EngineConfig(max_slots=args.max_slots, page_size=args.page_size, prefill_chunk=args.prefill_chunk,
                        max_model_len=args.max_model_len)


def offline_engine(args):
    from jaxinfer.engine import Engine
    from jaxinfer.loading import load_model

    engine = Engine(load_model(args.model, progress=False), engine_config(args))
    engine.warmup()
    return engine


def run_offline(engine, reqs) -> float:
    """tok/s of one trace through the warmed-up in-process `Engine`."""
    from jaxinfer.sampling import SamplingParams

    start = time.perf_counter()
    for ids, out in reqs:
        engine.add_request(ids, SamplingParams(temperature=0, max_tokens=out, ignore_eos=True))
    tokens = 0
    while engine.has_unfinished_requests():
        tokens += sum(len(o.delta_token_ids) for o in engine.step())
    assert tokens == sum(out for _, out in reqs), tokens
    return tokens / (time.perf_counter() - start)


def start_server(args, port: int) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "jaxinfer", "serve", "--port", str(port), "--host", "127.0.0.1",
           "--max-slots", str(args.max_slots), "--page-size", str(args.page_size),
           "--prefill-chunk", str(args.prefill_chunk), "--max-model-len", str(args.max_model_len),
           "--served-model-name", "bench"]
    if args.model:
        cmd += ["--model", args.model]
    log = tempfile.NamedTemporaryFile("w+", suffix=".log", delete=False)
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=log, text=True)
    deadline = time.monotonic() + args.start_timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited: {open(log.name).read()[-2000:]}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return proc
        except httpx.HTTPError:
            time.sleep(0.5)
    proc.kill()
    raise RuntimeError("server did not come up")


async def one(client: httpx.AsyncClient, url: str, ids: list[int], out: int, gate: asyncio.Semaphore):
    """(tokens, ttft s, [gaps s]) of one streaming request, or None if it failed."""
    body = {"model": "bench", "prompt": ids, "max_tokens": out, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    async with gate:
        sent = time.perf_counter()
        times, tokens = [], None
        async with client.stream("POST", url, json=body) as r:
            if r.status_code != 200:
                return None
            async for line in r.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                event = json.loads(line[6:])
                if event["choices"] and event["choices"][0]["text"]:
                    times.append(time.perf_counter())
                if event.get("usage"):
                    tokens = event["usage"]["completion_tokens"]
        if tokens != out or not times:
            return None
        return tokens, times[0] - sent, list(np.diff(times))


async def run_clients(args, port: int, reqs) -> tuple[float, list]:
    gate = asyncio.Semaphore(args.clients)
    limits = httpx.Limits(max_connections=args.clients)
    async with httpx.AsyncClient(timeout=args.request_timeout, limits=limits) as client:
        start = time.perf_counter()
        url = f"http://127.0.0.1:{port}/v1/completions"
        results = await asyncio.gather(*[one(client, url, ids, out, gate) for ids, out in reqs], return_exceptions=True)
        wall = time.perf_counter() - start
    return wall, [r if isinstance(r, tuple) else None for r in results]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="default: SmolLM2-135M-Instruct")
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--clients", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--repeats", type=int, default=5, help="traces (seeds seed .. seed + repeats - 1)")
    p.add_argument("--max-slots", type=int, default=16)
    p.add_argument("--page-size", type=int, default=64)  # 4 pages at 256 tokens: one context bucket
    p.add_argument("--prefill-chunk", type=int, default=64)
    p.add_argument("--max-model-len", type=int, default=256)
    p.add_argument("--start-timeout", type=float, default=900)
    p.add_argument("--request-timeout", type=float, default=900)
    args = p.parse_args()

    traces = [trace(args.requests, args.seed + i, args.max_model_len) for i in range(args.repeats)]
    for reqs in traces:
        print(f"trace: {len(reqs)} requests, prompt tokens {sum(len(i) for i, _ in reqs)}, "
              f"output tokens {sum(o for _, o in reqs)} (max {max(o for _, o in reqs)})", file=sys.stderr)
    engine = offline_engine(args)
    port = free_port()
    proc = start_server(args, port)
    offline, server, results, client_cpu, server_wall = [], [], [], 0.0, 0.0
    try:
        for reqs in traces:
            offline.append(run_offline(engine, reqs))
            cpu = time.process_time()
            wall, res = asyncio.run(run_clients(args, port, reqs))
            client_cpu += time.process_time() - cpu  # the clients share the 2 cores with the server
            server_wall += wall
            server.append(sum(r[0] for r in res if r is not None) / wall)
            results += res
    finally:
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(120)
    print(f"offline: {', '.join(f'{x:.1f}' for x in offline)} tok/s", file=sys.stderr)
    print(f"server: {', '.join(f'{x:.1f}' for x in server)} tok/s; exited with {code} after SIGTERM "
          f"({'clean' if code == 0 else 'NOT clean'})", file=sys.stderr)
    ok = [r for r in results if r is not None]
    ttft = np.array([r[1] for r in ok]) * 1e3
    itl = np.array([g for r in ok for g in r[2]] or [0.0]) * 1e3
    ratios = [a / b for a, b in zip(server, offline)]
    print(json.dumps({
        "server_tok_s": round(float(np.median(server)), 2), "offline_tok_s": round(float(np.median(offline)), 2),
        "server_over_offline": round(float(np.median(ratios)), 3),
        "ttft_p50_ms": round(float(np.percentile(ttft, 50)), 1), "ttft_p99_ms": round(float(np.percentile(ttft, 99)), 1),
        "itl_p50_ms": round(float(np.percentile(itl, 50)), 1), "itl_p99_ms": round(float(np.percentile(itl, 99)), 1),
        "completed": len(ok), "failed": len(results) - len(ok),
        "server_tok_s_runs": [round(x, 2) for x in server], "offline_tok_s_runs": [round(x, 2) for x in offline],
        "server_over_offline_runs": [round(x, 3) for x in ratios],
        "client_cpu_share": round(client_cpu / (server_wall * (os.cpu_count() or 1)), 3),
    }))


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
