"""Draft training: the dense forward, the data helpers, a tiny end-to-end run, save/load, and
the draft shipped in checkpoints/."""

from __future__ import annotations

import dataclasses
import subprocess

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer.speculative import train as dt
from jaxinfer.kv import KVCacheSpec
from jaxinfer.loading import Model
from jaxinfer.model import forward
from tiny_models import kv_with_pages, random_tokens, tiny_model

TINY_CFG = dt.DraftTrainingConfig(n_layers=2, vocab_subset=48, new_tokens=12, top_k=8, epochs=8, lr=1e-2,
                                  batch_size=4, seed=0)


def tiny_target(**changes) -> Model:
    config, params = tiny_model(seed=1, **changes)
    return Model(config, params, tokenizer=None, source="tiny")


def test_dense_logits_equal_the_paged_forward():
    config, params = tiny_model(seed=2)
    tokens = random_tokens((2, 24), config.vocab_size, seed=3)
    spec = KVCacheSpec(num_pages=8, page_size=8, max_slots=2, max_pages_per_seq=3)
    positions = jnp.broadcast_to(jnp.arange(24, dtype=jnp.int32), (2, 24))
    kv = kv_with_pages(config, spec, [[1, 2, 3], [4, 5, 6]])
    paged, _ = forward(params, config, jnp.asarray(tokens), positions, kv)
    dense = dt.dense_logits(params, config, jnp.asarray(tokens))
    np.testing.assert_allclose(dense, paged, rtol=1e-5, atol=1e-5)


def test_frequency_ranked_vocab_breaks_ties_by_id():
    # counts: 5 -> 3, 2 -> 2, 7 -> 2, 0 -> 1; unseen ids (1, 3, 4, 6, ...) follow by id.
    seqs = [np.array([5, 2, 7, 5]), np.array([7, 5, 2, 0])]
    np.testing.assert_array_equal(dt.frequency_ranked_vocab(seqs, 10, 6), [5, 2, 7, 0, 1, 3])
    with pytest.raises(ValueError, match="vocab subset size 11"):
        dt.frequency_ranked_vocab(seqs, 10, 11)


def test_subset_targets_drop_outside_tokens_and_renormalise():
    # One position, teacher top-3 = tokens 4 (p=.5), 9 (p=.3), 1 (p=.2); subset = [1, 4].
    # Token 9 is dropped: p(4) = .5 / .7, p(1) = .2 / .7, at subset indices 1 and 0.
    data = dt.DistillData(tokens=np.array([[3, 0]], np.int32), lengths=np.array([1], np.int32),
                          top_ids=np.array([[[4, 9, 1], [9, 9, 9]]], np.int32),
                          top_logp=np.log(np.array([[[.5, .3, .2], [1, 1, 1]]], np.float32)),
                          prompt_index=np.array([0], np.int32), prompt_lengths=np.array([1], np.int32))
    t = dt.subset_targets(data, np.array([1, 4], np.int32), vocab_size=10)
    np.testing.assert_array_equal(t["index"][0, 0], [1, 0, 0])
    np.testing.assert_allclose(t["prob"][0, 0], [.5 / .7, 0, .2 / .7], rtol=1e-6)
    np.testing.assert_array_equal(t["weight"], [[1, 0]])  # position 1 is padding
    np.testing.assert_array_equal(t["teacher_top1"], [[4, 9]])


def test_distill_loss_is_the_soft_cross_entropy():
    target = tiny_target()
    draft = dt.init_draft(target, 2, np.array([3, 1, 4, 15, 9, 2], np.int32))
    rng = np.random.default_rng(0)
    tokens = random_tokens((2, 5), target.config.vocab_size, seed=4)
    index = rng.integers(0, 6, (2, 5, 3)).astype(np.int32)
    prob = rng.dirichlet(np.ones(3), (2, 5)).astype(np.float32)
    weight = np.array([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]], np.float32)
    batch = dict(tokens=tokens, index=index, prob=prob, weight=weight)
    loss = dt.distill_loss(dt.trainable(draft), draft.params, draft.config, batch)
    # Reference: log-softmax over the 6 subset logits, then -sum_k p_k log q[index_k] averaged
    # over the 8 weighted positions.
    logits = np.asarray(dt.dense_logits(draft.params, draft.config, jnp.asarray(tokens)), np.float64)
    logq = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    per_position = -(prob * np.take_along_axis(logq, index, -1)).sum(-1)
    np.testing.assert_allclose(loss, (per_position * weight).sum() / 8, rtol=1e-5)


