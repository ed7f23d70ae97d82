// Rejection sampling in isolation (src/sampling.cpp accept_sampled), as tests/test_acceptance.py checks the Python
// one: random target logits [gamma + 1, vocab], a draft distribution q ("good": close to the target, "bad":
// unrelated, "disjoint": only tokens the target never emits, "onehot": fixed drafts), `trials` rounds; prints JSON
// with the logits, q and the counts of the first and second committed tokens, for tests/test_cpp.py to compare with
// the target's exact distribution (chi-square).
// A draft tree (src/tree.cpp accept_tree_sampled; "tree-onehot", "tree-sampled"): two branches under the anchor, one
// node under each (nodes A, B, A's child, B's child at cells 1..4); "tree-onehot": all chosen outright (the target's
// two likeliest first tokens), "tree-sampled": A and its child drawn from q, B and its child chosen. The counts of
// the second token are kept per branch the first one took ("second" after A, "second_b" after B).
//   acceptance_test KIND TEMPERATURE TOP_K TOP_P [TRIALS] [SEED]
#include "sampling.h"
#include "tree.h"

#include <cstdio>
#include <cstdlib>
#include <string>

using namespace specrt;

int main(int argc, char** argv) {
    if (argc < 5) {
        std::fprintf(stderr, "usage: acceptance_test good|bad|disjoint|onehot|tree-onehot|tree-sampled TEMPERATURE TOP_K TOP_P [TRIALS] [SEED]\n");
        return 2;
    }
    const std::string kind = argv[1];
    Params params;
    params.temperature = std::atof(argv[2]);
    params.top_k = std::atoll(argv[3]);
    params.top_p = std::atof(argv[4]);
    const int64_t trials = argc > 5 ? std::atoll(argv[5]) : 20000, vocab = 12, gamma = 3;
    std::mt19937_64 gen(argc > 6 ? std::atoll(argv[6]) : 1234);
    std::normal_distribution<double> normal;
    std::vector<float> logits((gamma + 1) * vocab);
    for (float& x : logits) x = static_cast<float>(normal(gen) * 1.5);
    std::vector<std::vector<double>> p, q;
    for (int64_t k = 0; k <= gamma; ++k) p.push_back(distribution(logits.data() + k * vocab, vocab, params));
    for (int64_t k = 0; k < gamma; ++k) {
        std::vector<double> row(vocab);
        double sum = 0;
        for (int64_t t = 0; t < vocab; ++t) {
            if (kind == "good" || kind == "tree-sampled") row[t] = 0.8 * p[k][t] + 0.2 / vocab;
            else if (kind == "bad") row[t] = std::exp(normal(gen) * 2.0);
            else row[t] = p[k][t] == 0.0;
            sum += row[t];
        }
        for (double& x : row) x /= sum;
        q.push_back(row);
    }
    std::vector<float> qf;
    for (auto& row : q) qf.insert(qf.end(), row.begin(), row.end());
    DraftDist dist{kind == "onehot" ? nullptr : qf.data(), vocab, nullptr, nullptr};
    Rng rng(99);
    std::vector<int64_t> first(vocab), second(vocab), second_b(vocab);
    int64_t accepted = 0, seconds = 0;
    if (kind.rfind("tree-", 0) == 0) {
        const bool sampled = kind == "tree-sampled";
        const int64_t parents[4] = {-1, -1, 0, 1}, rows[4] = {0, -1, 1, -1};
        auto best_but = [&](const float* row, int64_t skip) {  // the likeliest token other than `skip`
            std::vector<float> r(row, row + vocab);
            if (skip >= 0) r[skip] = -1e30f;
            return argmax(r.data(), vocab);
        };
        DraftDist tq{qf.data(), vocab, nullptr, nullptr};
        for (int64_t i = 0; i < trials; ++i) {
            int64_t drafts[4];
            drafts[0] = sampled ? draw(q[0], rng.uniform()) : argmax(logits.data(), vocab);
            drafts[1] = best_but(logits.data(), drafts[0]);
            drafts[2] = sampled ? draw(q[1], rng.uniform()) : argmax(logits.data() + vocab, vocab);
            drafts[3] = argmax(logits.data() + 2 * vocab, vocab);
            std::vector<float> cells(logits.begin(), logits.begin() + 3 * vocab);  // anchor, A, B, then A's and
            cells.resize(5 * vocab, 0.0f);                                         // B's children's rows
            Path path = accept_tree_sampled(drafts, parents, sampled ? rows : nullptr, 4, sampled ? tq : DraftDist{},
                                            cells.data(), vocab, params, rng, gamma + 1);
            ++first[path.tokens[0]];
            if (path.accepted) {
                ++(path.cells[1] == 1 ? second : second_b)[path.tokens[1]];
                ++seconds;
            }
            accepted += path.accepted;
        }
    }
    for (int64_t i = 0; i < (kind.rfind("tree-", 0) == 0 ? 0 : trials); ++i) {
        std::vector<int64_t> drafts(gamma);
        if (kind == "onehot") {  // a likely and a less likely draft, then the likeliest
            drafts = {argmax(logits.data(), vocab), 0, argmax(logits.data() + 2 * vocab, vocab)};
            std::vector<float> second_row(logits.begin() + vocab, logits.begin() + 2 * vocab);
            second_row[argmax(second_row.data(), vocab)] = -1e30f;
            drafts[1] = argmax(second_row.data(), vocab);
        } else {
            for (int64_t k = 0; k < gamma; ++k) drafts[k] = draw(q[k], rng.uniform());
        }
        auto [a, bonus] = accept_sampled(drafts, dist, logits.data(), vocab, params, rng, gamma);
        std::vector<int64_t> tokens(drafts.begin(), drafts.begin() + a);
        tokens.push_back(bonus);
        ++first[tokens[0]];
        if (tokens.size() > 1) {
            ++second[tokens[1]];
            ++seconds;
        }
        accepted += a;
    }
    auto list = [](const auto& v) {
        std::string s = "[";
        char buf[32];
        for (size_t i = 0; i < v.size(); ++i) {
            std::snprintf(buf, sizeof(buf), "%.9g", static_cast<double>(v[i]));  // float logits round-trip
            s += (i ? ", " : "") + std::string(buf);
        }
        return s + "]";
    };
    std::printf("{\"logits\": %s, \"first\": %s, \"second\": %s, \"second_b\": %s, \"mean_accepted\": %.6f}\n",
                list(logits).c_str(), list(first).c_str(), list(second).c_str(), list(second_b).c_str(),
                static_cast<double>(accepted) / trials);
    return 0;
}
