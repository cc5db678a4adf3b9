"""Command line: `jaxinfer generate`, `jaxinfer convert`, `jaxinfer calibrate-kv`, `jaxinfer serve`."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from jaxinfer.engine import EngineConfig
    from jaxinfer.loading import Model

DESCRIPTION = """jaxinfer: functional LLM inference in JAX over a paged KV cache.

With no --model, the default model (SmolLM2-135M-Instruct, GGUF) is fetched from
PyPI on first use and cached in $JAXINFER_CACHE (default ~/.cache/jaxinfer); so is
--model gemma3-270m (Gemma 3 270M, GGUF Q4_K_M)."""

EXAMPLES = """examples:
  jaxinfer generate "Write a haiku about JAX."
  jaxinfer generate --stats "Name a colour." "Name a fruit." --prompts-file more_prompts.txt
  jaxinfer generate --raw --temperature 0.8 --seed 1 "Once upon a time"
  jaxinfer generate --model ./my-llama-dir "Hello"
  jaxinfer generate --model gemma3-270m "Why is the sky blue?"
  jaxinfer generate --mesh data=2,model=3 "Hello"   # 6 devices: 2-way data x 3-way tensor parallel
  jaxinfer generate --speculative ngram --num-speculative 4 "Repeat: a b c d"   # also self:8, draft, eagle
  jaxinfer convert model.gguf ./model-orbax     # an orbax checkpoint (restores onto a mesh's shardings)
  jaxinfer serve --port 8000 --api-key sk-local    # OpenAI-compatible API on 127.0.0.1
  jaxinfer run-batch -i requests.jsonl -o results.jsonl   # OpenAI batch file, answered offline
  jaxinfer calibrate-kv --budget-kl 0.01 --out plan.json   # per-layer KV-cache formats within a KL budget
"""


def _add_attention_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--attention-impl", default="auto", choices=["auto", "reference", "pallas"],
                   help="paged attention: auto (Pallas kernels on GPU/TPU, the reference on CPU; the "
                   "reference for a program whose kernel fails to compile), jnp reference, or Pallas kernels")


def _add_model_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", help="a .gguf file, an HF directory (config.json + *.safetensors) "
                   "or an orbax directory from `jaxinfer convert`, or a packaged model name (gemma3-270m); "
                   "default: SmolLM2-135M-Instruct")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                   help="weight and activation dtype (float32 is fastest on CPU; bfloat16 on GPU/TPU)")
    p.add_argument("--chat-template", default=None, metavar="FILE|TEMPLATE",
                   help="render chats with this jinja template instead of the model's (a .jinja file, a JSON file "
                   "with a 'chat_template', or the template itself), as vLLM's flag")


def _add_compilation_cache_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--no-compilation-cache", action="store_true",
                   help="do not keep compiled programs in $JAXINFER_CACHE/xla (the next start compiles them again)")


def _add_kv_cache_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--kv-cache", default="auto", metavar="FORMAT|PLAN",
                   help="KV-cache storage: 'auto' (the model's dtype), a format for every layer (int8, fp8_e4m3, "
                   "fp8_e5m2, int4, int2, bf16, f32; vLLM's fp8, bfloat16, float32) or a per-layer plan's JSON file "
                   "from `jaxinfer calibrate-kv`")


def _add_async_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--async-scheduling", action="store_true",
                   help="schedule the next step while the device runs this one (not with --speculative)")


def _add_speculative_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--speculative", default=None, metavar="SOURCE",
                   help="speculative decoding: 'ngram' (prompt lookup), 'self:N' (the model's first N layers), "
                   "'draft[:DIR]' (a trained draft; default checkpoints/smollm2_draft) or 'eagle[:DIR]' (an EAGLE "
                   "head over the model's features; default checkpoints/smollm2_eagle)")
    p.add_argument("--num-speculative", "--num-speculative-tokens", type=int, default=None,
                   help="draft tokens verified per step (k; default 4)")
    p.add_argument("--speculative-disable-by-batch-size", type=int, default=None, metavar="N",
                   help="steps with N or more decoding requests do not speculate ('ngram' and 'self:N' only)")
    p.add_argument("--speculative-config", default=None, metavar="JSON",
                   help="vLLM's form instead of the flags above: '{\"method\": \"ngram\", "
                   "\"num_speculative_tokens\": 4, \"prompt_lookup_max\": 3}' (method ngram, eagle, eagle3 or "
                   "draft_model; model: a directory)")


def _fit_context(config: EngineConfig, model: Model) -> EngineConfig:
    """The engine config with max_model_len cut to the model's context."""
    return dataclasses.replace(config, max_model_len=min(config.max_model_len, model.config.max_position))


