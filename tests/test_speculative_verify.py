"""verify_draft keeps the target distribution: exact enumeration, then sampling."""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer.speculative import acceptance_probs, residual_distribution, verify_draft

V = 3


@pytest.fixture(autouse=True)
def float64():
    """Exactness is checked in f64 (scoped: the rest of the suite stays 32-bit)."""
    with jax.enable_x64(True):
        yield


def random_conditionals(seed: int, depth: int, sharp: bool = False):
    """A table prefix -> distribution over V tokens, for every prefix up to `depth`."""
    rng = np.random.default_rng(seed)
    table = {}
    for n in range(depth + 1):
        for prefix in itertools.product(range(V), repeat=n):
            x = rng.dirichlet(np.full(V, 0.3 if sharp else 1.0))
            if sharp and rng.random() < 0.3:
                x = np.eye(V)[rng.integers(V)]  # one-hot rows: greedy / deterministic drafts
            table[prefix] = x
    return lambda prefix: table[tuple(prefix)]


def block_distribution(p_of, q_of, k: int) -> dict[tuple, float]:
    """Exact probability of every emitted block, enumerating all k-token drafts."""
    out: dict[tuple, float] = {}
    for draft in itertools.product(range(V), repeat=k):
        q = np.stack([q_of(draft[:i]) for i in range(k)])
        p = np.stack([p_of(draft[:i]) for i in range(k + 1)])
        prob_draft = np.prod([q[i, d] for i, d in enumerate(draft)])
        if prob_draft == 0:
            continue
        a = np.asarray(acceptance_probs(jnp.asarray(p[:k]), jnp.asarray(q), jnp.asarray(draft)))
        reach = prob_draft
        for n in range(k + 1):  # n drafts accepted, then a correction or the bonus
            if n < k:
                fix = np.asarray(residual_distribution(jnp.asarray(p[n]), jnp.asarray(q[n])))
                stop = reach * (1 - a[n])
            else:
                fix, stop = p[k], reach
            for c in range(V):
                block = draft[:n] + (c,)
                out[block] = out.get(block, 0.0) + stop * fix[c]
            if n < k:
                reach *= a[n]
    return out


def emitted_distribution(p_of, q_of, k: int, m: int) -> np.ndarray:
    """Distribution of the first m emitted tokens: one block, continued by the target."""
    dist = np.zeros((V,) * m)
    for block, prob in block_distribution(p_of, q_of, k).items():
        if len(block) >= m:
            dist[block[:m]] += prob
            continue
        for rest in itertools.product(range(V), repeat=m - len(block)):
            seq, pr = block, prob
            for tok in rest:
                pr *= p_of(seq)[tok]
                seq = seq + (tok,)
            dist[seq] += pr
    return dist


def target_joint(p_of, m: int) -> np.ndarray:
    dist = np.zeros((V,) * m)
    for seq in itertools.product(range(V), repeat=m):
        dist[seq] = np.prod([p_of(seq[:i])[t] for i, t in enumerate(seq)])
    return dist


@pytest.mark.parametrize("k", [1, 2, 3, 4])
@pytest.mark.parametrize("seed,sharp", [(0, False), (1, False), (2, True), (3, True)])
def test_exact_distribution_of_emitted_tokens_equals_the_target(k, seed, sharp):
    p_of = random_conditionals(seed, k + 1, sharp)
    q_of = random_conditionals(seed + 100, k, sharp)
    for m in range(1, k + 2):
        got = emitted_distribution(p_of, q_of, k, m)
        np.testing.assert_allclose(got, target_joint(p_of, m), atol=1e-12, rtol=0)


def test_a_wrong_residual_is_caught_by_the_enumeration():
    """Planted bug: correcting from p instead of the residual biases the output."""
    p_of, q_of = random_conditionals(0, 3), random_conditionals(100, 2)
    import jaxinfer.speculative.verify as spec

    original = spec.residual_distribution
    try:
        spec.residual_distribution = lambda p, q: p
        globals()["residual_distribution"] = spec.residual_distribution
        got = emitted_distribution(p_of, q_of, 2, 1)
    finally:
        spec.residual_distribution = original
        globals()["residual_distribution"] = original
    assert np.abs(got - target_joint(p_of, 1)).max() > 1e-3


def test_verify_draft_samples_match_the_enumeration():
    """verify_draft itself: 40k sampled blocks (k=2) against the exact block distribution."""
    k, n = 2, 40_000
    p_of, q_of = random_conditionals(5, k + 1), random_conditionals(6, k)
    exact = block_distribution(p_of, q_of, k)
    rng = np.random.default_rng(0)
    drafts = np.zeros((n, k), np.int64)
    for i in range(k):  # draw each draft token from q given the draft so far
        qs = np.stack([q_of(tuple(d[:i])) for d in drafts])
        drafts[:, i] = (qs.cumsum(1) > rng.random((n, 1))).argmax(1)
    q = np.stack([[q_of(tuple(d[:i])) for i in range(k)] for d in drafts])
    p = np.stack([[p_of(tuple(d[:i])) for i in range(k + 1)] for d in drafts])
    keys = jax.random.split(jax.random.key(0), n)
    num, tokens = jax.jit(verify_draft)(keys, jnp.asarray(drafts), jnp.asarray(q), jnp.asarray(p))
    num, tokens = np.asarray(num), np.asarray(tokens)
    counts: dict[tuple, int] = {}
    for a, t in zip(num, tokens):
        block = tuple(t[: a + 1].tolist())
        counts[block] = counts.get(block, 0) + 1
    blocks = [b for b, pr in exact.items() if pr > 0]
    assert set(counts) <= set(blocks)
    expected = np.array([exact[b] * n for b in blocks])
    observed = np.array([counts.get(b, 0) for b in blocks])
    chi2 = ((observed - expected) ** 2 / expected).sum()
    # dof = len(blocks) - 1 (<= 38 here); P(chi2 > dof + 4 sqrt(2 dof)) < 1e-3 for these dof.
    dof = len(blocks) - 1
    assert chi2 < dof + 4 * np.sqrt(2 * dof), (chi2, dof)


def test_greedy_accepts_exactly_the_matching_drafts():
    """One-hot p (greedy target) and one-hot q (deterministic draft)."""
    target = np.array([2, 0, 1, 1])  # argmax at each of k+1 = 4 positions
    p = np.eye(V)[target][None]
    for draft, want_n in [([2, 0, 1], 3), ([2, 1, 1], 1), ([0, 0, 1], 0)]:
        q = np.eye(V)[draft][None]
        n, tokens = verify_draft(jax.random.split(jax.random.key(1), 1), jnp.asarray([draft]), jnp.asarray(q), jnp.asarray(p))
        assert int(n[0]) == want_n
        assert np.asarray(tokens)[0, : want_n + 1].tolist() == target[: want_n + 1].tolist()
