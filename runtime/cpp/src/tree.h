// Draft trees (runtime/tree.py, the same names): a slot's drafts are nodes 0..K-1 with parents (-1: the anchor), each
// after its parent, ordered so the first l nodes are a subtree; grid cell 1 + j holds node j at position
// start + depth(j), the target's tree_mask input hiding from each cell the cells that are not its ancestors; the
// accepted path's cache rows move to the positions after the anchor.
#pragma once

#include "sampling.h"

#include <cstdint>
#include <utility>
#include <vector>

namespace specrt {

// depth of each of the first k nodes (the anchor's children: 1)
std::vector<int64_t> depths(const int64_t* parents, int64_t k);

// One slot's rows of the tree_mask input [t, t] (int64): 1 where cell j is not an ancestor of cell c among the
// first `ell` nodes (the anchor, cell 0, is every cell's); rows and columns past them 0.
void fill_mask(const int64_t* parents, int64_t ell, int64_t t, int64_t* out);

// Nodes listed with each parent before its children (parent[j] < j; -1: the anchor), in the order a proposal takes:
// by decreasing survival (stable: a parent, never less likely than its child, stays before it, so a prefix is a
// subtree). Returns (order, parents as positions in that order).
std::pair<std::vector<int64_t>, std::vector<int64_t>> by_survival(const std::vector<double>& survival,
                                                                  const std::vector<int64_t>& parent);

// A walk's outcome: drafts accepted, the path's tokens (accepted drafts, then the bonus) and cells (the anchor's 0,
// then each accepted node's 1 + j).
struct Path {
    int64_t accepted = 0;
    std::vector<int64_t> tokens, cells;
};

// Greedy: from the anchor, the first child (node order) whose token is the target's argmax at the current cell, while
// one is among the first `ell` nodes. logits: [ell + 1, vocab] in cell order.
Path accept_tree(const int64_t* drafts, const int64_t* parents, int64_t ell, const float* logits, int64_t vocab);

// Sampled (SpecInfer's multi-step rule, runtime/acceptance.py accept_tree_sampled): from the anchor, with r the
// target's distribution there, each child in node order (a child drawn from q first) is accepted with probability
// min(1, r(c) / q_c(c)); on rejection r becomes norm(max(0, r - q_c)) (one-hot: r without c); the bonus is drawn
// from r where no child is accepted. `row[j]`: node j's row of q (-1: one-hot, chosen outright). Uniforms: gamma
// acceptance uniforms first (node j reads the j-th), then the bonus's.
Path accept_tree_sampled(const int64_t* drafts, const int64_t* parents, const int64_t* row, int64_t ell,
                         const DraftDist& q, const float* logits, int64_t vocab, const Params& params, Rng& rng,
                         int64_t gamma);

// `lookup`'s continuation (up to `steps` tokens) and up to width - 1 others (up to `branch` tokens each), each after an
// earlier occurrence of the suffix whose next token no chosen continuation starts with, by match length then
// recency; `matched`: the best one's match length (0: none found).
std::vector<std::vector<int64_t>> lookup_tree(const std::vector<int64_t>& history, int64_t max_n, int64_t steps,
                                              int64_t width, int64_t branch, int64_t* matched);

}  // namespace specrt