def test_tiny_end_to_end_run_learns_and_round_trips(tmp_path):
    target = tiny_target()
    prompts = [random_tokens((6,), target.config.vocab_size, seed=s).tolist() for s in range(6)]
    draft, figures = dt.train_draft(target, TINY_CFG, prompts=prompts)
    losses = [e["loss"] for e in figures["epochs"]]
    assert 0 < losses[-1] < 0.9 * losses[0], losses  # a cross-entropy: positive, and it falls
    assert figures["sequences"] == 18  # 6 prompts x 3 temperatures
    assert draft.params.lm_head.shape == (48, target.config.d_model)

    path = dt.save_trained_draft(draft, target, tmp_path / "draft", figures)
    loaded = dt.load_trained_draft(target, path)
    np.testing.assert_array_equal(loaded.vocab_ids, draft.vocab_ids)
    assert loaded.config == draft.config
    bf16 = lambda a: np.asarray(jnp.asarray(a, jnp.bfloat16).astype(jnp.float32))  # noqa: E731
    for got, want in zip(jax.tree.leaves(loaded.params.layers), jax.tree.leaves(draft.params.layers)):
        np.testing.assert_array_equal(got, bf16(want))
    np.testing.assert_array_equal(loaded.params.final_norm, bf16(draft.params.final_norm))
    assert target.params.lm_head is not None  # untied: the draft's head is rows of the target's head
    np.testing.assert_array_equal(loaded.params.lm_head, target.params.lm_head[loaded.vocab_ids])
    assert loaded.params.embed is target.params.embed
    assert dt.read_draft_info(path)["training"]["tokens"] == figures["tokens"]


def test_draft_runs_through_the_paged_forward_over_its_subset():
    target = tiny_target()
    draft = dt.init_draft(target, 1, np.arange(40, 56, dtype=np.int32))
    tokens = random_tokens((2, 16), target.config.vocab_size, seed=5)
    spec = KVCacheSpec(num_pages=6, page_size=8, max_slots=2, max_pages_per_seq=2)
    positions = jnp.broadcast_to(jnp.arange(16, dtype=jnp.int32), (2, 16))
    kv = kv_with_pages(draft.config, spec, [[1, 2], [3, 4]])
    paged, _ = forward(draft.params, draft.config, jnp.asarray(tokens), positions, kv)
    assert paged.shape == (2, 16, 16)  # logit i scores token vocab_ids[i]
    np.testing.assert_allclose(dt.dense_logits(draft.params, draft.config, jnp.asarray(tokens)), paged,
                               rtol=1e-5, atol=1e-5)
    # the head is the target's head rows: subset logits are the full model's logits at vocab_ids
    full = dt.dense_logits(dataclasses.replace(draft.params, lm_head=target.params.lm_head), draft.config,
                           jnp.asarray(tokens))
    np.testing.assert_allclose(paged, full[..., 40:56], rtol=1e-5, atol=1e-5)


def test_options_that_depend_on_the_target_are_checked_before_generating(monkeypatch):
    """A layer count or vocabulary subset the target cannot give is refused at once, not after
    the generation and teacher passes (minutes to an hour)."""
    from jaxinfer.speculative.train import eagle, loop
    from jaxinfer.speculative.train.eagle import EagleTrainingConfig, train_eagle

    def generated(*args, **kwargs):
        raise AssertionError("generated before checking the options")

    for module in (eagle, loop):
        monkeypatch.setattr(module, "generate_sequences", generated)
    target = tiny_target()
    with pytest.raises(ValueError, match="n_layers=45 must be in"):
        dt.train_draft(target, dt.DraftTrainingConfig(n_layers=45), prompts=[[1, 2, 3]])
    for train, cfg in ((dt.train_draft, dt.DraftTrainingConfig(vocab_subset=10**6)),
                       (train_eagle, EagleTrainingConfig(vocab_subset=10**6))):
        with pytest.raises(ValueError, match="vocab subset size 1000000"):
            train(target, cfg, prompts=[[1, 2, 3]])


