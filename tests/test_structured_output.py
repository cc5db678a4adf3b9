"""Structured output (JSON schema, JSON object, regex, choice, Lark / GBNF grammar): the device
mask against llguidance's numpy reference, engine outputs against a reference decoding loop
(dense forward, llguidance's mask applied on the host, the engine's sampling keys), the same
tokens asynchronously and with speculative decoding, and clear errors."""

from __future__ import annotations

import dataclasses
import json
import re

import jax
import jax.numpy as jnp
import jsonschema
import llguidance
import llguidance.numpy
import numpy as np
import pytest

from jaxinfer.engine import Engine, EngineConfig, SpeculativeConfig
from jaxinfer.loading import Model
from jaxinfer.sampling import SamplingArrays, SamplingParams
from jaxinfer.structured_output import StructuredOutputsParams, bitmask_words, mask_logits
from test_engine_text import model  # noqa: F401 - a tiny random model speaking SmolLM2's vocabulary
from test_penalties import last_logits, sample
from test_speculative_engine import chi_square_p

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}
REGEX = r"[0-9]{3}-[a-z]{2,4}"
CHOICES = ["yes", "no", "maybe so"]
LARK = 'start: "(" num ("+" num)* ")"\nnum: /[0-9]{1,2}/'
GBNF = 'root ::= "[" item ("," item)* "]"\nitem ::= [a-c]'
CASES = {
    "json": StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True),
    "json_object": StructuredOutputsParams(json_object=True, disable_any_whitespace=True),
    "regex": StructuredOutputsParams(regex=REGEX),
    "choice": StructuredOutputsParams(choice=CHOICES),
    "lark": StructuredOutputsParams(grammar=LARK),
    "gbnf": StructuredOutputsParams(grammar=GBNF),
}
PROMPTS = ["Reply in JSON:", "Any object", "A code:", "Answer", "Sum", "List"]


def engine(model: Model, **changes) -> Engine:
    return Engine(model, EngineConfig(**(dict(max_slots=3, page_size=8, prefill_chunk=16, max_model_len=128) | changes)))


def params(structured: StructuredOutputsParams | None, i: int, temperature: float = 0.9) -> SamplingParams:
    return SamplingParams(temperature=temperature, seed=100 + i, max_tokens=24, structured_outputs=structured)


def llg_tokenizer(model: Model):
    return llguidance.LLTokenizer(model.tokenizer.backend.to_str(), n_vocab=model.config.vocab_size,
                                  eos_token=list(model.config.eos_ids))


def reference_decode(model: Model, lltok, prompt: list[int], p: SamplingParams, seed: int) -> list[int]:
    """A dense forward per token; llguidance's own numpy mask on the host; the engine's
    sampling key (seed, position); until EOS, the grammar's end or max_tokens."""
    matcher = llguidance.LLMatcher(lltok, p.structured_outputs.grammar_text())
    mask = llguidance.numpy.allocate_token_bitmask(1, model.config.vocab_size)
    out: list[int] = []
    while len(out) < p.max_tokens and not matcher.is_stopped() and not set(model.config.eos_ids) & set(out[-1:]):
        logits = last_logits(model, prompt + out)[None].copy()
        llguidance.numpy.fill_next_token_bitmask(matcher, mask)
        llguidance.numpy.apply_token_bitmask_inplace(logits, mask)
        token = int(sample(jnp.asarray(logits), SamplingArrays.from_params([p], [seed]),
                           jnp.asarray([len(prompt) + len(out)]))[0])
        assert matcher.consume_token(token)
        out.append(token)
    return out


def check_follows(kind: str, text: str, finished_by_grammar: bool) -> None:
    """A finished output matches its grammar exactly."""
    if not finished_by_grammar:
        return
    if kind == "json":
        jsonschema.validate(json.loads(text), SCHEMA)
    elif kind == "json_object":
        assert isinstance(json.loads(text), dict)
    elif kind == "regex":
        assert re.fullmatch(REGEX, text)
    elif kind == "choice":
        assert text in CHOICES
    elif kind == "lark":
        assert re.fullmatch(r"\(\d{1,2}(\+\d{1,2})*\)", text)
    else:
        assert re.fullmatch(r"\[[a-c](,[a-c])*\]", text)


