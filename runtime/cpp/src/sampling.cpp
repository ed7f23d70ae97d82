#include "sampling.h"

#include "artifact.h"

#include <algorithm>
#include <cmath>
#include <numeric>

namespace specrt {

namespace {
constexpr double kMinTemperature = 1e-5;  // runtime/sampling.py MIN_TEMPERATURE
}

void check_params(Params& p, int64_t vocab_size) {
    auto bad = [](const std::string& m) { return Error(SPECRT_ERROR_REQUEST, m); };
    if (!std::isfinite(p.temperature) || p.temperature < 0)
        throw bad("temperature must be a finite number >= 0, got " + std::to_string(p.temperature));
    if (p.temperature < kMinTemperature) p.temperature = 0.0;
    if (p.top_k < 0) throw bad("top_k must be >= 0 (0 disables it), got " + std::to_string(p.top_k));
    if (!(p.top_p > 0.0 && p.top_p <= 1.0)) throw bad("top_p must be in (0, 1], got " + std::to_string(p.top_p));
    if (p.max_new_tokens < 1) throw bad("max_new_tokens must be >= 1, got " + std::to_string(p.max_new_tokens));
    for (int64_t t : p.stop_token_ids)
        if (t < 0 || t >= vocab_size)
            throw bad("token id " + std::to_string(t) + " is outside the vocabulary (0.." + std::to_string(vocab_size - 1) + ")");
}

int64_t argmax(const float* row, int64_t n) { return std::max_element(row, row + n) - row; }

std::vector<double> distribution(const float* logits, int64_t n, const Params& params) {
    std::vector<double> x(logits, logits + n);
    for (double& v : x) v /= params.temperature;
    std::vector<double> p(n);
    const bool top_k = params.top_k > 0 && params.top_k < n;
    double kth = -INFINITY;
    if (top_k) {  // keep the tokens at least as large as the k-th largest
        std::vector<double> tmp(x);
        std::nth_element(tmp.begin(), tmp.begin() + (params.top_k - 1), tmp.end(), std::greater<double>());
        kth = tmp[params.top_k - 1];
    }
    const double top = *std::max_element(x.begin(), x.end());
    double sum = 0.0;
    for (int64_t i = 0; i < n; ++i) sum += p[i] = x[i] >= kth ? std::exp(x[i] - top) : 0.0;
    for (double& v : p) v /= sum;
    if (params.top_p < 1.0) {  // the smallest prefix by probability (ties in token order) reaching top_p
        std::vector<int64_t> order;
        for (int64_t i = 0; i < n; ++i)
            if (p[i] > 0.0) order.push_back(i);
        std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return p[a] > p[b]; });
        double before = 0.0;
        std::vector<int64_t> drop;
        for (int64_t i : order) {
            if (before >= params.top_p) drop.push_back(i);
            before += p[i];
        }
        for (int64_t i : drop) p[i] = 0.0;
        double s = std::accumulate(p.begin(), p.end(), 0.0);
        for (double& v : p) v /= s;
    }
    return p;
}

int64_t draw(const std::vector<double>& probs, double u) {
    std::vector<double> cdf(probs.size());
    std::partial_sum(probs.begin(), probs.end(), cdf.begin());
    const double total = cdf.back();
    const double x = std::min(u * total, std::nextafter(total, 0.0));
    return std::upper_bound(cdf.begin(), cdf.end(), x) - cdf.begin();
}

int64_t next_token(const float* logits, int64_t n, const Params& params, Rng& rng) {
    if (params.greedy()) return argmax(logits, n);
    std::vector<double> p = distribution(logits, n, params);
    double total = std::accumulate(p.begin(), p.end(), 0.0);
    if (!(total > 0.0 && std::isfinite(total)))
        throw Error(SPECRT_ERROR_RUNTIME, "sampling got an invalid distribution (NaN, inf or all zero); the logits or "
                                          "parameters are broken");
    return draw(p, rng.uniform());
}

double DraftDist::at(int64_t k, int64_t token) const {
    if (!probs) return token >= 0 ? 1.0 : 0.0;  // one-hot: called only at the draft itself
    const float* row = probs + k * width;
    if (!column || column->empty()) return row[token];
    const int32_t j = (*column)[token];
    return j >= 0 ? row[j] : 0.0;
}

std::pair<int64_t, int64_t> accept_sampled(const std::vector<int64_t>& drafts, const DraftDist& q, const float* logits,
                                           int64_t vocab, const Params& params, Rng& rng, int64_t gamma) {
    const int64_t ell = static_cast<int64_t>(drafts.size());
    std::vector<double> u(std::max(gamma, ell));
    for (double& x : u) x = rng.uniform();
    const double v = rng.uniform();
    // accept d_k with probability min(1, p(d_k) / q(d_k)), i.e. u q(d_k) < p(d_k)
    int64_t a = 0;
    std::vector<double> p;
    while (true) {
        p = distribution(logits + a * vocab, vocab, params);
        if (a == ell) break;
        const int64_t d = drafts[a];
        const double qd = q.probs ? q.at(a, d) : 1.0;
        if (!(u[a] * qd < p[d])) break;
        ++a;
    }
    if (a < ell) {  // rejected: the bonus from norm(max(0, p - q)), where it has mass
        std::vector<double> residual(p);
        if (!q.probs) {
            residual[drafts[a]] -= 1.0;
        } else {
            const float* row = q.probs + a * q.width;
            for (int64_t j = 0; j < q.width; ++j)
                residual[q.vocab_ids && !q.vocab_ids->empty() ? (*q.vocab_ids)[j] : j] -= row[j];
        }
        double mass = 0.0;
        for (double& r : residual) mass += r = std::max(0.0, r);
        if (mass > 1e-12) {
            for (double& r : residual) r /= mass;
            return {a, draw(residual, v)};
        }
    }
    return {a, draw(p, v)};
}

}  // namespace specrt
