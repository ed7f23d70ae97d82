// The round's array steps (runtime/steps.py, the same names): survive, threshold, admission (Algorithm 1), admit,
// cap, accept (greedy). They depend on nothing but their arguments, so a test program links them alone
// (tests/admission_test.cpp); rejection sampling is sampling.cpp's accept_sampled (runtime/acceptance.py).
#pragma once

#include <cstdint>
#include <utility>
#include <vector>

namespace specrt {

// The indices of `values` by decreasing value, ties in index order (a stable argsort of -values).
std::vector<int64_t> descending(const std::vector<double>& values);

// Algorithm 1 on survivals a [n, g] of the `active` rows (runtime/steps.py admission): lengths [n], the round's
// expected committed tokens per ms, and whether a pair was admitted or left out to explore.
struct Admission {
    std::vector<int64_t> lengths;
    double rate = 0.0;
    bool explored = false;
};
Admission admission(const std::vector<float>& a, int64_t n, int64_t g, const std::vector<char>& active, double fixed_ms,
                    const std::vector<double>& verify_ms, const std::vector<char>& explore);

// Survivals a [n, g] with 0 past each row's counts[i] drafts, in place.
void survive(std::vector<float>& a, int64_t g, const std::vector<int64_t>& counts);
// [n] drafts whose prefix survival is at least `cut` (the threshold scheduler).
std::vector<int64_t> threshold(const std::vector<float>& a, int64_t n, int64_t g, float cut);
// sps-async's cut: per row of survivals a [n, g], how many of the `budget` best (row, k) pairs of the active rows
// fall in it (ties: the lower flat index; pairs with survival 0 never).
std::vector<int64_t> admit(const std::vector<float>& a, int64_t n, int64_t g, const std::vector<char>& active,
                           int64_t budget);
// One slot's verify length: min(planned, count, gamma, budget - 1) (the bonus token is always committed).
int64_t cap(int64_t planned, int64_t count, int64_t budget, int64_t gamma);
// Greedy acceptance of one slot's drafts against its verify rows logits [len(drafts) + 1, vocab]: the drafts
// accepted (the longest prefix equal to the argmax before each) and the bonus (the argmax after them).
std::pair<int64_t, int64_t> accept(const std::vector<int64_t>& drafts, const float* logits, int64_t vocab);

}  // namespace specrt