@pytest.mark.parametrize("vocab", [45, 96, 1000])
def test_mask_logits_matches_llguidance_numpy(vocab):
    rng = np.random.default_rng(vocab)
    logits = rng.normal(size=(3, vocab)).astype(np.float32)
    allowed = rng.integers(-(2**31), 2**31, size=(3, bitmask_words(vocab)), dtype=np.int64).astype(np.int32)
    want = logits.copy()
    llguidance.numpy.apply_token_bitmask_inplace(want, allowed)
    got = np.asarray(jax.jit(mask_logits)(jnp.asarray(logits), jnp.asarray(allowed)))
    np.testing.assert_array_equal(got, want)
    assert np.isinf(got).any() and np.isfinite(got).any()


def test_outputs_follow_their_grammar_and_equal_the_reference(model):
    """Six constrained requests (sampled, seeded) beside a plain one on a 3-slot engine: each
    equals the reference loop token for token, each finished output matches its grammar, and
    the plain request's tokens are those of an engine that never saw a grammar."""
    lltok = llg_tokenizer(model)
    eng = engine(model)
    cases = list(CASES.items())
    prompts = [model.tokenizer.encode(p) for p in PROMPTS] + [model.tokenizer.encode("plain")]
    ps = [params(s, i) for i, (_, s) in enumerate(cases)] + [params(None, 9)]
    outs = eng.generate(prompts, ps)
    for (kind, _), prompt, p, out in zip(cases, prompts, ps, outs):
        assert out.token_ids == reference_decode(model, lltok, prompt, p, p.seed), kind
        check_follows(kind, out.text, out.finish_reason == "stop")
    assert sum(o.finish_reason == "stop" for o in outs[:-1]) >= 4  # most grammars ended within 24 tokens
    assert outs[-1].token_ids == engine(model).generate(prompts[-1:], ps[-1:])[0].token_ids


def test_grammar_end_stops_the_request_and_steady_state_compiles_nothing(model):
    """A choice ends the request the moment it is complete ("stop", no EOS sampled), and a
    second identical batch compiles no program."""
    eng = engine(model)
    batch = [SamplingParams(temperature=0, max_tokens=16, structured_outputs=StructuredOutputsParams(choice=CHOICES))] * 2
    first = eng.generate(["Is it?", "Really?"], batch)
    compiled = eng.metrics().obtained_programs
    again = eng.generate(["Is it?", "Really?"], batch)
    assert [o.text for o in again] == [o.text for o in first]
    assert all(o.text in CHOICES and o.finish_reason == "stop" for o in first)
    assert not set(first[0].token_ids) & set(model.config.eos_ids)
    assert eng.metrics().obtained_programs == compiled


def run_joining_late(eng: Engine, model: Model) -> list[list[int]]:
    """A plain request runs two steps, then three constrained ones join (all greedy: speculative
    sampling keeps the distribution, not the draws): everyone's tokens."""
    first = eng.add_request("plain " * 6, params(None, 0, temperature=0))
    outputs = {}
    for _ in range(2):
        outputs.update({o.request_id: o for o in eng.step() if o.finished})
    ids = [first] + [eng.add_request(p, params(CASES[kind], i, temperature=0))
                     for i, (p, kind) in enumerate([("Reply:", "json"), ("Code", "regex"), ("Answer", "choice")], 1)]
    while eng.has_unfinished_requests():
        outputs.update({o.request_id: o for o in eng.step() if o.finished})
    return [outputs[i].token_ids for i in ids]


@pytest.mark.parametrize("setting", ["async", pytest.param("draft", marks=pytest.mark.extended)])
def test_asynchronous_and_speculative_engines_give_the_same_tokens(model, setting):
    """Asynchronous scheduling reads the step in flight before a grammar's first mask; a
    speculating engine (here the target drafting for itself, so drafts are accepted) verifies
    no drafts for constrained rows, and drafts for the plain one."""
    from jaxinfer.speculative import DraftModel

    changes = {"async": dict(async_scheduling=True),
               "draft": dict(speculative=SpeculativeConfig("draft", 3, draft=DraftModel(model.config, model.params)))}
    want = run_joining_late(engine(model), model)
    assert run_joining_late(engine(model, **changes[setting]), model) == want


REPEATS = StructuredOutputsParams(regex="(red ){6}")  # output that copies itself: n-gram drafts find it


