"""The command line, run as a user would: in a subprocess (most bad input also in process, which
saves the interpreter start)."""

from __future__ import annotations

import ast
import json
import os
import re
import subprocess
import sys

import pytest


def jaxinfer(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, "-m", "jaxinfer", *args], capture_output=True, text=True,
                          timeout=600, env=os.environ | {"JAX_PLATFORMS": "cpu"})
    if check and proc.returncode != 0:
        raise AssertionError(f"exit {proc.returncode}\nstdout: {proc.stdout}\nstderr: {proc.stderr}")
    return proc


def test_help_lists_the_commands():
    out = jaxinfer("--help").stdout
    assert "generate" in out and "convert" in out and "SmolLM2" in out
    gen_help = jaxinfer("generate", "--help").stdout
    for flag in ("--model", "--max-tokens", "--temperature", "--top-k", "--top-p", "--min-p", "--seed", "--stop", "--raw",
                 "--repetition-penalty", "--frequency-penalty", "--presence-penalty"):
        assert flag in gen_help


@pytest.mark.slow
def test_generate_and_convert_round_trip(smollm2_gguf, tmp_path):
    """Greedy text from the GGUF equals greedy text from its orbax conversion (there with n-gram
    speculation, which never changes greedy text); a repetition penalty changes it."""
    args = ["--max-tokens", "12", "What is 2 + 2?"]
    from_gguf = jaxinfer("generate", "--model", str(smollm2_gguf), *args)
    assert from_gguf.stdout.strip()
    assert "decode:" in from_gguf.stderr and "tok/s" in from_gguf.stderr

    dst = tmp_path / "orbax"
    jaxinfer("convert", str(smollm2_gguf), str(dst))
    speculative = jaxinfer("generate", "--model", str(dst), "--speculative", "ngram", "--num-speculative", "3", "--stats",
                           *args)
    assert speculative.stdout == from_gguf.stdout
    stats = ast.literal_eval(re.search(r"^speculative: (\{.*\})$", speculative.stderr, re.M).group(1))
    assert stats["tokens_per_call"] == round(stats["emitted"] / stats["target_calls"], 4)
    assert stats["emitted"] >= stats["target_calls"] > 0 and sum(stats["drafted"]) > 0  # the prompt has repeats
    assert len(stats["acceptance_per_position"]) == 3
    line = re.search(r"^speculation: ([\d.]+) tokens per target call, ([\d.]+) of drafts accepted", speculative.stderr, re.M)
    assert float(line.group(1)) == pytest.approx(stats["tokens_per_call"], abs=0.01)
    assert float(line.group(2)) == pytest.approx(stats["acceptance_rate"], abs=0.01)
    penalized = jaxinfer("generate", "--model", str(dst), "--repetition-penalty", "2", *args)
    assert penalized.stdout.strip() and penalized.stdout != from_gguf.stdout


@pytest.mark.slow
def test_run_batch_answers_a_file_as_generate_does(smollm2_gguf, tmp_path):
    """`jaxinfer run-batch`: an OpenAI batch file in, an answer per line out (stdout with
    `-o -`), a completion's greedy text equal to `generate --raw`'s; a bad line is an error
    record, not a failed run; a missing input file is refused before the model loads."""
    body = {"model": "default", "prompt": "Once upon a time", "max_tokens": 8, "temperature": 0}
    lines = [{"custom_id": "story", "method": "POST", "url": "/v1/completions", "body": body},
             {"custom_id": "chat", "method": "POST", "url": "/v1/chat/completions",
              "body": {"model": "default", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}}]
    (tmp_path / "in.jsonl").write_text("\n".join(map(json.dumps, lines)) + "\nnot a request\n")
    run = jaxinfer("run-batch", "--model", str(smollm2_gguf), "-i", str(tmp_path / "in.jsonl"), "-o", "-",
                   "--max-model-len", "256", "--served-model-name", "default")
    records = [json.loads(line) for line in run.stdout.splitlines()]
    assert [r["custom_id"] for r in records] == ["story", "chat", None]
    generated = jaxinfer("generate", "--model", str(smollm2_gguf), "--raw", "--temperature", "0", "--max-tokens", "8",
                         "--max-model-len", "256", "Once upon a time").stdout
    assert records[0]["response"]["body"]["choices"][0]["text"] == generated.rstrip("\n")
    assert records[1]["response"]["status_code"] == 200 and records[2]["error"]["line"] == 3
    assert "3 requests" in run.stderr and "2 answered" in run.stderr
    missing = jaxinfer("run-batch", "-i", str(tmp_path / "nowhere.jsonl"), "-o", "-", check=False)
    assert missing.returncode == 2 and "nowhere.jsonl" in missing.stderr and "loading" not in missing.stderr


