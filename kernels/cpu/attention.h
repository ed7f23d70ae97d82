// Attention of a few query rows over a KV cache, fused: per (batch, query, head) row, the scores against every
// key, the bias, a softmax in float32 and the weighted sum of the values, the G query heads of a KV head reading
// its keys (grouped-query attention, Hugging Face's head order). Each row is computed alone, in one fixed order
// of operations, so a row's output is the same bits whether the call has 1 query or 16 (a verify of T tokens
// gives each token exactly what decoding it alone would).
#pragma once

#include <cstdint>
#include <vector>

#include "gguf_kernels.h"

namespace specrt::ops {

constexpr int64_t kMaxHeadDim = 256;

// How the cache stores keys and values (`specrt export --kv-dtype`): each element is widened to float32 exactly on
// load, so a row's arithmetic is the float32 one whatever the storage.
enum class CacheType { F32, F16, BF16 };

struct AttentionShape {
    int64_t batch, tokens, heads, kv_heads, head_dim;  // q [B, T, H, D]
    int64_t cache;                                      // k, v [B, Hkv, S, D]
    int64_t keys;                                       // L <= S: the keys attended (the bias's last axis)
    int64_t bias_tokens;                                // bias [B, 1, 1, T or 1, L]
    float scale;
    CacheType cache_type = CacheType::F32;  // of k and v
};

// The rows a task computes: query heads [g0, g1) of KV head `kv_head`'s G, tokens [t0, t1), batch row b. Rows of one
// KV head share each key and value read. Tasks are the G heads of up to kTokensPerTask tokens, or (when that gives
// fewer than kMinTasks tasks) of one token, or (still fewer, e.g. one decoded token) pairs of heads of one token: a
// row's bits are the same in any task. `keys`: the first keys [0, keys) the rows attend, the rest masked for all of
// them (a bias at or below kMasked, whose weight is exactly 0: a row's bits are the same without them), so the
// cost follows the rows' positions rather than the cache's allocated length.
struct AttentionTask {
    int64_t b, kv_head, t0, t1, g0, g1;
    int64_t keys = 0;
};
// The bias row query token t of batch row b reads: [L] floats (one row for every token where the bias has one).
inline const float* bias_row(const AttentionShape& s, const float* bias, int64_t b, int64_t t) {
    return bias + (b * s.bias_tokens + (s.bias_tokens == 1 ? 0 : t)) * s.keys;
}
// A bias at or below this masks its key: exp(score - max) underflows to exactly 0 for any finite score of a row that
// sees at least one key (the exporter's mask is float32's lowest / 2).
constexpr float kMasked = -1e30f;
constexpr int64_t kTokensPerTask = 2, kMinTasks = 4;
// The tasks of a call: every query row, or (`computed` [B * T], nonzero for the cells to compute) only the grid
// cells a packed verify computes, so attention costs the call's tokens, not its B x T grid; each task's keys cut
// after the last one `bias` lets any of its rows see (all L where a row sees none).
std::vector<AttentionTask> attention_plan(const AttentionShape& s, const float* bias,
                                         const uint8_t* computed = nullptr);
// Floats of scratch one task needs (per calling thread).
int64_t attention_scratch(const AttentionShape& s);
// One task's rows into the output [B, T, H, D].
void attention_run(Isa isa, const AttentionShape& s, const float* q, const void* k, const void* v,
                   const float* bias, const AttentionTask& task, float* scratch, float* out);

// A packed call's P new tokens made ready for attention (specrt::PackedAttention). Token i (grid cell c = cells[i] =
// b * T + t) is row i of qkv [P, (H + 2 Hkv) D]: its q and k heads are rotated (rope, rotate-half: x cos[c] +
// rotate_half(x) sin[c], each product and the sum rounded apart, as ONNX's Mul and Add do), q is placed at cell c of
// the grid [B, T, H, D], and k and v are stored in the cache [B, Hkv, S, D] at position slots[c] of batch row b,
// rounded to the cache's type (to nearest even). With `q_norm` and `k_norm` ([D] each, Qwen3's), every q and k head
// is first RMS-normed (x / sqrt(mean(x^2) + eps) * w, elementwise.inc's arithmetic: the bits of specrt::RMSNorm).
// Elementwise: a token's bits never depend on the call's others.
void rope_rows(const AttentionShape& s, const float* qkv, int64_t p, const int64_t* cells, const float* cos,
               const float* sin, const int64_t* slots, float* q_grid, void* k, void* v, const float* q_norm = nullptr,
               const float* k_norm = nullptr, float eps = 0.0f);

}  // namespace specrt::ops