def _speculative(args: argparse.Namespace):
    from jaxinfer.engine import SpeculativeConfig

    if args.speculative_config is not None:
        if any(v is not None for v in (args.speculative, args.num_speculative, args.speculative_disable_by_batch_size)):
            raise ValueError("--speculative-config holds the whole config: not with --speculative, "
                             "--num-speculative-tokens or --speculative-disable-by-batch-size")
        try:
            config = json.loads(args.speculative_config)
        except ValueError as e:
            raise ValueError(f"--speculative-config is not valid JSON: {e}") from None
        return SpeculativeConfig.from_vllm(config)
    if args.speculative is None:
        for flag, value in (("--num-speculative-tokens", args.num_speculative),
                            ("--speculative-disable-by-batch-size", args.speculative_disable_by_batch_size)):
            if value is not None:  # vLLM refuses k without a method too: speculation would silently be off
                raise ValueError(f"{flag} needs --speculative (or --speculative-config)")
        return None
    return SpeculativeConfig.parse(args.speculative, 4 if args.num_speculative is None else args.num_speculative,
                                   disable_by_batch_size=args.speculative_disable_by_batch_size)


def _add_mesh_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--mesh", default=None, help="shard over devices, e.g. 'data=2,model=4' (tensor parallel on "
                   "model, slots on data; sizes multiply to the device count of all processes)")
    p.add_argument("--coordinator", default=None, help="multi-host: host:port of process 0 for jax.distributed "
                   "(or $JAXINFER_COORDINATOR); on TPU pods/SLURM give only --num-processes to auto-detect")
    p.add_argument("--num-processes", type=int, default=None, help="multi-host: processes in the job "
                   "(or $JAXINFER_NUM_PROCESSES)")
    p.add_argument("--process-id", type=int, default=None, help="multi-host: this process's rank "
                   "(or $JAXINFER_PROCESS_ID)")


def _add_serving_flags(p: argparse.ArgumentParser) -> None:
    """The model, engine and API flags `serve` and `run-batch` share."""
    _add_model_flags(p)
    p.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                   help="the model name(s) clients send; the first is listed first (default: --model or 'default')")
    p.add_argument("--tool-call-parser", default=None,
                   help="with tool_choice 'auto' (the default when tools are sent), return the calls the model "
                        "writes in its answer as tool_calls: 'hermes' for <tool_call>{json}</tool_call> (Hermes, "
                        "Qwen 2.5/3, SmolLM3), 'llama3_json' for an answer that is {json} calls (Llama 3.1/3.2); "
                        "without it 'auto' answers in text")
    p.add_argument("--generation-config", default="auto", metavar="auto|vllm|DIR",
                   help="defaults of the sampling fields a request leaves out (temperature, top_p, top_k, min_p, "
                        "repetition_penalty, max_tokens): 'auto' the model's generation_config.json, 'vllm' "
                        "the API's own, or a directory's generation_config.json (vLLM's flag)")
    p.add_argument("--reasoning-parser", default=None, choices=["qwen3", "deepseek_r1"],
                   help="return a chat answer's <think>...</think> as message.reasoning_content, and "
                        "constrain structured output only after it (Qwen3, DeepSeek-R1; vLLM's flag)")
    p.add_argument("--enable-auto-tool-choice", action="store_true",
                   help="accepted as vLLM has it; needs --tool-call-parser, which alone turns parsing on")
    p.add_argument("--max-slots", "--max-num-seqs", type=int, default=8, help="requests served concurrently")
    _add_attention_flag(p)
    p.add_argument("--max-queue", type=int, default=256, help="requests waiting beyond the slots; more get 429")
    p.add_argument("--max-model-len", type=int, default=2048, help="longest prompt + output a request may have")
    p.add_argument("--page-size", "--block-size", type=int, default=16, help="tokens per KV page")
    p.add_argument("--num-pages", type=int, default=None, help="KV pages in the pool (default: enough for every slot)")
    p.add_argument("--prefill-chunk", type=int, default=64, help="prompt tokens a request prefills per step")
    p.add_argument("--max-prefill-rows", type=int, default=1,
                   help="prompts that prefill side by side in one step (more: a short prompt's first token does "
                        "not wait behind a long prompt's chunks)")
    p.add_argument("--max-tokens-per-step", "--max-num-batched-tokens", type=int, default=None,
                   help="tokens one step may run (decode, drafts and prefill rows; vLLM's max_num_batched_tokens); "
                        "default: all that fit")
    p.add_argument("--no-prefix-caching", "--no-enable-prefix-caching", action="store_true",
                   help="do not reuse the KV pages of a prompt prefix computed before")
    _add_speculative_flags(p)
    _add_kv_cache_flag(p)
    _add_async_flag(p)
    _add_compilation_cache_flag(p)
    _add_mesh_flags(p)