def run_main(capsys, *args: str) -> tuple[int, str]:
    """`jaxinfer ARGS` in this process: (exit status, stderr)."""
    from jaxinfer.cli import main

    try:
        status = main(list(args))
    except SystemExit as e:  # argparse's own errors
        status = e.code
    return status, capsys.readouterr().err


def test_bad_input_exits_with_a_clear_message(tmp_path, capsys):
    missing = jaxinfer("generate", "--model", str(tmp_path / "nope.gguf"), "hi", check=False)  # one real process
    assert missing.returncode == 2 and "nope.gguf" in missing.stderr and "Traceback" not in missing.stderr
    for args, named in [(("--temperature", "-1"), "temperature"), (("--speculative", "medusa"), "--speculative 'medusa'"),
                        (("--frequency-penalty", "3"), "frequency_penalty"),
                        (("--max-tokens", "10", "--min-tokens", "11"), "min_tokens"),
                        (("--regex", "[a-z"), "structured_outputs.regex"),
                        (("--json-schema", str(tmp_path / "schema.json")), "schema.json"),
                        (("--async-scheduling", "--speculative", "ngram"), "async_scheduling"),
                        (("--speculative-disable-by-batch-size", "2"), "needs --speculative"),
                        (("--num-speculative-tokens", "4"), "--num-speculative-tokens needs --speculative"),
                        (("--speculative-config", "{bad"), "--speculative-config is not valid JSON"),
                        (("--speculative-config", '{"method": "medusa"}'), "method='medusa'"),
                        (("--speculative-config", '{"method": "ngram"}', "--speculative", "ngram"), "holds the whole config"),
                        (("--raw", "--system", "Be brief."), "--system"),
                        (("--kv-cache", "int3"), "kv_cache='int3'"),
                        (("--kv-cache", str(tmp_path / "plan.json")), "plan.json"),
                        (("--speculative", "eagle", "--speculative-disable-by-batch-size", "2"),
                         "disable_by_batch_size works with 'ngram' and 'self'"),
                        (("--chat-template", str(tmp_path / "none.jinja")), "neither a file nor a jinja template"),
                        (("--chat-template", "{% for m in messages %}"), "chat template has a syntax error")]:
        status, err = run_main(capsys, "generate", *args, "hi")
        assert status == 2 and named in err and "Traceback" not in err, (args, err)
    for args, named in [(("--feature-layers", "2,x"), "comma-separated"), (("--feature-layers", "2,2"), "feature_layers"),
                        (("--feature-layers", "7,99"), "feature_layers"), (("--temperatures", "0,x"), "comma-separated"),
                        (("--temperatures", "3"), "temperatures"), (("--self-prompts", "-2"), "self_prompts")]:
        status, err = run_main(capsys, "train-draft", "--kind", "eagle", "--out", str(tmp_path / "head"), *args)
        assert status == 2 and named in err and "Traceback" not in err, (args, err)
    for args, named in [(("--tool-call-parser", "mistral"), "tool_call_parser='mistral': the parsers are hermes, llama3_json"),
                        (("--enable-auto-tool-choice",), "needs --tool-call-parser"),
                        (("--max-prefill-rows", "0"), "max_prefill_rows=0"),
                        (("--max-num-batched-tokens", "0"), "max_tokens_per_step=0"),
                        (("--kv-cache", "int3"), "kv_cache='int3'")]:
        status, err = run_main(capsys, "serve", *args)  # refused before the model loads
        assert status == 2 and named in err and "Traceback" not in err, (args, err)
    # an option of the other kind is refused, not silently ignored
    for kind, args, named in [("draft", ("--self-prompts", "10", "--ttt-steps", "2"), "--self-prompts, --ttt-steps only apply to --kind eagle"),
                              ("draft", ("--feature-layers", "last"), "--feature-layers only apply to --kind eagle"),
                              ("eagle", ("--layers", "3"), "--layers only apply to --kind draft")]:
        status, err = run_main(capsys, "train-draft", "--kind", kind, "--out", str(tmp_path / "d"), *args)
        assert status == 2 and named in err and "Traceback" not in err, (kind, args, err)


