// Sampling as runtime/sampling.py and runtime/acceptance.py define it: temperature, then top-k, then top-p (ties in
// token order), in float64; inverse-CDF draws; Leviathan/Chen rejection sampling of drafts. The random stream is
// the C++ standard library's (a seeded request repeats itself here, not numpy's draws).
#pragma once

#include <cstdint>
#include <random>
#include <vector>

namespace specrt {

struct Params {
    double temperature = 0.0;  // below 1e-5: greedy
    int64_t top_k = 0;         // 0: off
    double top_p = 1.0;        // 1: off
    int64_t seed = -1;         // -1: unseeded
    int64_t max_new_tokens = 128;
    std::vector<int64_t> stop_token_ids;
    std::vector<std::string> stop_strings;  // end the request where its text first holds one (cut before it)
    bool ignore_eos = false;

    bool greedy() const { return temperature == 0.0; }
};

// Validates and normalizes (a temperature below 1e-5 becomes 0); throws Error on a bad value.
void check_params(Params& p, int64_t vocab_size);

class Rng {
public:
    explicit Rng(uint64_t seed) : gen_(seed) {}
    double uniform() { return static_cast<double>(gen_() >> 11) * 0x1.0p-53; }  // [0, 1)

private:
    std::mt19937_64 gen_;
};

int64_t argmax(const float* row, int64_t n);
// The distribution `params` define over one row of logits (float64).
std::vector<double> distribution(const float* logits, int64_t n, const Params& params);
// The first token whose cumulative mass exceeds u x the total (a zero-probability token is never drawn).
int64_t draw(const std::vector<double>& probs, double u);
// Greedy argmax, or a draw from `distribution`.
int64_t next_token(const float* logits, int64_t n, const Params& params, Rng& rng);

// The draft distributions of one slot's drafts: `probs` rows of width `width` over `vocab_ids` (empty: the whole
// vocabulary), or none (one-hot drafts such as n-gram lookups).
struct DraftDist {
    const float* probs = nullptr;
    int64_t width = 0;
    const std::vector<int64_t>* vocab_ids = nullptr;  // column -> token
    const std::vector<int32_t>* column = nullptr;     // token -> column (-1: outside the draft vocabulary)

    double at(int64_t k, int64_t token) const;  // q_k(token)
};

// Rejection sampling of one slot's `drafts` against the target's logits rows [drafts + 1, vocab]: accepted drafts and
// the bonus token. Draws `gamma` acceptance uniforms, then one for the bonus.
std::pair<int64_t, int64_t> accept_sampled(const std::vector<int64_t>& drafts, const DraftDist& q, const float* logits,
                                           int64_t vocab, const Params& params, Rng& rng, int64_t gamma);

}  // namespace specrt