def _mesh(args: argparse.Namespace):
    """Initialize jax.distributed when asked to, then build the --mesh (None without one)."""
    from jaxinfer.sharding import initialize_distributed, make_mesh

    initialize_distributed(args.coordinator, args.num_processes, args.process_id)
    return None if args.mesh is None else make_mesh(args.mesh)


class _DefaultsHelp(argparse.ArgumentDefaultsHelpFormatter):
    """Shows each option's default, except None (the help says what an unset option means)."""

    def _get_help_string(self, action):
        return action.help if action.default is None else super()._get_help_string(action)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="jaxinfer", description=DESCRIPTION, epilog=EXAMPLES,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate text for one or more prompts (one prompt streams to stdout)",
                         formatter_class=_DefaultsHelp)
    gen.add_argument("prompts", nargs="*", metavar="PROMPT", help="one or more prompts")
    gen.add_argument("--prompts-file", help="a file with one prompt per line (added after PROMPTs)")
    _add_model_flags(gen)
    gen.add_argument("--raw", action="store_true", help="do not apply the chat template")
    gen.add_argument("--system", default=None, help="a system message before each prompt (chat template)")
    gen.add_argument("--max-tokens", type=int, default=256, help="tokens to generate at most per prompt")
    gen.add_argument("--min-tokens", type=int, default=0, help="tokens generated before EOS or a stop may end it")
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    gen.add_argument("--top-k", type=int, default=0, help="0 = off")
    gen.add_argument("--top-p", type=float, default=1.0, help="1 = off")
    gen.add_argument("--min-p", type=float, default=0.0, help="0 = off")
    gen.add_argument("--seed", type=int, default=None,
                     help="seed of the sampling (unset: drawn from the engine's seed 0, so a run repeats)")
    gen.add_argument("--repetition-penalty", type=float, default=1.0,
                     help="> 1 discourages every token already in the prompt or output (1 = off)")
    gen.add_argument("--frequency-penalty", type=float, default=0.0, help="OpenAI's, in [-2, 2] (0 = off)")
    gen.add_argument("--presence-penalty", type=float, default=0.0, help="OpenAI's, in [-2, 2] (0 = off)")
    gen.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    shape = gen.add_mutually_exclusive_group()
    shape.add_argument("--json-schema", metavar="SCHEMA", help="output JSON following this schema (a file, or inline JSON)")
    shape.add_argument("--regex", help="output text matching this regular expression")
    shape.add_argument("--choice", action="append", help="output exactly one of these strings (repeatable)")
    gen.add_argument("--max-model-len", type=int, default=2048, help="longest prompt + output a request may have")
    gen.add_argument("--max-slots", type=int, default=8, help="requests served concurrently")
    _add_attention_flag(gen)
    gen.add_argument("--stats", action="store_true", help="print the engine metrics at the end")
    _add_speculative_flags(gen)
    _add_kv_cache_flag(gen)
    _add_async_flag(gen)
    _add_compilation_cache_flag(gen)
    _add_mesh_flags(gen)

    conv = sub.add_parser("convert", help="save any loadable model as an orbax checkpoint directory")
    conv.add_argument("src", help="any model `generate --model` takes (a .gguf file, an HF directory, a packaged name)")
    conv.add_argument("dst", help="output directory (must not exist)")
    conv.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])

    cal = sub.add_parser("calibrate-kv", help="choose per-layer KV-cache formats (fewest bytes) within an error budget",
                         formatter_class=_DefaultsHelp)
    _add_model_flags(cal)
    cal.add_argument("--out", required=True, help="where to write the plan (JSON; pass it as kv_cache=...)")
    cal.add_argument("--budget-kl", type=float, help="max mean next-token KL (nats) against the full-precision cache")
    cal.add_argument("--budget-out-err", type=float, help="max relative attention-output error per layer and KV head")
    cal.add_argument("--tokens", type=int, default=512, help="calibration tokens of offline English text")
    cal.add_argument("--seq-len", type=int, default=256, help="tokens per calibration sequence")
    cal.add_argument("--page-size", type=int, default=16, help="page size the plan will run at (KIVI groups)")
    cal.add_argument("--formats", default="f32,bf16,int8,fp8_e4m3,fp8_e5m2,int4,int2", help="candidate formats")
    cal.add_argument("--probe", default="int4", help="format whose per-layer KL is measured; 'none' to skip")
    cal.add_argument("--margin", type=float, default=0.8, help="the plan's measured KL must be <= margin * budget")
    cal.add_argument("--held-out-tokens", type=int, default=256,
                     help="tokens of other text the finished plan's KL is also measured on (0: skip)")
    td = sub.add_parser("train-draft", help="train a draft for speculative decoding (self-distillation): a small "
                        "model, or an EAGLE head over the target's features", formatter_class=_DefaultsHelp)
    td.add_argument("--model", help="the target model (see `generate --model`); default: SmolLM2-135M-Instruct")
    td.add_argument("--out", required=True, help="output directory (must not exist or be empty)")
    td.add_argument("--kind", choices=("draft", "eagle"), default="draft",
                    help="'draft': a small model from the target's first layers; 'eagle': a one-layer head over "
                         "the target's features, trained with EAGLE-3's training-time test")
    td.add_argument("--layers", type=int, help="(draft) layers, initialised from the target's first ones (default 2)")
    td.add_argument("--vocab-subset", type=int, default=8192, help="LM head size: the most frequent training tokens")
    td.add_argument("--prompts", type=int, help="built-in instructions the target answers (default: 100 for a "
                    "draft, all 628 of the expanded set for eagle)")
    td.add_argument("--self-prompts", type=int,
                    help="(eagle) more instructions the target writes itself (Magpie: it samples a user's turn from "
                         "its chat template), answered after the built-in ones (default 628); 0 for a model without "
                         "a chat template")
    td.add_argument("--temperatures", type=_float_list,
                    help="(eagle) the target answers every prompt once at each, e.g. 0 or 0,0.8 (default 0)")
    td.add_argument("--new-tokens", type=int, default=192, help="tokens generated per prompt and temperature")
    td.add_argument("--epochs", type=int, help="passes over the training text (default 8)")
    td.add_argument("--lr", type=float, help="peak AdamW learning rate, cosine schedule (default 2e-3)")
    td.add_argument("--ttt-steps", type=int, help="(eagle) head steps unrolled on its own predictions (default 3)")
    td.add_argument("--sequences", help="(eagle) .npz cache of the generated text: read if it exists, else written")
    td.add_argument("--feature-layers", type=_layer_list,
                    help="(eagle) target layers whose outputs the head fuses (EAGLE-3), e.g. 2,15,29; 'auto' (the "
                         "default): a low, the middle and the last layer; 'last': the last layer's alone, unfused")
    td.add_argument("--seed", type=int, default=0)
    srv = sub.add_parser("serve", help="serve the model over an OpenAI-compatible HTTP API",
                         formatter_class=_DefaultsHelp)
    srv.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every interface)")
    srv.add_argument("--port", type=int, default=8000, help="port to listen on")
    srv.add_argument("--api-key", default=None,
                     help="require 'Authorization: Bearer KEY' on every endpoint but /health and /metrics")
    srv.add_argument("--allowed-origins", nargs="+", default=["*"], metavar="ORIGIN",
                     help="web pages (CORS origins, e.g. http://localhost:3000) whose scripts may call the API")
    srv.add_argument("--grace-period", type=float, default=30.0, help="seconds in-flight requests get on SIGTERM")
    _add_serving_flags(srv)
    batch = sub.add_parser("run-batch", help="answer a file of OpenAI batch requests (JSONL) offline, as the server "
                                             "would", formatter_class=_DefaultsHelp)
    batch.add_argument("-i", "--input-file", required=True,
                       help="JSONL, a request per line: {custom_id, method: POST, url: /v1/chat/completions | "
                            "/v1/completions | /v1/responses, body}; '-' reads stdin")
    batch.add_argument("-o", "--output-file", required=True,
                       help="JSONL, an answer per line in input order: {id, custom_id, response: {status_code, "
                            "request_id, body}, error}; '-' writes stdout")
    _add_serving_flags(batch)
    return parser