def test_serve_refuses_a_port_in_use_before_loading(capsys):
    """A port another server listens on is refused at once, naming it (not after the model has
    loaded and the programs compiled)."""
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        status, err = run_main(capsys, "serve", "--port", str(port), "--model", "/nonexistent/model.gguf")
    assert status == 2 and f"cannot serve on 127.0.0.1:{port}" in err and "Traceback" not in err, err


def test_serve_takes_vllms_flag_names():
    """vLLM's names for the same settings, so a vLLM command line works as it is."""
    from jaxinfer.cli import build_parser

    args = build_parser().parse_args(["serve", "--max-num-seqs", "3", "--block-size", "32", "--no-enable-prefix-caching",
                                      "--speculative", "ngram", "--num-speculative-tokens", "2"])
    assert (args.max_slots, args.page_size, args.no_prefix_caching, args.num_speculative) == (3, 32, True, 2)
    args = build_parser().parse_args(["serve", "--max-num-batched-tokens", "256", "--max-prefill-rows", "2"])
    assert (args.max_tokens_per_step, args.max_prefill_rows) == (256, 2)


def test_chat_template_flag_replaces_the_models_template(smollm2_gguf, tmp_path):
    """`--chat-template` (vLLM's flag) takes the template itself, a .jinja file or a JSON file
    with a `chat_template`; chats render with it instead of the model's."""
    from jaxinfer.cli import _load

    template = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}[assistant]"
    (tmp_path / "t.jinja").write_text(template)
    (tmp_path / "t.json").write_text(json.dumps({"chat_template": template}))
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    own = _load(str(smollm2_gguf), "float32").tokenizer
    assert "<|im_start|>" in own.apply_chat_template(chat)
    assert own.with_chat_template(template).apply_chat_template(chat) != own.apply_chat_template(chat)  # a copy
    assert own.with_chat_template(str(tmp_path / "t.jinja")).chat_template == template  # a file, as the flag takes
    with pytest.raises(ValueError, match="syntax error"):
        own.with_chat_template("{% if %}")
    for value in (template, str(tmp_path / "t.jinja"), str(tmp_path / "t.json")):
        model = _load(str(smollm2_gguf), "float32", chat_template=value)
        assert model.tokenizer.apply_chat_template(chat) == "[system] Be brief.\n[user] Hi\n[assistant]"


@pytest.mark.slow
def test_several_prompts_go_through_the_engine_with_stats(smollm2_gguf, tmp_path):
    prompts_file = tmp_path / "prompts.txt"
    prompts_file.write_text("Name a fruit.\n\nName a colour.\n")
    out = jaxinfer("generate", "--model", str(smollm2_gguf), "--max-tokens", "6", "--stats", "--choice", "red",
                   "--choice", "a cat", "Name an animal.", "--prompts-file", str(prompts_file))
    assert out.stdout.count("=== [") == 3 and "'Name a colour.'" in out.stdout
    answers = re.findall(r"=== \[\d\] '.*' \((\w+)\)\n(.*)\n", out.stdout)  # (finish reason, text) per prompt
    assert len(answers) == 3 and all(reason == "stop" and text in ("red", "a cat") for reason, text in answers)
    for metric in ("running: 0", "waiting: 0", "prefix_hit_rate", "preemptions: 0", "compiled_programs"):
        assert metric in out.stderr
    empty = jaxinfer("generate", "--prompts-file", str(tmp_path / "missing.txt"), check=False)
    assert empty.returncode == 2 and "missing.txt" in empty.stderr