def test_draft_masks_are_the_grammar_after_each_draft_and_move_nothing(model):
    """`GrammarMatcher.draft_masks`: row j is the mask after drafts[: j + 1] (a matcher fed
    token by token), cut before the first token the grammar refuses, every token allowed
    after the one completing it; the matcher stays where it was."""
    from jaxinfer.structured_output import GrammarCompiler

    compiler = GrammarCompiler(model.tokenizer, model.config.vocab_size, model.config.eos_ids)
    ids = model.tokenizer.encode("red red red red red red ", add_special_tokens=False)
    matcher, step_by_step = compiler.matcher(REPEATS), compiler.matcher(REPEATS)
    start = matcher.allowed().copy()
    masks = matcher.draft_masks(ids[:4] + model.tokenizer.encode("blue", add_special_tokens=False))
    want = []
    for token in ids[:4]:
        step_by_step.consume(token)
        want.append(step_by_step.allowed().copy())
    np.testing.assert_array_equal(masks, np.stack(want))  # cut at "blue"
    np.testing.assert_array_equal(matcher.allowed(), start)
    whole = matcher.draft_masks(ids + ids)
    assert len(whole) == len(ids) and (whole[-1] == -1).all()  # the grammar ends with the last "red "
    for token in ids:  # untouched: the request's own tokens still go through
        matcher.consume(token)
    assert matcher.done and len(matcher.draft_masks(ids)) == 0


def test_ngram_speculation_drafts_for_constrained_rows_and_keeps_greedy_tokens(model):
    """Constrained rows verify n-gram drafts (masked at every position): greedy tokens equal
    a plain engine's, for them and for a plain request beside them, and drafts were accepted."""
    prompts = ["red red red", "Reply:", "plain text"]
    ps = [SamplingParams(temperature=0, max_tokens=24, structured_outputs=s) for s in (REPEATS, CASES["json"], None)]
    want = [o.token_ids for o in engine(model).generate(prompts, ps)]
    eng = engine(model, speculative=SpeculativeConfig("ngram", 3))
    assert [o.token_ids for o in eng.generate(prompts, ps)] == want
    stats = eng.metrics().speculative
    assert stats.accepted[0] > 0, stats


# none a prefix of another; three words, so a verify block can hold two drafts inside the grammar
COLOURS = StructuredOutputsParams(choice=["red blue red", "blue red red", "red red blue"])
COLOUR_PROMPT = "red blue red red blue red red blue"  # n-gram drafts find the words here


def exact_constrained(model: Model, prompt: list[int], structured: StructuredOutputsParams) -> dict[tuple, float]:
    """Every token sequence the grammar can end with and its probability under the masked
    model at temperature 1 (dense forwards down the tree of allowed tokens)."""
    lltok = llg_tokenizer(model)
    mask = llguidance.numpy.allocate_token_bitmask(1, model.config.vocab_size)
    paths: dict[tuple, float] = {}

    def walk(matcher, out: tuple, p: float) -> None:
        if matcher.is_stopped():
            paths[out] = p
            return
        logits = last_logits(model, prompt + list(out))[None].astype(np.float64)
        llguidance.numpy.fill_next_token_bitmask(matcher, mask)
        llguidance.numpy.apply_token_bitmask_inplace(logits, mask)
        probs = np.exp(logits[0] - logits.max())
        probs /= probs.sum()
        for token in np.flatnonzero(probs > 1e-9):
            child = matcher.deep_copy()
            assert child.consume_token(int(token))
            walk(child, out + (int(token),), p * probs[token])

    walk(llguidance.LLMatcher(lltok, structured.grammar_text()), (), 1.0)
    return paths


def sampled_constrained(model: Model, prompt: list[int], n: int) -> list[tuple | None]:
    """n seeded answers (temperature 1) of an n-gram speculating engine; None for a failed one."""
    eng = engine(model, max_slots=8, speculative=SpeculativeConfig("ngram", 3, ngram_min=1))  # one-token matches too
    outs = eng.generate([prompt] * n, [SamplingParams(temperature=1.0, seed=i, max_tokens=12, structured_outputs=COLOURS)
                                       for i in range(n)])
    assert eng.metrics().speculative.accepted[0] > 0
    return [None if o.finish_reason == "error" else tuple(o.token_ids) for o in outs]


def fits(samples: list[tuple | None], exact: dict[tuple, float]) -> float:
    """Chi-square p of the sampled token sequences against `exact`; 0 if any answer failed or
    is not one the grammar allows."""
    if any(s not in exact for s in samples):
        return 0.0
    keys = list(exact)
    return chi_square_p(np.array([keys.index(s) for s in samples]), np.array([exact[k] for k in keys]))


