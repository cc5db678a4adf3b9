"""The real Gemma 3 270M (GGUF Q4_K_M, the base model) against transformers' Gemma3ForCausalLM
holding the same dequantized weights (f32): logits within 1e-3 on real prompts (one past the
512-token window), equal greedy continuations, equal tokenizer ids.

The transformers side is built here, independently of our loader: its config is the published
google/gemma-3-270m config written out by hand, and its weights are the GGUF tensors
dequantized by the `gguf` library, renamed to HF names with llama.cpp's `+ 1` taken off the
norms. (transformers can load the GGUF itself, but parses the 262k-token vocabulary for 40 s.)
"""

from __future__ import annotations

import dataclasses

import gguf
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from jaxinfer.gguf_file import read_gguf
from jaxinfer.kv import KVCacheSpec, init_paged_kv
from jaxinfer.loading import load_model
from jaxinfer.model import forward
from test_model_parity import all_position_logits, hf_greedy
from test_variant_parity import greedy_one_by_one

pytestmark = pytest.mark.slow

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    if n < 2:\n        return n\n",
    "Photosynthesis is the process by which green plants",
]
_HF_LAYER = {  # GGUF name inside `blk.{i}.` -> HF name inside `model.layers.{i}.`
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
    "attn_norm": "input_layernorm", "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm", "post_ffw_norm": "post_feedforward_layernorm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}


def _hf_name(gguf_name: str) -> str:
    if gguf_name.startswith("blk."):
        _, layer, field, _ = gguf_name.split(".")
        return f"model.layers.{layer}.{_HF_LAYER[field]}.weight"
    return {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight"}[gguf_name]


@pytest.fixture(scope="module")
def ours(gemma3_gguf):
    return load_model(gemma3_gguf, progress=False, weight_cache=False)


@pytest.fixture(scope="module")
def hf(gemma3_gguf):
    import transformers

    config = transformers.Gemma3TextConfig(  # google/gemma-3-270m's config.json
        vocab_size=262144, hidden_size=640, intermediate_size=2048, num_hidden_layers=18, num_attention_heads=4,
        num_key_value_heads=1, head_dim=256, max_position_embeddings=32768, rms_norm_eps=1e-6, sliding_window=512,
        query_pre_attn_scalar=256, sliding_window_pattern=6, tie_word_embeddings=True,
        rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1_000_000.0},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0}})
    model = transformers.Gemma3ForCausalLM(config).eval()
    state = {}
    for name, tensor in read_gguf(gemma3_gguf).tensors.items():
        w = gguf.quants.dequantize(tensor.data, tensor.type).astype(np.float32)
        state[_hf_name(name)] = torch.from_numpy(w - 1 if name.endswith("norm.weight") else w)
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert missing == ["lm_head.weight"] and not unexpected  # tied to the embedding
    return model


def test_config_from_gguf_metadata(ours):
    c = ours.config
    assert (c.arch, c.n_layers, c.d_model, c.n_heads, c.n_kv_heads, c.head_dim, c.vocab_size) == \
        ("gemma3", 18, 640, 4, 1, 256, 262144)
    assert c.layer_windows == ((512,) * 5 + (None,)) * 3
    assert (c.rope_theta, c.rope_local_theta, c.query_scale) == (1e6, 1e4, 1 / 16)
    assert c.eos_ids == (1, 106) and ours.tokenizer.eos_ids == (1, 106)  # <eos>, <end_of_turn>


def test_logits_and_greedy_match_transformers(ours, hf):
    rows = [ours.tokenizer.encode(prompt) for prompt in PROMPTS]
    width = max(map(len, rows))
    padded = np.asarray([ids + [0] * (width - len(ids)) for ids in rows], np.int32)  # right-padded: causal, harmless
    logits = all_position_logits(ours, padded)  # one program for all prompts
    for prompt, ids, got in zip(PROMPTS, rows, logits):
        with torch.no_grad():
            want = hf(torch.tensor([ids])).logits.numpy()[0]
        diff = np.abs(got[: len(ids)] - want).max()
        assert diff < 1e-3, (prompt, diff)
    got, _ = greedy_one_by_one(ours, rows[0], 16)
    assert got == hf_greedy(hf, rows[0], 16)


def test_long_prompt_past_the_window_matches_transformers(ours, hf):
    """700 tokens: the windowed layers' queries at the end no longer see the first 188 keys."""
    text = " ".join(f"Item {i}: the {['red', 'green', 'blue'][i % 3]} box holds {i * 7 % 13} stones." for i in range(60))
    ids = ours.tokenizer.encode(text)[:700]
    assert len(ids) == 700
    spec = KVCacheSpec.for_batch(1, len(ids), page_size=16)
    kv = init_paged_kv(ours.config, spec)
    kv = kv.replace(block_tables=jnp.arange(1, spec.num_pages, dtype=jnp.int32)[None, : spec.max_pages_per_seq])
    logits, _ = forward(ours.params, ours.config, jnp.asarray([ids]), jnp.arange(len(ids))[None], kv,
                        logits_index=jnp.asarray([len(ids) - 1]))
    with torch.no_grad():
        want = hf(torch.tensor([ids]), logits_to_keep=1).logits[:, -1].numpy()
    assert np.abs(np.asarray(logits) - want).max() < 1e-3