def test_a_checkpoint_of_the_other_kind_is_named():
    from jaxinfer.speculative.checkpoint import DEFAULT_DRAFT_PATH, read_draft_info
    from jaxinfer.speculative.eagle import DEFAULT_EAGLE_PATH
    from jaxinfer.speculative.eagle.checkpoint import read_eagle_info

    with pytest.raises(FileNotFoundError, match="holds an EAGLE head: use eagle:PATH"):
        read_draft_info(DEFAULT_EAGLE_PATH)
    with pytest.raises(FileNotFoundError, match="holds a trained draft: use draft:PATH"):
        read_eagle_info(DEFAULT_DRAFT_PATH)


def test_load_rejects_a_mismatching_target(tmp_path):
    target = tiny_target()
    draft = dt.init_draft(target, 1, np.arange(16, dtype=np.int32))
    path = dt.save_trained_draft(draft, target, tmp_path / "draft")
    with pytest.raises(ValueError, match="d_model: draft trained for 32, target has 48"):
        dt.load_trained_draft(tiny_target(d_model=48), path)
    with pytest.raises(ValueError, match="vocab_size"):
        dt.load_trained_draft(tiny_target(vocab_size=101), path)


@pytest.mark.slow
def test_the_target_writes_distinct_user_turns(smollm2_gguf):
    """Magpie: SmolLM2 given its chat template up to the user's turn writes requests."""
    from jaxinfer.loading import load_model

    target = load_model(smollm2_gguf, progress=False)
    prompts = dt.self_written_prompts(target, 12, seed=0, max_tokens=48, max_slots=16)
    assert len(prompts) == 12 and len({p.lower() for p in prompts}) == 12
    for p in prompts:
        assert p == p.strip() and 3 <= len(p.split()) <= 80 and "<|im_" not in p, p
    # A user's turn asks for something (seen: 11 of the 12 end with "?" or start with a request
    # like "Can you", "I need"); an assistant's answer ("Sure! Here ...") would not.
    openings = ("Can", "Could", "How", "What", "Write", "I", "I'm")
    asks = [p for p in prompts if p.endswith("?") or p.split()[0] in openings]
    assert len(asks) >= 8, prompts
    with pytest.raises(ValueError, match="need a model with a tokenizer and a chat template"):
        dt.self_written_prompts(tiny_target(), 4, seed=0)
    random_weights = Model(*tiny_model(vocab_size=target.config.vocab_size, eos_ids=target.config.eos_ids)[:2],
                           tokenizer=target.tokenizer)
    with pytest.raises(ValueError, match="usable prompts"):  # random weights never end their turn
        dt.self_written_prompts(random_weights, 2, seed=0, max_tokens=4, max_slots=4)


@pytest.mark.slow
def test_shipped_draft_loads_and_beats_its_init(smollm2_gguf):
    from jaxinfer.loading import load_model

    path = dt.DEFAULT_DRAFT_PATH
    size = int(subprocess.run(["du", "-sk", str(path)], capture_output=True, text=True, check=True).stdout.split()[0])
    assert size < 20 * 1024, f"{path} takes {size} KiB on disk"
    target = load_model(smollm2_gguf, progress=False)
    draft = dt.load_trained_draft(target)
    info = dt.read_draft_info(path)
    n = info["n_layers"]
    assert draft.config == target.config.replace(n_layers=n)
    assert draft.params.lm_head.shape == (info["vocab_subset"], 576) and draft.params.layers[0].wq.dtype == jnp.float32

    # Greedy top-1 agreement with the target on a fixed chat turn, trained vs untrained.
    tok = target.tokenizer
    text = tok.apply_chat_template([{"role": "user", "content": "Explain why the sea is salty."}])
    text += "The sea is salty because rivers carry dissolved minerals from rocks into the ocean. "
    text += "When water evaporates, the salt stays behind, so over millions of years it builds up."
    tokens = jnp.asarray([tok.encode(text, add_special_tokens=False)], jnp.int32)  # i32[1, T]
    teacher = np.asarray(jnp.argmax(dt.dense_logits(target.params, target.config, tokens), -1))

    def agreement(d) -> float:
        return float(np.mean(d.vocab_ids[np.asarray(jnp.argmax(dt.dense_logits(d.params, d.config, tokens), -1))]
                             == teacher))

    # 70 positions, about half of them the (memorised) system prompt; measured when shipped:
    # trained 41/70 = 0.586, untrained 3/70 = 0.043.
    init = dt.init_draft(target, n, draft.vocab_ids)
    trained_top1, init_top1 = agreement(draft), agreement(init)
    assert trained_top1 > 0.5 and init_top1 < 0.1, (trained_top1, init_top1)
