#include "tree.h"

#include <algorithm>
#include <numeric>
#include <set>

namespace specrt {

std::vector<int64_t> depths(const int64_t* parents, int64_t k) {
    std::vector<int64_t> d(k);
    for (int64_t j = 0; j < k; ++j) d[j] = parents[j] < 0 ? 1 : d[parents[j]] + 1;
    return d;
}

void fill_mask(const int64_t* parents, int64_t ell, int64_t t, int64_t* out) {
    std::fill_n(out, t * t, 0);
    // seen[c * t + j]: cell c sees cell j (its ancestors and itself)
    std::vector<char> seen(t * t, 0);
    seen[0] = 1;
    for (int64_t j = 0; j < ell; ++j) {
        const int64_t c = j + 1, from = parents[j] + 1;
        std::copy_n(seen.begin() + from * t, t, seen.begin() + c * t);
        seen[c * t + c] = 1;
    }
    for (int64_t c = 0; c <= ell; ++c)
        for (int64_t j = 0; j <= ell; ++j) out[c * t + j] = !seen[c * t + j];
}

std::pair<std::vector<int64_t>, std::vector<int64_t>> by_survival(const std::vector<double>& survival,
                                                                  const std::vector<int64_t>& parent) {
    const int64_t k = static_cast<int64_t>(survival.size());
    std::vector<int64_t> order(k), at(k), up(k);
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return survival[a] > survival[b]; });
    for (int64_t j = 0; j < k; ++j) at[order[j]] = j;
    for (int64_t j = 0; j < k; ++j) up[j] = parent[order[j]] >= 0 ? at[parent[order[j]]] : -1;
    return {order, up};
}

Path accept_tree(const int64_t* drafts, const int64_t* parents, int64_t ell, const float* logits, int64_t vocab) {
    Path path;
    path.cells.push_back(0);
    int64_t cur = 0;
    while (true) {
        const int64_t want = argmax(logits + cur * vocab, vocab);
        int64_t hit = -1;
        for (int64_t j = 0; j < ell && hit < 0; ++j)
            if (parents[j] == cur - 1 && drafts[j] == want) hit = j;
        path.tokens.push_back(want);
        if (hit < 0) break;
        cur = hit + 1;
        path.cells.push_back(cur);
        ++path.accepted;
    }
    return path;
}

Path accept_tree_sampled(const int64_t* drafts, const int64_t* parents, const int64_t* row, int64_t ell,
                         const DraftDist& q, const float* logits, int64_t vocab, const Params& params, Rng& rng,
                         int64_t gamma) {
    std::vector<double> u(std::max(gamma, ell));
    for (double& x : u) x = rng.uniform();
    const double v = rng.uniform();
    auto sampled = [&](int64_t j) { return q.probs && row && row[j] >= 0; };
    Path path;
    path.cells.push_back(0);
    int64_t cur = 0;
    while (true) {
        std::vector<double> r = distribution(logits + cur * vocab, vocab, params);
        std::vector<int64_t> children;
        for (int64_t j = 0; j < ell; ++j)
            if (parents[j] == cur - 1) children.push_back(j);
        std::stable_partition(children.begin(), children.end(), sampled);  // a child drawn from q is tried first
        bool moved = false;
        for (int64_t j : children) {
            const int64_t d = drafts[j];
            const double qd = sampled(j) ? q.at(row[j], d) : 1.0;
            if (u[j] * qd < r[d]) {
                cur = j + 1;
                moved = true;
                path.cells.push_back(cur);
                path.tokens.push_back(d);
                ++path.accepted;
                break;
            }
            if (!sampled(j)) {
                r[d] = 0.0;
            } else {
                const float* p = q.probs + row[j] * q.width;
                for (int64_t c = 0; c < q.width; ++c)
                    r[q.vocab_ids && !q.vocab_ids->empty() ? (*q.vocab_ids)[c] : c] -= p[c];
                for (double& x : r) x = std::max(0.0, x);
            }
            double mass = 0.0;
            for (double x : r) mass += x;
            if (mass <= 1e-12) {  // nothing left to draw (q covered r): the target's own distribution, as a chain's
                r = distribution(logits + cur * vocab, vocab, params);
                break;
            }
            for (double& x : r) x /= mass;
        }
        if (!moved) {
            path.tokens.push_back(draw(r, v));
            return path;
        }
    }
}

std::vector<std::vector<int64_t>> lookup_tree(const std::vector<int64_t>& history, int64_t max_n, int64_t steps,
                                              int64_t width, int64_t branch, int64_t* matched) {
    const int64_t size = static_cast<int64_t>(history.size());
    *matched = 0;
    std::vector<int64_t> ends;  // earlier occurrences of the last token, each followed by one
    for (int64_t j = 0; j + 1 < size; ++j)
        if (history[j] == history[size - 1]) ends.push_back(j);
    if (ends.empty()) return {};
    const int64_t top = std::min(max_n, size - 1);
    std::vector<int64_t> n(ends.size());
    for (size_t e = 0; e < ends.size(); ++e) {  // each candidate's match, grown backwards
        int64_t m = 1;
        while (m < top && ends[e] >= m && history[ends[e] - m] == history[size - 1 - m]) ++m;
        n[e] = m;
    }
    std::vector<size_t> order(ends.size());
    std::iota(order.begin(), order.end(), 0);
    std::sort(order.begin(), order.end(), [&](size_t a, size_t b) {  // longest match first, then the latest
        return n[a] != n[b] ? n[a] > n[b] : ends[a] > ends[b];
    });
    auto follow = [&](int64_t end, int64_t count) {
        return std::vector<int64_t>(history.begin() + end + 1, history.begin() + std::min(size, end + 1 + count));
    };
    std::vector<std::vector<int64_t>> follows{follow(ends[order[0]], steps)};
    std::set<int64_t> firsts{history[ends[order[0]] + 1]};
    for (size_t k = 1; k < order.size() && static_cast<int64_t>(follows.size()) < width; ++k) {
        const int64_t j = ends[order[k]];
        if (firsts.insert(history[j + 1]).second) follows.push_back(follow(j, branch));
    }
    *matched = n[order[0]];
    return follows;
}

}  // namespace specrt