def test_sampled_ngram_speculation_keeps_the_constrained_distribution(model, monkeypatch):
    """Sampled constrained answers with n-gram drafts (some accepted) follow the masked model's
    exact distribution over token sequences (chi-square p > 1e-3); verification that ignores
    the masks after the drafts fails the same check."""
    import jaxinfer.speculative.step as spec_step

    prompt = model.tokenizer.encode(COLOUR_PROMPT)
    exact = exact_constrained(model, prompt, COLOURS)
    assert abs(sum(exact.values()) - 1) < 1e-6 and len(exact) >= 3
    assert fits(sampled_constrained(model, prompt, 400), exact) > 1e-3
    masked = spec_step.penalized_logits
    monkeypatch.setattr(spec_step, "penalized_logits", lambda *a: masked(*a[:5]))  # the planted bug: no draft masks
    jax.clear_caches()
    try:
        assert fits(sampled_constrained(model, prompt, 400), exact) < 1e-3
    finally:
        monkeypatch.undo()
        jax.clear_caches()


def test_bad_structured_outputs_raise_naming_the_field_and_lose_nothing(model):
    eng = engine(model)
    good = eng.add_request("fine", SamplingParams(temperature=0, max_tokens=4, structured_outputs={"regex": "[a-z]+"}))
    bad = [({"regex": "[a-z"}, "structured_outputs.regex"), ({"json": {"type": "objekt"}}, "structured_outputs.json"),
           ({"grammar": "start: undefined_rule"}, "structured_outputs.grammar"), ({"json": "{not json"}, "structured_outputs.json"),
           ({"regex": "a", "choice": ["b"]}, "exactly one"), ({}, "exactly one"), ({"choice": []}, "structured_outputs.choice"),
           ({"jsn": {}}, "unknown fields ['jsn']"), ({"json_object": "yes"}, "structured_outputs.json_object")]
    for fields, message in bad:
        with pytest.raises(ValueError, match=re.escape(message)):
            eng.add_request("x", SamplingParams(max_tokens=8, structured_outputs=fields))
    with pytest.raises(ValueError, match="structured_outputs="):
        SamplingParams(structured_outputs=["regex"])
    assert StructuredOutputsParams(json=True).json == StructuredOutputsParams(json="true").json == "{}"  # any value
    with pytest.raises(ValueError, match="structured_outputs.json must be a JSON schema"):
        StructuredOutputsParams(json=False)
    eos = model.config.eos_ids[0]
    with pytest.raises(ValueError, match="allowed_token_ids: none of these tokens may start"):
        eng.add_request("x", SamplingParams(allowed_token_ids=[eos], structured_outputs={"choice": ["yes", "no"]}))
    without_tokenizer = engine(Model(config=model.config, params=model.params, tokenizer=None))
    with pytest.raises(ValueError, match="tokenizer"):
        without_tokenizer.add_request([1, 2], SamplingParams(structured_outputs={"regex": "a"}))
    done = {}
    while eng.has_unfinished_requests():
        done.update({o.request_id: o for o in eng.step() if o.finished})
    assert list(eng.requests) == [] and re.fullmatch("[a-z]+", done[good].text)


def spelled_alone(model: Model, tokens: list[int]) -> list[int]:
    """Indices of `tokens` that are the whole tokenization of their own text (usable as tags)."""
    tok = model.tokenizer
    return [i for i, t in enumerate(tokens) if tok.encode(tok.decode([t], skip_special_tokens=False),
                                                          add_special_tokens=False) == [t]]