def test_tokenizer_ids_match_transformers(ours, gemma3_gguf):
    from transformers import AutoTokenizer

    hf_tok = AutoTokenizer.from_pretrained(gemma3_gguf.parent, gguf_file=gemma3_gguf.name)
    texts = ["Hello world", " leading space", "two  spaces   three\t tab", "lines\n\n\nend\n", "   ", "",
             "naïve café — “quotes” Straße ÄÖÜ ½ ﬁ", "你好世界 こんにちは 안녕하세요 Ωμέγα", "🤖🎉 👩‍👩‍👧 \u200b",
             "12345 67890 3.14159 1e-6", "x = f(y) {return [a, b];} // ok", "<bos>text<eos><pad>",
             "<start_of_turn>user\nWhat is 2+2?<end_of_turn>\n<start_of_turn>model\n"]
    for text in texts:
        assert ours.tokenizer.encode(text) == hf_tok(text).input_ids, text
        ids = ours.tokenizer.encode(text, add_special_tokens=False)
        assert ours.tokenizer.decode(ids, skip_special_tokens=False) == hf_tok.decode(ids), text
    chat = ours.tokenizer.apply_chat_template([{"role": "system", "content": "Be brief."},
                                               {"role": "user", "content": " Hi "},
                                               {"role": "assistant", "content": "Hello!"},
                                               {"role": "user", "content": "Bye"}])
    assert chat == ("<bos><start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n<start_of_turn>model\nHello!"
                    "<end_of_turn>\n<start_of_turn>user\nBye<end_of_turn>\n<start_of_turn>model\n")
    assert ours.tokenizer.encode(chat, add_special_tokens=False)[:4] == [2, 105, 2364, 107]


def test_engine_with_ngram_speculation_and_the_server(ours, hf):
    """The engine (n-gram drafts verified 4 at a time) continues like transformers' greedy, and the
    OpenAI server returns the engine's text for a completion and a chat turn."""
    import httpx

    from jaxinfer.engine import Engine, EngineConfig, SpeculativeConfig
    from jaxinfer.sampling import SamplingParams
    from jaxinfer.server import build_server
    from test_server import ServerThread

    prompt = "one two three four one two three four one two three"
    ids = ours.tokenizer.encode(prompt)
    config = EngineConfig(max_slots=2, page_size=16, prefill_chunk=32, max_model_len=64)
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    spec = Engine(ours, dataclasses.replace(config, speculative=SpeculativeConfig(method="ngram", num_speculative=4)))
    out = spec.generate([ids], greedy)[0]
    assert out.token_ids == hf_greedy(hf, ids, 12) and spec.spec_stats.accepted.sum() > 0
    srv = ServerThread(build_server(ours, config, "gemma3", max_queue=4, warmup=False))
    try:
        body = {"model": "gemma3", "prompt": prompt, "max_tokens": 12, "temperature": 0, "ignore_eos": True}
        r = httpx.post(f"{srv.url}/v1/completions", json=body, timeout=300).json()
        assert r["choices"][0]["text"] == out.text
        chat = {"model": "gemma3", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8, "temperature": 0}
        r = httpx.post(f"{srv.url}/v1/chat/completions", json=chat, timeout=300).json()
        chat_ids = ours.tokenizer.encode(ours.tokenizer.apply_chat_template(chat["messages"]), add_special_tokens=False)
        want = Engine(ours, config).generate([chat_ids], SamplingParams(temperature=0, max_tokens=8))[0]
        assert r["choices"][0]["message"]["content"] == want.text
        assert r["choices"][0]["finish_reason"] == want.finish_reason
    finally:
        srv.stop()


@pytest.mark.extended  # prefix hits over rings: tests/test_prefix_cache_rings.py; int8 on SmolLM2: tests/test_kv_quant.py
def test_engine_with_prefix_caching_and_int8_kv(ours, hf):
    """Two requests sharing a 40-token prefix give transformers' greedy tokens with prefix
    caching (the second request's global layers read the first's pages, its windowed rings are
    recomputed), and an int8 KV cache keeps the greedy continuation of a plain prompt."""
    from jaxinfer.engine import Engine, EngineConfig
    from jaxinfer.sampling import SamplingParams

    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    config = EngineConfig(max_slots=2, page_size=16, prefill_chunk=32, max_model_len=96, enable_prefix_caching=True)
    prefix = ours.tokenizer.encode(PROMPTS[2] + " convert light energy into chemical energy. In this process,")
    prompts = [prefix + ours.tokenizer.encode(tail, add_special_tokens=False) for tail in (" water", " carbon")]
    assert len(prefix) >= 16  # at least one full page to share
    eng = Engine(ours, config)
    first = eng.generate(prompts[:1], greedy)[0]
    second = eng.generate(prompts[1:], greedy)[0]
    assert eng.metrics().prefix_hits > 0
    assert first.token_ids == hf_greedy(hf, prompts[0], 8)
    assert second.token_ids == hf_greedy(hf, prompts[1], 8)

    ids = ours.tokenizer.encode(PROMPTS[0])
    int8 = Engine(ours, EngineConfig(max_slots=1, page_size=16, prefill_chunk=32, max_model_len=64, kv_cache="int8"))
    assert int8.generate([ids], greedy)[0].token_ids == hf_greedy(hf, ids, 8)