def _load(model: str | None, dtype: str, mesh=None, chat_template: str | None = None):
    """Load `model`; `chat_template` (the `--chat-template` flag's value) replaces its template."""
    from jaxinfer.chat_template import read_chat_template
    from jaxinfer.loading import load_model
    from jaxinfer.sharding import load_sharded

    if chat_template is not None:
        read_chat_template(chat_template)  # checked before loading
    t0 = time.perf_counter()
    print(f"loading {model or 'the default model'} ...", file=sys.stderr, flush=True)
    loaded = load_model(model, dtype=dtype) if mesh is None else load_sharded(model, mesh, dtype=dtype)
    print(f"loaded {loaded.source} in {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)
    if chat_template is not None:
        if loaded.tokenizer is None:
            raise ValueError("--chat-template needs the model's tokenizer, and this model has none")
        loaded = dataclasses.replace(loaded, tokenizer=loaded.tokenizer.with_chat_template(chat_template))
    return loaded


def _structured(args: argparse.Namespace):
    """--json-schema / --regex / --choice as `StructuredOutputsParams` (checked before the model
    loads), or None."""
    from jaxinfer.structured_output import StructuredOutputsParams

    if args.json_schema is not None:
        text = args.json_schema
        if not text.lstrip().startswith("{"):
            with open(text, encoding="utf-8") as f:
                text = f.read()
        params = StructuredOutputsParams(json=text)
    elif args.regex is not None:
        params = StructuredOutputsParams(regex=args.regex)
    elif args.choice:
        params = StructuredOutputsParams(choice=args.choice)
    else:
        return None
    params.grammar_text()
    return params


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
    from jaxinfer.speculative.config import SpeculativeStats

    params = SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                            min_p=args.min_p, seed=args.seed, max_tokens=args.max_tokens,
                            min_tokens=args.min_tokens, stop=tuple(args.stop),
                            repetition_penalty=args.repetition_penalty, frequency_penalty=args.frequency_penalty,
                            presence_penalty=args.presence_penalty, structured_outputs=_structured(args))
    prompts = _read_prompts(args)
    if args.system is not None and args.raw:
        raise ValueError("--system is a chat message; --raw prompts skip the chat template")
    mesh = _mesh(args)
    config = EngineConfig(max_slots=args.max_slots, max_model_len=args.max_model_len, mesh=mesh,  # checked before loading
                          attention_impl=args.attention_impl, speculative=_speculative(args), kv_cache=args.kv_cache,
                          async_scheduling=args.async_scheduling, compilation_cache=not args.no_compilation_cache)
    model = _load(args.model, args.dtype, mesh, args.chat_template)
    chat = not args.raw and model.tokenizer is not None and model.tokenizer.chat_template is not None
    if not args.raw and not chat and model.tokenizer is not None:
        print("note: this model has no chat template, so prompts go in as raw text (as with --raw)", file=sys.stderr)
    if args.system is not None:
        if not chat:
            raise ValueError("--system needs a chat template, and this model has none")
        # conversations: the engine renders them with the chat template
        prompts = [[{"role": "system", "content": args.system}, {"role": "user", "content": p}] for p in prompts]
    engine = Engine(model, _fit_context(config, model))
    if engine.is_follower:  # a mesh over several processes: process 0 schedules and prints
        engine.follow()
        return
    start = time.perf_counter()
    try:
        if len(prompts) == 1:
            for piece in engine.stream(prompts[0], params, chat=chat):
                sys.stdout.write(piece)
                sys.stdout.flush()
            sys.stdout.write("\n")
        else:
            outputs = engine.generate(prompts, params, chat=chat, progress=True)
            for i, out in enumerate(outputs):
                shown = prompts[i] if isinstance(prompts[i], str) else prompts[i][-1]["content"]
                print(f"=== [{i}] {shown!r} ({out.finish_reason})\n{out.text}")
    finally:
        engine.close()
    _report_speed(engine, time.perf_counter() - start)
    if args.stats:
        metrics = engine.metrics()
        for field in dataclasses.fields(metrics):
            value = getattr(metrics, field.name)
            print(f"{field.name}: {value.summary() if isinstance(value, SpeculativeStats) else value}", file=sys.stderr)


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
          f"decode: {decode_tokens} tokens, {decode_tokens / max(decode_time, 1e-9):.1f} tok/s (includes compiling "
          f"programs first needed then; the compilation cache spares the next run); wall {wall:.1f} s", file=sys.stderr)
    spec = engine.metrics().speculative
    if spec is not None and spec.target_calls:
        print(f"speculation: {spec.tokens_per_call:.2f} tokens per target call, {spec.acceptance_rate:.2f} of drafts "
              f"accepted (--stats: per position)", file=sys.stderr)


