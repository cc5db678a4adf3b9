"""Teacher-forced scoring: each token's logprob given the tokens before it.

What OpenAI's `echo` + `logprobs` returns for a prompt, and what evaluation harnesses
(lm-eval's loglikelihood) ask a server for. One forward over the whole sequence in a fresh
dense cache of its own (the serving engine's pages are not touched), padded to a power-of-two
bucket so a few programs serve every length.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.config import ModelConfig
from jaxinfer.kv import KVCacheSpec, init_paged_kv
from jaxinfer.model import ModelParams, forward
from jaxinfer.sampling import TokenLogprobs, token_logprobs

MIN_BUCKET = 16  # tokens: the shortest program
PAGE_SIZE = 16


def score_tokens(model, ids: list[int]) -> TokenLogprobs:
    """`model` (a `jaxinfer.loading.Model`), ids of n >= 1 tokens -> TokenLogprobs[n - 1] on
    the host: the logprob of token i + 1 after tokens 0..i (vLLM's convention: the raw
    distribution, no temperature) and its top alternatives. The first token has none."""
    n, vocab = len(ids), model.config.vocab_size
    if n < 1 or n > model.config.max_position:
        raise ValueError(f"can score 1 to {model.config.max_position} tokens, got {n}")
    if bad := [i for i in ids if not 0 <= i < vocab]:
        raise ValueError(f"token ids {bad[:5]} are outside the vocabulary [0, {vocab})")
    bucket = min(max(MIN_BUCKET, 1 << (n - 1).bit_length()), -(-model.config.max_position // PAGE_SIZE) * PAGE_SIZE)
    tokens = np.zeros((1, bucket), np.int32)
    tokens[0, :n] = ids  # the padding after the last token cannot change what came before (causal)
    lp = _score(model.params, model.config, jnp.asarray(tokens), bucket)
    return jax.tree.map(lambda a: np.asarray(a)[: n - 1], lp)


@functools.partial(jax.jit, static_argnames=("config", "bucket"))
def _score(params: ModelParams, config: ModelConfig, tokens: jax.Array, bucket: int) -> TokenLogprobs:
    """tokens i32[1, bucket] -> TokenLogprobs[bucket - 1]: of token i + 1 given 0..i."""
    spec = KVCacheSpec.for_batch(1, bucket, page_size=PAGE_SIZE)
    kv = init_paged_kv(config, spec)
    kv = kv.replace(block_tables=jnp.arange(1, spec.num_pages, dtype=jnp.int32)[None])
    logits, _ = forward(params, config, tokens, jnp.arange(bucket, dtype=jnp.int32)[None], kv)  # f32[1, bucket, V]
    return token_logprobs(logits[0, :-1], tokens[0, 1:])