@pytest.mark.parametrize("opens", ["template", "model"])
def test_with_a_reasoning_parser_the_grammar_starts_after_the_thinking(model, monkeypatch, opens):
    """`EngineConfig.reasoning_parser`: a constrained request's tokens are an unconstrained
    request's (same seed) up to the closing tag, then the reference loop's under the grammar
    from there (sampled, token for token). The tags are tokens the tiny model samples anyway:
    the template opens the thinking (DeepSeek-R1) or the model's first token does (Qwen3)."""
    from jaxinfer import reasoning

    tok, prompt, p = model.tokenizer, model.tokenizer.encode("Think, then reply:"), params(CASES["json"], 0)
    free = engine(model).generate([prompt], [dataclasses.replace(p, structured_outputs=None)])[0].token_ids
    first = 1 if opens == "model" else 0  # the free answer's first token opens the thinking
    alone = [i for i in spelled_alone(model, free) if i >= first + 2 and free[i] not in free[first:i]]
    assert (opens == "template" or 0 in spelled_alone(model, free)) and alone
    end = alone[0]
    parser = reasoning.ReasoningParser("test", starts_inside=opens == "template",
                                       start=tok.decode(free[:1], skip_special_tokens=False) if first else "<think>",
                                       end=tok.decode([free[end]], skip_special_tokens=False))
    monkeypatch.setitem(reasoning.REASONING_PARSERS, "test", parser)
    out = engine(model, reasoning_parser="test").generate([prompt], [p])[0]
    thinking = free[: end + 1]
    answer = reference_decode(model, llg_tokenizer(model), prompt + thinking,
                              dataclasses.replace(p, max_tokens=p.max_tokens - len(thinking)), p.seed)
    assert out.token_ids == thinking + answer
    assert answer != free[end + 1 :]  # the grammar took over
    check_follows("json", tok.decode(answer), out.finish_reason == "stop")


def test_a_closed_or_unclosed_thinking_in_the_prompt_starts_the_answer_or_the_thinking(model):
    """The real parsers with SmolLM2's tokenizer (its <think> is three tokens, so the model
    cannot open one under a grammar): a prompt ending with </think> (a template with thinking
    off) or Qwen3's convention constrain from the first token, as without a parser;
    DeepSeek-R1's leaves an answer that never closes its thinking free."""
    lltok, p = llg_tokenizer(model), params(CASES["json"], 1)
    closed, open_ = model.tokenizer.encode("Reply: <think>done</think>\n"), model.tokenizer.encode("Reply:")
    for name, prompt in (("deepseek_r1", closed), ("qwen3", closed), ("qwen3", open_)):
        out = engine(model, reasoning_parser=name).generate([prompt], [p])[0]
        assert out.token_ids == reference_decode(model, lltok, prompt, p, p.seed), (name, prompt)
    free = engine(model).generate([open_], [dataclasses.replace(p, structured_outputs=None)])[0]
    assert "</think>" not in free.text
    assert engine(model, reasoning_parser="deepseek_r1").generate([open_], [p])[0].token_ids == free.token_ids