def cmd_convert(args: argparse.Namespace) -> None:
    from jaxinfer.checkpoint import save_orbax

    dst = Path(args.dst)
    if dst.exists():
        raise ValueError(f"destination {dst} already exists")
    from jaxinfer.loading import write_sampling_defaults

    model = _load(args.src, args.dtype)
    save_orbax(model.config, model.params, dst, tokenizer=model.tokenizer)
    write_sampling_defaults(dst, model.generation_config)  # they travel with the checkpoint
    print(f"wrote {dst}", file=sys.stderr)


def cmd_calibrate_kv(args: argparse.Namespace) -> None:
    from jaxinfer.calibration import calibrate_plan, evaluate_kv_cache, text_tokens
    from jaxinfer.calibration.planner import check_budgets
    from jaxinfer.kv.formats import get_format

    formats = tuple(get_format(f.strip()).name for f in args.formats.split(",") if f.strip())
    if args.probe != "none":
        get_format(args.probe)
    if args.budget_kl is None and args.budget_out_err is None:
        raise ValueError("give --budget-kl and/or --budget-out-err")
    check_budgets(args.budget_kl, args.budget_out_err, args.margin)  # before loading and calibrating
    if args.held_out_tokens < 0:
        raise ValueError(f"--held-out-tokens={args.held_out_tokens} must be >= 0")
    model = _load(args.model, args.dtype, chat_template=args.chat_template)
    plan, calib = calibrate_plan(model, args.budget_kl, args.budget_out_err, args.tokens, args.seq_len, args.page_size,
                                 formats, None if args.probe == "none" else args.probe, args.margin,
                                 log=lambda msg: print(msg, file=sys.stderr, flush=True))
    plan.save(args.out)
    c = model.config
    bf16 = c.n_layers * 2 * c.n_kv_heads * c.head_dim * 2
    size = plan.bytes_per_token(c.n_kv_heads, c.head_dim, args.page_size)
    print(f"plan: {' '.join(plan.formats)}\n{size:.0f} bytes/token ({size / bf16:.3f} of a bf16 cache), "
          f"calibration KL {plan.calibration_kl:.5f}; wrote {args.out}", file=sys.stderr)
    if args.held_out_tokens:  # text the plan was not fitted to (the calibration reads the start of the same text)
        held_out = text_tokens(model.tokenizer, 1, args.held_out_tokens, start=60_000)
        kl = evaluate_kv_cache(model.params, c, held_out, plan, args.page_size)["kl"]
        over = args.budget_kl is not None and kl > args.budget_kl
        print(f"held-out KL {kl:.5f} on {args.held_out_tokens} other tokens" +
              (f": OVER the budget {args.budget_kl:g}; calibrate on more --tokens or lower --margin" if over else ""),
              file=sys.stderr)


