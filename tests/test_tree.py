"""Draft trees (runtime/tree.py): the tree's mask, positions and greedy walk; multi-draft rejection sampling that
commits tokens from the target's distribution exactly; and the engine's tree rounds, whose greedy output is plain
decoding's and whose sampled output follows the target's distribution."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from specrt import artifact as io
from specrt.artifact import ExportSettings
from specrt.exporter.export import export_artifact
from specrt.runtime import tree
from specrt.runtime.acceptance import accept_tree_sampled
from specrt.runtime.backends import load_runner
from specrt.runtime.calls import target as target_calls
from specrt.runtime.config import EngineConfig
from specrt.runtime.drafters import NGramDrafter, Proposal, lookup_match, lookup_tree
from specrt.runtime.engine import Engine, Request
from specrt.runtime.sampling import SamplingParams, distribution
from power import ALPHA, samples_for
from test_acceptance import _chi2_matches
from test_speculative import _exact_pair_probs, _prompts, _pvalue, peaked  # noqa: F401 (peaked: a fixture)

# anchor -> 0 (10) -> 2 (30) -> 4 (50);  anchor -> 1 (20) -> 3 (40)
TOKENS = np.array([10, 20, 30, 40, 50])
PARENTS = np.array([-1, -1, 0, 1, 2])


def test_a_trees_depths_positions_and_mask():
    assert tree.depths(PARENTS).tolist() == [1, 1, 2, 2, 3]
    assert tree.positions(np.array([7]), PARENTS[None], 6).tolist() == [[7, 8, 8, 9, 9, 10]]
    out = np.full((2, 6, 6), 9, np.int64)
    tree.mask(PARENTS[None], np.array([5]), 6, out)
    sees = out[0] == 0
    assert [np.flatnonzero(row).tolist() for row in sees] == [[0], [0, 1], [0, 2], [0, 1, 3], [0, 2, 4], [0, 1, 3, 5]]
    assert (out[1] == 0).all()  # rows past the slots: chains
    tree.mask(PARENTS[None], np.array([2]), 6, out)  # only the first two nodes admitted: the rest as chains
    assert [np.flatnonzero(row[:3]).tolist() for row in (out[0] == 0)[:3]] == [[0], [0, 1], [0, 2]]
    assert tree.is_chain(tree.chain(5)[None], np.array([5]))
    assert tree.is_chain(PARENTS[None], np.array([1])) and not tree.is_chain(PARENTS[None], np.array([2]))


def test_greedy_walks_the_branch_the_target_takes():
    def walk(best, length=5):
        drafts = np.zeros((1, 5), np.int64)
        drafts[0] = TOKENS
        a, tokens, cells = tree.accept(drafts, np.array([best]), PARENTS[None], np.array([length]))
        return int(a[0]), tokens[0, :a[0] + 1].tolist(), cells[0, :a[0] + 1].tolist()

    # cells: anchor 0, then node j at j + 1; best[c] is the target's token after cell c
    assert walk([20, 0, 40, 0, 7, 0]) == (2, [20, 40, 7], [0, 2, 4])  # the second branch, to its end
    assert walk([10, 30, 0, 50, 0, 8]) == (3, [10, 30, 50, 8], [0, 1, 3, 5])  # the first, every node
    assert walk([10, 31, 0, 0, 0, 0]) == (1, [10, 31], [0, 1])  # a mismatch inside the first branch
    assert walk([99, 0, 0, 0, 0, 0]) == (0, [99], [0])  # no child matches: the target's token
    assert walk([20, 0, 40, 0, 7, 0], length=1) == (0, [20], [0])  # node 1 not admitted
    moves = tree.moves(np.array([[0, 2, 4, 0], [0, 1, 2, 0]]), np.array([2, 2]), np.array([30, 50]))
    assert [(i, s.tolist(), d.tolist()) for i, s, d in moves] == [(0, [32, 34], [31, 32])]  # slot 1: already a chain


def test_lookup_tree_adds_continuations_with_other_first_tokens():
    history = np.array([5, 1, 2, 9, 5, 3, 4, 7, 5, 1, 8, 6, 5])
    follows, n = lookup_tree(history, 3, 4, 3, 2)
    best, best_n = lookup_match(history, 3, 4)
    assert follows[0].tolist() == best.tolist() and n == best_n  # the chain's lookup first
    assert [f.tolist() for f in follows] == [[1, 8, 6, 5], [3, 4]]  # 5 -> 1 twice: one branch per first token
    assert lookup_tree(history, 3, 4, 1, 2)[0][0].tolist() == best.tolist()
    assert lookup_tree(np.array([1, 2, 3]), 3, 4, 3, 2) == ([], 0)


def test_ngram_trees_order_nodes_by_survival_parents_first():
    class Slot:
        def history(self):
            return np.array([5, 1, 2, 9, 5, 3, 4, 7, 5, 6, 8, 6, 5])

    d = NGramDrafter(4, width=3, branch=2)
    p = d.propose([Slot(), None])
    k = int(p.counts[0])
    assert k == 4 + 2 + 2 and p.counts[1] == 0
    s, parents = p.survival[0, :k], p.parents[0, :k]
    assert (np.diff(s) <= 0).all()  # a prefix of the nodes is the likeliest subtree
    assert all(parents[j] < j for j in range(k))
    assert sorted(p.tokens[0, j] for j in range(k) if parents[j] == -1) == [1, 3, 6]


@pytest.mark.parametrize("sampled_first, swap", [(False, False), (True, False), (True, True)],
                         ids=["one-hot", "q-sampled-first", "q-sampled-second-in-node-order"])
@pytest.mark.parametrize("params", [SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, top_k=6)],
                         ids=["t1", "topk"])
def test_tree_rejection_sampling_commits_tokens_from_the_target_distribution(sampled_first, swap, params):
    """Two branches under the anchor (one drawn from q, or both chosen outright) and one node under each: the first
    committed token follows p at the anchor, and the next one p at the cell of the branch it took. `swap`: the
    chosen branch comes first in node order (the drawn one is still tried first)."""
    rng = np.random.default_rng(7)
    vocab, trials = 8, 20_000
    logits = rng.normal(size=(5, vocab)) * 1.5  # cells: anchor, then nodes 0..3
    p = [distribution(row, params) for row in logits]
    x = np.exp(rng.normal(size=vocab))
    q0 = x / x.sum()
    parents = np.array([-1, -1, 0, 1])
    first, after = [], {0: [], 1: []}
    for _ in range(trials):
        # the second child: chosen, not drawn (from what remains of p after q's draft, so both branches are taken)
        ranked = np.argsort(-(np.clip(p[0] - q0, 0, None) if sampled_first else p[0]), kind="stable")
        d0 = int(rng.choice(vocab, p=q0)) if sampled_first else int(ranked[0])
        d1 = int(next(t for t in ranked if t != d0))
        drafts = np.array([d0, d1, 3, 5])
        probs = np.zeros((4, vocab))
        if sampled_first:
            probs[0] = q0
        if swap:  # node 0 <-> node 1 (and their children): the cells' logits move with them
            drafts, probs = drafts[[1, 0, 3, 2]], probs[[1, 0, 3, 2]]
            v, cells = accept_tree_sampled(drafts, parents, probs, logits[[0, 2, 1, 4, 3]], params, rng, gamma=4)
            cells = [{1: 2, 2: 1, 3: 4, 4: 3}.get(c, c) for c in cells]  # back to the unswapped cells
            drafts = drafts[[1, 0, 3, 2]]
        else:
            v, cells = accept_tree_sampled(drafts, parents, probs, logits, params, rng, gamma=4)
        tokens = [int(drafts[c - 1]) for c in cells[1:]] + [v.bonus]
        assert v.accepted == len(cells) - 1
        first.append(tokens[0])
        if len(tokens) > 1:
            after[cells[1] - 1].append(tokens[1])  # the token after node 0 (cell 1) or node 1 (cell 2)
    assert _chi2_matches(np.array(first), p[0]) > ALPHA
    assert len(after[0]) > 500 and len(after[1]) > 500  # both branches were taken often
    assert _chi2_matches(np.array(after[0]), p[1]) > ALPHA
    assert _chi2_matches(np.array(after[1]), p[2]) > ALPHA


# -- the engine ------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny(tiny_model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("tree")
    target = tiny_model_dir("llama", num_layers=2)
    return export_artifact(target, root / "art", ExportSettings(batch=4, max_seq=256, prefill_chunk=16, verify_len=6,
                                                                attention="cpu"), progress=False)


def test_a_tree_verify_gives_each_node_its_paths_decoded_row(tiny):
    """One call over a tree's nodes (each at its depth's position, masked to its ancestors) gives each node the
    logits decoding its path gives (the stock kernels: up to float rounding)."""
    runner = load_runner("ort", tiny, io.load_manifest(tiny), io.TARGET, threads=1)
    runner.allocate(2)
    prompt = np.arange(3, 14)
    for _ in target_calls.run_prefill(runner, 0, prompt):
        pass
    bucket = runner.spec.bucket("verify", B=1, T=6, P=6)
    feeds = runner.inputs(0, bucket)
    target_calls.grid(feeds, np.array([7]), np.array([len(prompt)]), TOKENS[None], io.dense_rows(bucket))
    feeds[io.POSITION_IDS][...] = tree.positions(np.array([len(prompt)]), PARENTS[None], 6)
    tree.mask(PARENTS[None], np.array([5]), 6, feeds[io.TREE_MASK])
    tree_logits = runner.run(0, bucket)[io.LOGITS].copy()
    for cell, path in enumerate([[], [10], [20], [10, 30], [20, 40], [10, 30, 50]]):
        for _ in target_calls.run_prefill(runner, 1, prompt):
            pass
        for i, tok in enumerate([7, *path]):
            b = runner.spec.bucket("decode", B=1)
            f = runner.inputs(1, b)
            target_calls.grid(f, np.array([tok]), np.array([len(prompt) + i]), None, io.dense_rows(b))
            decoded = runner.run(1, b)[io.LOGITS][0]
        np.testing.assert_allclose(tree_logits[cell], decoded, rtol=1e-5, atol=1e-5, err_msg=f"cell {cell}")


class Oracle(NGramDrafter):
    """Proposes, under each anchor, a wrong branch first and then the continuation plain decoding will take (known
    from an AR run): every round accepts a path through the second branch, whose cache rows must move."""

    def __init__(self, steps: int, continuations: dict[tuple, list[int]]) -> None:
        super().__init__(steps, width=2)
        self.continuations = continuations

    def propose(self, slots):
        n = len(slots)
        tokens, counts = np.zeros((n, self.nodes), np.int64), np.zeros(n, np.int64)
        parents = np.tile(np.arange(self.nodes) - 1, (n, 1))
        for i, s in enumerate(slots):
            if s is None:
                continue
            h = s.history().tolist()
            full = next(f for key, f in self.continuations.items() if h == f[:len(h)])
            ahead = full[len(h):len(h) + 3]
            if not ahead:
                continue
            wrong = [(t + 1) % 256 for t in ahead]
            # wrong[0] (anchor), right[0] (anchor), wrong[1] (after wrong[0]), right[1..] (after right[k-1])
            nodes = [(wrong[0], -1), (ahead[0], -1)] + ([(wrong[1], 0)] if len(wrong) > 1 else [])
            last = 1
            for t in ahead[1:]:
                nodes.append((t, last))
                last = len(nodes) - 1
            for j, (t, par) in enumerate(nodes):
                tokens[i, j], parents[i, j] = t, par
            counts[i] = len(nodes)
        survival = np.tile(np.linspace(0.9, 0.5, self.nodes), (n, 1)).astype(np.float32)
        return Proposal(tokens=tokens, counts=counts, probs=None, survival=survival, parents=parents)

    def observe(self, slot, verified, accepted, path=None):
        assert verified < 2 or (path is not None and (accepted == 0 or path[1] == 2))


def test_greedy_tree_rounds_keep_the_accepted_branchs_cache_rows(tiny):
    """Rounds whose accepted path is always the second branch (its K/V rows moved after the anchor's) give plain
    decoding's tokens; and n-gram trees too."""
    rng = np.random.default_rng(3)
    prompts = [rng.integers(3, 256, 9).tolist() for _ in range(3)]
    params = SamplingParams(max_new_tokens=24, ignore_eos=True)
    ar, _ = Engine(tiny, EngineConfig(threads=1)).generate([Request(prompt_ids=p, params=params, id=i) for i, p in enumerate(prompts)])
    continuations = {tuple(p): p + o.output_ids for p, o in zip(prompts, ar)}
    engine = Engine(tiny, EngineConfig(method="ngram", tree=2, threads=1))
    oracle = Oracle(engine.model_runner.executor.gamma, continuations)
    engine.model_runner.drafter = engine.model_runner.executor.drafter = oracle
    moved = []
    runner = engine.model_runner.target
    original = runner.move_rows
    runner.move_rows = lambda moves: (moved.append(len(moves)), original(moves))
    outs, stats = engine.generate([Request(prompt_ids=p, params=params, id=i) for i, p in enumerate(prompts)])
    assert [o.output_ids for o in outs] == [o.output_ids for o in ar]
    assert sum(moved) > 10 and sum(a for _, a, _ in stats.rounds) > 20
    grams, _ = Engine(tiny, EngineConfig(method="ngram", tree=3, threads=1)).generate(
        [Request(prompt_ids=p, params=params, id=i) for i, p in enumerate(prompts)])
    assert [o.output_ids for o in grams] == [o.output_ids for o in ar]


def test_tree_needs_ngram_the_host_and_a_tree_target(tiny, tmp_path):
    from specrt.errors import SpecrtError

    with pytest.raises(SpecrtError, match="--tree drafts trees of n-gram lookups or of a DSpark head"):
        EngineConfig(method="mtp", tree=2)
    with pytest.raises(SpecrtError, match="--tree must be between 1 and 8"):
        EngineConfig(method="ngram", tree=0)
    with pytest.raises(SpecrtError, match="not the torch backend"):
        EngineConfig(method="ngram", tree=2, backend="torch")


@pytest.fixture(scope="module")
def peaked_long(peaked, tmp_path_factory):
    """test_speculative's peaked 32-token model, with room for a prompt in which every token has two followers."""
    return export_artifact(peaked["target"], tmp_path_factory.mktemp("peaked_tree") / "art",
                           ExportSettings(batch=32, max_seq=160, prefill_chunk=32, verify_len=4, attention="cpu"),
                           progress=False)


def test_sampled_tree_rounds_follow_the_target_distribution(peaked, peaked_long, monkeypatch):
    """(first, second) generated tokens follow p(x1) p(x2 | x1) exactly when the second comes from a tree round:
    every token of the prompt is followed once by t + 1 and once by t + 11, so the lookup after any x1 has two
    continuations with different first tokens."""
    prompt = [x for t in range(32) for x in (t, (t + 1) % 32, t, (t + 11) % 32)][:120]
    params = SamplingParams(temperature=1.0, max_new_tokens=5, seed=21, ignore_eos=True)  # room for 3 nodes
    probs = _exact_pair_probs(peaked["target"], prompt, params)
    n = samples_for(probs)
    engine = Engine(peaked_long, EngineConfig(method="ngram", tree=3, threads=1))
    masked, mask = [], tree.mask
    monkeypatch.setattr(tree, "mask", lambda parents, lengths, *a: (masked.append(int((lengths > 0).sum())),
                                                                     mask(parents, lengths, *a)))
    outs, _ = engine.generate([Request(prompt_ids=prompt, params=params, id=i) for i in range(n)])
    pairs = np.array([o.output_ids[:2] for o in outs])
    assert _pvalue(pairs, probs) > ALPHA
    assert sum(masked) > n  # tree verifies: every request's first round, and more



def test_graft_puts_a_heads_alternatives_beside_its_first_draft():
    tokens, counts = np.array([[5, 6, 7], [1, 2, 3]]), np.array([3, 0])
    survival = np.array([[0.6, 0.3, 0.1], [0.9, 0.8, 0.7]], np.float32)
    top = np.array([[5, 9, 8, 4], [1, 2, 3, 4]])
    probs = np.array([[0.5, 0.2, 0.1, 0.05], [0.4, 0.3, 0.2, 0.1]], np.float32)
    t, c, s, parents, chain = tree.graft(tokens, counts, survival, top, probs, 3)
    # alternatives 9 and 8: (1 - 0.6) x 0.2 / 0.5 = 0.16 and 0.08, in order of survival among the chain's
    assert t[0, :5].tolist() == [5, 6, 9, 7, 8] and c.tolist() == [5, 0]
    assert parents[0, :5].tolist() == [-1, 0, -1, 1, -1] and chain[0, :5].tolist() == [0, 1, -1, 2, -1]
    np.testing.assert_allclose(s[0], [0.6, 0.3, 0.16, 0.1, 0.08], rtol=1e-6)
    no_alts = tree.graft(tokens, counts, survival, np.full((2, 4), -1), probs, 3)  # a row drafted by lookups
    assert no_alts[0][0, :3].tolist() == [5, 6, 7] and no_alts[1].tolist() == [3, 0]


@pytest.fixture(scope="module")
def dspark_wide(tiny_model_dir, peaked, tmp_path_factory):
    """Random DSpark heads (block 3) in artifacts that verify up to 5 drafts: rounds with every draft admitted (the
    fixed scheduler) verify the block and two alternatives. A tiny llama's, and the peaked 32-token model's."""
    from specrt.exporter.loaders.deepspec import random_dspark_checkpoint

    root = tmp_path_factory.mktemp("dspark_wide")
    target = tiny_model_dir("llama", num_layers=3)
    draft = random_dspark_checkpoint(root / "draft", target, layers=1, block_size=3, markov_rank=16)
    peaked_draft = random_dspark_checkpoint(root / "peaked_draft", peaked["target"], layers=1, block_size=3,
                                            markov_rank=8, init_std=0.5)
    return {"tiny": export_artifact(target, root / "tiny", ExportSettings(batch=4, max_seq=160, prefill_chunk=16,
                                                                         verify_len=6), draft=draft, progress=False),
            "peaked": export_artifact(peaked["target"], root / "peaked",
                                      ExportSettings(batch=32, max_seq=32, prefill_chunk=8, verify_len=6),
                                      draft=peaked_draft, progress=False)}


def test_dspark_trees_give_plain_decodings_tokens(dspark_wide, monkeypatch):
    art = dspark_wide["tiny"]
    prompts = _prompts(256, [5, 9, 14, 20])
    params = SamplingParams(max_new_tokens=32, ignore_eos=True)
    requests = [Request(prompt_ids=p, params=params, id=i) for i, p in enumerate(prompts)]
    ar, _ = Engine(art, EngineConfig(threads=1)).generate(requests)
    masked, mask = [], tree.mask
    monkeypatch.setattr(tree, "mask", lambda *a: (masked.append(1), mask(*a)))
    for method, scheduler in (("dspark", "fixed"), ("dspark", "sps"), ("dspark+ngram", "sps")):
        engine = Engine.open(art, EngineConfig(method=method, scheduler=scheduler, tree=3, threads=1))  # a profile
        outs, _ = engine.generate(requests)
        assert [o.output_ids for o in outs] == [o.output_ids for o in ar], (method, scheduler)
        if scheduler == "fixed":  # every draft and both alternatives admitted: every round a tree
            assert len(masked) > 10, len(masked)


def test_sampled_dspark_tree_rounds_follow_the_target_distribution(peaked, dspark_wide, monkeypatch):
    """A random DSpark head's block with its two likeliest other first tokens grafted beside the first draft (drawn
    from q: tried first, SpecInfer's rule): (x1, x2) follow p(x1) p(x2 | x1) exactly."""
    prompt = [5, 9, 14, 3]
    params = SamplingParams(temperature=1.0, max_new_tokens=4, seed=31, ignore_eos=True)
    probs = _exact_pair_probs(peaked["target"], prompt, params)
    n = samples_for(probs)
    masked, mask = [], tree.mask
    monkeypatch.setattr(tree, "mask", lambda *a: (masked.append(1), mask(*a)))
    engine = Engine(dspark_wide["peaked"], EngineConfig(method="dspark", scheduler="fixed", tree=3, threads=1))
    outs, _ = engine.generate([Request(prompt_ids=prompt, params=params, id=i) for i in range(n)])
    assert _pvalue(np.array([o.output_ids[:2] for o in outs]), probs) > ALPHA
    assert len(masked) > 10
