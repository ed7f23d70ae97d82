#include "steps.h"

#include <algorithm>
#include <numeric>

namespace specrt {

void survive(std::vector<float>& a, int64_t g, const std::vector<int64_t>& counts) {
    for (size_t i = 0; i < counts.size(); ++i)
        for (int64_t k = std::max<int64_t>(counts[i], 0); k < g; ++k) a[i * g + k] = 0.0f;
}

std::vector<int64_t> threshold(const std::vector<float>& a, int64_t n, int64_t g, float cut) {
    std::vector<int64_t> out(n, 0);
    for (int64_t i = 0; i < n; ++i)
        for (int64_t k = 0; k < g; ++k) out[i] += a[i * g + k] >= cut;
    return out;
}

std::vector<int64_t> admit(const std::vector<float>& a, int64_t n, int64_t g, const std::vector<char>& active,
                           int64_t budget) {
    std::vector<double> flat(a.size());
    for (int64_t i = 0; i < n; ++i)
        for (int64_t k = 0; k < g; ++k) flat[i * g + k] = active[i] ? a[i * g + k] : 0.0f;
    std::vector<int64_t> order = descending(flat), out(n, 0);
    for (int64_t j = 0; j < std::min<int64_t>(budget, static_cast<int64_t>(order.size())); ++j)
        if (flat[order[j]] > 0) ++out[order[j] / g];
    return out;
}

int64_t cap(int64_t planned, int64_t count, int64_t budget, int64_t gamma) {
    return std::min({planned, count, std::clamp<int64_t>(budget - 1, 0, gamma)});
}

std::pair<int64_t, int64_t> accept(const std::vector<int64_t>& drafts, const float* logits, int64_t vocab) {
    auto best = [&](int64_t row) { return std::max_element(logits + row * vocab, logits + (row + 1) * vocab) - (logits + row * vocab); };
    int64_t a = 0;
    const int64_t ell = static_cast<int64_t>(drafts.size());
    while (a < ell && best(a) == drafts[a]) ++a;
    return {a, best(a)};
}

// The indices of `values` by decreasing value, ties in index order (a stable argsort of -values).
std::vector<int64_t> descending(const std::vector<double>& values) {
    std::vector<int64_t> order(values.size());
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return values[a] > values[b]; });
    return order;
}

Admission admission(const std::vector<float>& a, int64_t n, int64_t g, const std::vector<char>& active, double fixed_ms,
                    const std::vector<double>& verify_ms, const std::vector<char>& explore) {
    double base = 0.0;
    for (char x : active) base += x ? 1.0 : 0.0;
    std::vector<double> flat(n * g);  // k-major: equal survivals ordered by k, then slot
    for (int64_t k = 0; k < g; ++k)
        for (int64_t i = 0; i < n; ++i) flat[k * n + i] = active[i] ? static_cast<double>(a[i * g + k]) : 0.0;
    const std::vector<int64_t> order = descending(flat);
    const int64_t pairs = n * g, last = static_cast<int64_t>(verify_ms.size()) - 1;
    std::vector<double> rate(pairs + 1);
    double expected = base;
    const int64_t start = static_cast<int64_t>(base);
    for (int64_t j = 0; j <= pairs; ++j) {
        if (j) expected += flat[order[j - 1]];
        rate[j] = expected / (fixed_ms + verify_ms[std::min(start + j, last)]);
    }
    int64_t m = 0;  // pairs admitted before the first that does not improve the rate
    while (m < pairs && rate[m + 1] > rate[m] && flat[order[m]] > 0) ++m;
    Admission out;
    int64_t taken = m;
    if (!explore.empty()) {  // one pair fewer if the table wants that call measured, else one more (steps.py)
        const int64_t top = static_cast<int64_t>(explore.size()) - 1;
        if (m > 0 && explore[std::min(start + m - 1, top)])
            taken = m - 1;
        else if (m < pairs && flat[order[m]] > 0 && explore[std::min(start + m + 1, top)])
            taken = m + 1;
        out.explored = taken != m;
    }
    out.rate = rate[m];
    out.lengths.assign(n, 0);
    for (int64_t j = 0; j < taken; ++j) ++out.lengths[order[j] % n];
    return out;
}

}  // namespace specrt