def cmd_serve(args: argparse.Namespace) -> None:
    from jaxinfer.server import serve

    _check_port_free(args.host, args.port)  # before minutes of loading and compiling
    server = _server(args, warmup=True)
    if server is not None:
        serve(server, args.host, args.port, grace_s=args.grace_period)


def _check_port_free(host: str, port: int) -> None:
    """ValueError when another socket already listens on host:port."""
    import socket

    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds: TIME_WAIT is no obstacle
            probe.bind((host, port))
    except OSError as e:
        raise ValueError(f"cannot serve on {host}:{port}: {e.strerror or e} (is another server listening there? "
                         "pick another --port)") from None


def cmd_run_batch(args: argparse.Namespace) -> None:
    from jaxinfer.server.batch import run_batch

    if args.input_file == "-":
        lines = sys.stdin.read().splitlines()
    else:
        lines = Path(args.input_file).read_text().splitlines()  # a missing file: refused before loading
    server = _server(args, warmup=False)  # programs compile as the requests need them
    if server is None:  # a multi-host job's follower: it ran process 0's steps
        return
    t0 = time.perf_counter()
    records = run_batch(server, lines)
    text = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records)
    if args.output_file == "-":
        sys.stdout.write(text)
    else:
        Path(args.output_file).write_text(text)
    answered = sum(r["response"] is not None and r["response"]["status_code"] == 200 for r in records)
    print(f"{len(records)} requests in {time.perf_counter() - t0:.1f} s: {answered} answered, "
          f"{len(records) - answered} refused or invalid (their errors are in the output)", file=sys.stderr)


