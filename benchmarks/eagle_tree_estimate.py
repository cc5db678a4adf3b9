"""Would a static token tree pay? Tokens per target call of EAGLE chains vs trees, teacher-forced.

    python benchmarks/eagle_tree_estimate.py [--new-tokens 96]

The shipped EAGLE head (checkpoints/smollm2_eagle) over the target's own greedy answers to
`speculative.py`'s chat and copy prompts (chat template). At every answer position p the head
is unrolled as drafting unrolls it (`ttt_logits`: draft depth d reads pair p + d, its own
predicted features, the true tokens before it); a tree of widths (w_1, w_2, ...) keeps the head's
top-w_d tokens at depth d under the path the target takes, so greedy verification accepts depth d
when the target's token is among them and all shallower depths were accepted. Chains are widths
(1, ..., 1). Tokens per call = 1 + accepted depths, averaged over positions: what a greedy verify
of that tree would emit, with no engine in the loop (the engine's k = 1 acceptance equals this
estimate's depth 1: BENCHMARKS.md, 2026-12-06 22:25). `nodes` = draft tokens the target verifies.
Last line: JSON {"chat": {shape: [tokens_per_call, nodes]}, "copy": {...}, "top_w": {...}}.
"""

from __future__ import annotations

import argparse
import json

import numpy as np

from speculative import PROMPT_SETS

SHAPES = ((1,), (1, 1), (1, 1, 1), (2,), (3,), (4,), (2, 1), (3, 1), (4, 1), (2, 1, 1), (3, 1, 1),
          (2, 2), (3, 2), (2, 2, 1), (3, 2, 1), (4, 2, 1), (4, 2, 2))
TOP = 8  # ranks kept per depth


def teacher_ranks(model, head, prompts, new_tokens: int) -> tuple[np.ndarray, np.ndarray]:
    """i32[depth, N, T]: rank of the target's greedy token in the head's logits at draft depth
    d for pair t (TOP when outside the head's top TOP), and bool[N, T]: pairs predicting answers."""
    import jax.numpy as jnp

    from jaxinfer.speculative.train.data import generate_sequences
    from jaxinfer.speculative.train.eagle import pair_targets, teacher_features, ttt_logits

    seqs, plens, pidx = generate_sequences(model, prompts, new_tokens, [0.0], 0, chat=True, max_slots=len(prompts))
    data = teacher_features(model, seqs, plens, pidx, top_k=TOP, feature_layers=head.feature_layers)
    t = pair_targets(data, np.arange(len(seqs)), head.vocab_ids, model.config.vocab_size)
    depth = max(len(s) for s in SHAPES)
    ranks = []
    for logits in ttt_logits(head.params, head.embed, head.lm_head, head.config, jnp.asarray(t["tokens"]),
                             jnp.asarray(t["features"], jnp.float32), depth):
        ids = head.vocab_ids[np.argsort(-np.asarray(logits), axis=-1)[..., :TOP]]  # [N, T, TOP]
        hit = ids == t["teacher_top1"][..., None]
        ranks.append(np.where(hit.any(-1), hit.argmax(-1), TOP))
    return np.stack(ranks), t["answer"].astype(bool)


def tokens_per_call(ranks: np.ndarray, answer: np.ndarray, widths: tuple[int, ...]) -> float:
    n, t = answer.shape
    total = 0
    for d, w in enumerate(widths):  # depth d is accepted where depths < d were and pair p + d's rank < w
        ok = np.zeros((n, t), bool)
        ok[:, : t - d] = (ranks[d][:, d:] < w) & answer[:, d:]
        alive = ok if d == 0 else alive & ok
        total += (alive & answer).sum()
    return 1 + total / answer.sum()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--new-tokens", type=int, default=96)
    args = ap.parse_args()

    from jaxinfer.loading import load_model
    from jaxinfer.speculative.eagle.checkpoint import load_eagle_head

    model = load_model(progress=False)
    head = load_eagle_head(model)
    result: dict = {"top_w": {}}
    for name, prompts in PROMPT_SETS.items():
        ranks, answer = teacher_ranks(model, head, prompts, args.new_tokens)
        rows = {}
        for shape in SHAPES:
            nodes = sum(int(np.prod(shape[: d + 1])) for d in range(len(shape)))
            rows[str(shape)] = [round(float(tokens_per_call(ranks, answer, shape)), 3), nodes]
            print(f"{name:5s} widths {str(shape):10s} nodes {nodes:3d}  tokens/call {rows[str(shape)][0]:.3f}")
        result[name] = rows
        for d in range(len(ranks)):
            for w in (1, 2, 3, 4, 8):
                hits = ((ranks[d][:, d:] < w) & answer[:, d:]).sum() / answer[:, d:].sum()
                result["top_w"][f"{name}_depth{d + 1}_top{w}"] = round(float(hits), 3)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
