// The round's array steps that depend on nothing but their arguments (runtime/steps.py): Algorithm 1's admission and
// the order it takes pairs in. Kept apart from round.cpp so that a test program links them alone
// (tests/admission_test.cpp).
#pragma once

#include <cstdint>
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

}  // namespace specrt