def _server(args: argparse.Namespace, warmup: bool):
    """The `OpenAIServer` the serving flags describe; None in a multi-host job's followers
    (processes but 0), which run process 0's engine steps here and return when it stops."""
    import jax

    from jaxinfer.engine import Engine, EngineConfig
    from jaxinfer.engine.multihost import spans_processes
    from jaxinfer.server import build_server
    from jaxinfer.server.tools import call_parser

    call_parser(args.tool_call_parser)  # a bad name is refused before the model loads
    if args.enable_auto_tool_choice and args.tool_call_parser is None:
        raise ValueError("--enable-auto-tool-choice needs --tool-call-parser (hermes, llama3_json)")
    mesh = _mesh(args)
    config = EngineConfig(max_slots=args.max_slots, page_size=args.page_size, num_pages=args.num_pages,
                          prefill_chunk=args.prefill_chunk, max_prefill_rows=args.max_prefill_rows,
                          max_tokens_per_step=args.max_tokens_per_step,
                          enable_prefix_caching=not args.no_prefix_caching,
                          max_model_len=args.max_model_len, attention_impl=args.attention_impl,
                          speculative=_speculative(args), async_scheduling=args.async_scheduling,
                          kv_cache=args.kv_cache, compilation_cache=not args.no_compilation_cache,
                          mesh=mesh)  # checked before loading
    model = _load(args.model, args.dtype, mesh, args.chat_template)
    config = _fit_context(config, model)
    if spans_processes(mesh) and jax.process_index() != 0:  # process 0 schedules and serves HTTP; here: follow it
        print(f"process {jax.process_index()}: following process 0's engine", file=sys.stderr, flush=True)
        Engine(model, config).follow()
        return None
    name = args.served_model_name or [args.model or "default"]
    if warmup:
        print("compiling in the background: /health answers 503 until ready", file=sys.stderr, flush=True)
    return build_server(model, config, name, api_key=getattr(args, "api_key", None), max_queue=args.max_queue,
                        warmup=warmup, tool_call_parser=args.tool_call_parser,
                        allowed_origins=getattr(args, "allowed_origins", ("*",)),
                        reasoning_parser=args.reasoning_parser, generation_config=args.generation_config)