def test_after_thinking_draft_masks_follow_the_states_and_move_nothing(model):
    """`AfterThinking.draft_masks` equals the masks of a gate fed token by token, through the
    lead (opener allowed beside the grammar), the thinking (everything) and the answer (the
    grammar's, cut at a refused token); the gate stays where it was."""
    from jaxinfer.structured_output import AfterThinking, GrammarCompiler

    compiler = GrammarCompiler(model.tokenizer, model.config.vocab_size, model.config.eos_ids)
    ids = model.tokenizer.encode("red red red red red red ", add_special_tokens=False)
    opener, end, other = 7, model.tokenizer.encode(" ok.", add_special_tokens=False), 13
    drafts = [opener, other, *end, *ids[:3], other]  # opens, thinks, closes, answers, then a refused token
    gate, step_by_step = (AfterThinking(compiler.matcher(REPEATS), "lead", end, opener) for _ in range(2))
    lead = gate.allowed().copy()
    assert lead[opener // 32] & (1 << opener % 32) and not compiler.matcher(REPEATS).allowed()[opener // 32] & (1 << opener % 32)
    want = []
    for token in drafts[:-1]:
        step_by_step.consume(token)
        want.append(step_by_step.allowed().copy())
    np.testing.assert_array_equal(gate.draft_masks(drafts), np.stack(want))
    assert [step_by_step.state, gate.state] == ["answer", "lead"] and (want[1] == -1).all()
    np.testing.assert_array_equal(gate.allowed(), lead)
    answering = AfterThinking(compiler.matcher(REPEATS), "lead", end, opener)
    np.testing.assert_array_equal(answering.draft_masks(ids[:2]), compiler.matcher(REPEATS).draft_masks(ids[:2]))
    for token in ids:
        answering.consume(token)
    assert answering.state == "answer" and answering.done


def test_strict_schemas_admit_only_declared_properties(model):
    """`strict_schema` (OpenAI's strict mode, for `"strict": true` functions and response
    formats): an object that leaves `additionalProperties` unset admits only its declared
    properties, nested ones too; the grammar refuses an extra key it would otherwise allow.
    Objects that declare properties are closed so by default too (vLLM's xgrammar default);
    `disable_additional_properties=False` opens them. The caller's schema is not changed."""
    from jaxinfer.structured_output import GrammarCompiler, strict_schema

    schema = {"type": "object", "properties": {"unit": {"type": "string"},
                                               "at": {"type": "object", "properties": {"h": {"type": "integer"}}}}}
    original = json.loads(json.dumps(schema))
    closed = strict_schema(schema)
    assert schema == original and closed["additionalProperties"] is False
    assert closed["properties"]["at"]["additionalProperties"] is False
    assert strict_schema({"type": "object", "additionalProperties": True})["additionalProperties"] is True
    assert strict_schema({"type": ["object", "null"]})["additionalProperties"] is False
    compiler = GrammarCompiler(model.tokenizer, model.config.vocab_size, model.config.eos_ids)
    kept_of = lambda params, ids: model.tokenizer.decode(ids[: len(compiler.matcher(params).draft_masks(ids))])  # noqa: E731
    for text, declared, extra in (('{"unit":"c","tz":"UTC"}', '{"unit":"c"', "tz"), ('{"at":{"h":1,"m":2}}', '{"at":{"h":1', '"m')):
        ids = model.tokenizer.encode(text, add_special_tokens=False)
        assert kept_of(StructuredOutputsParams(json=schema, disable_additional_properties=False), ids) == text
        for params in (StructuredOutputsParams(json=closed), StructuredOutputsParams(json=schema)):
            kept = kept_of(params, ids)
            assert kept.startswith(declared) and extra not in kept, kept
    any_object = model.tokenizer.encode('{"tz":"UTC"}', add_special_tokens=False)  # declares nothing: any object
    assert kept_of(StructuredOutputsParams(json={"type": "object"}), any_object) == '{"tz":"UTC"}'
    assert kept_of(StructuredOutputsParams(json_object=True), any_object) == '{"tz":"UTC"}'


def test_backslash_d_is_an_ascii_digit(model):
    """`\\d` in a regex means [0-9] (JSON Schema's and vLLM's meaning), inside classes too;
    `\\p{Nd}` still allows every Unicode digit."""
    from jaxinfer.structured_output import GrammarCompiler, ascii_digits

    assert ascii_digits(r"\d{3}-[\d.]+\\d[^\d]\D") == r"[0-9]{3}-[0-9.]+\\d[^0-9]\D"
    assert ascii_digits(r"[]\d][a[\d]]") == r"[]0-9][a[0-9]]"
    compiler = GrammarCompiler(model.tokenizer, model.config.vocab_size, model.config.eos_ids)
    seven, wide = (model.tokenizer.encode(d, add_special_tokens=False)[0] for d in ("7", "\uff19"))

    def allows(regex: str, token: int) -> bool:
        mask = compiler.matcher(StructuredOutputsParams(regex=regex)).allowed().view(np.uint32)
        return bool(mask[token // 32] >> np.uint32(token % 32) & 1)

    assert allows(r"\d", seven) and not allows(r"\d", wide) and not allows(r"[\d]", wide)
    assert allows(r"\p{Nd}", wide)


def test_grammars_compile_once_and_each_request_gets_its_own_matcher(model, monkeypatch):
    """A grammar compiled ahead (`Engine.compile_grammar`, what the server does off the engine's
    thread) or by an earlier request is not compiled again; every request still starts at the
    grammar's beginning, whatever another has consumed."""
    compiled = []
    text_of = StructuredOutputsParams.grammar_text
    monkeypatch.setattr(StructuredOutputsParams, "grammar_text", lambda self: compiled.append(self) or text_of(self))
    eng = engine(model)
    structured = StructuredOutputsParams(regex=REGEX)
    eng.compile_grammar(structured)
    outs = eng.generate(["A code:", "Another:"], [params(structured, i) for i in range(2)])
    outs += eng.generate(["A code:"], [params(StructuredOutputsParams(regex=REGEX), 0)])
    assert len(compiled) == 1 and outs[2].token_ids == outs[0].token_ids
    assert all(re.fullmatch(REGEX, o.text) for o in outs if o.finish_reason == "stop")
    with pytest.raises(ValueError, match="structured_outputs.regex"):
        eng.compile_grammar(StructuredOutputsParams(regex="[0-9"))