def _layer_list(text: str) -> tuple[int, ...] | str:
    """'2,15,29' -> (2, 15, 29); 'last' -> (); 'auto' as is (`--feature-layers`)."""
    if text.strip() in ("last", "auto"):
        return () if text.strip() == "last" else "auto"
    try:
        return tuple(int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of layer indices, 'auto' or 'last'") from None


def _float_list(text: str) -> tuple[float, ...]:
    """'0,0.8' -> (0.0, 0.8) (`--temperatures`)."""
    try:
        return tuple(float(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of numbers") from None


def cmd_train_draft(args: argparse.Namespace) -> None:
    import os

    if os.path.isdir(args.out) and os.listdir(args.out):
        raise ValueError(f"--out {args.out} is not empty")
    log = lambda msg: print(msg, file=sys.stderr, flush=True)  # noqa: E731
    # the config first: a bad option is refused before the model loads
    given = {name: value for name, value in (("num_prompts", args.prompts), ("epochs", args.epochs), ("lr", args.lr))
             if value is not None}
    own = {"eagle": ("self_prompts", "temperatures", "ttt_steps", "sequences", "feature_layers"), "draft": ("layers",)}
    other = "draft" if args.kind == "eagle" else "eagle"
    misplaced = ["--" + name.replace("_", "-") for name in own[other] if getattr(args, name) is not None]
    if misplaced:
        raise ValueError(f"{', '.join(misplaced)} only apply to --kind {other} (this is --kind {args.kind})")
    # --sequences is train_eagle's argument, not a config field
    given.update({name: getattr(args, name) for name in own[args.kind]
                  if name != "sequences" and getattr(args, name) is not None})
    if args.kind == "eagle":
        from jaxinfer.speculative.eagle import save_eagle_head
        from jaxinfer.speculative.train.eagle import EagleTrainingConfig, train_eagle

        cfg = EagleTrainingConfig(vocab_subset=args.vocab_subset, new_tokens=args.new_tokens, seed=args.seed, **given)
        model = _load(args.model, "float32")
        params, vocab_ids, figures = train_eagle(model, cfg, sequences_file=args.sequences, log=log)
        save_eagle_head(params, vocab_ids, model, args.out, figures)
        print(f"held-out agreement per draft position {figures['init_held_out_agreement']} (untrained) -> "
              f"{figures['final_held_out_agreement']}; wrote {args.out}", file=sys.stderr)
        return
    from jaxinfer.speculative.checkpoint import save_trained_draft
    from jaxinfer.speculative.train import DraftTrainingConfig, train_draft

    cfg = DraftTrainingConfig(n_layers=given.pop("layers", DraftTrainingConfig.n_layers), vocab_subset=args.vocab_subset,
                              new_tokens=args.new_tokens, seed=args.seed, **given)
    model = _load(args.model, "float32")
    draft, figures = train_draft(model, cfg, log=log)
    save_trained_draft(draft, model, args.out, figures)
    print(f"held-out greedy top-1 agreement {figures['init_held_out_top1']:.4f} (untrained) -> "
          f"{figures['final_held_out_top1']:.4f}; wrote {args.out}", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from jaxinfer.checkpoint import CheckpointError
    from jaxinfer.default_model import ModelFetchError

    try:
        {"generate": cmd_generate, "convert": cmd_convert, "calibrate-kv": cmd_calibrate_kv, "serve": cmd_serve,
         "run-batch": cmd_run_batch, "train-draft": cmd_train_draft}[args.command](args)
    except (ValueError, OSError, CheckpointError, ModelFetchError) as e:
        print(f"jaxinfer: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
