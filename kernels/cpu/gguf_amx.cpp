// The AMX kernel for products of several activation rows over packed weights (compiled with the AMX and AVX-512
// flags; called only where the CPU has amx-int8 and the kernel has let this process use the tile registers, see
// amx_granted in gguf_kernels.cpp).
//
// Per block of 32 elements and pair of weight groups (16 rows): one tile multiply of the activations' block
// [rows x 32 int8] by the 16 rows' codes [32 x 16] into 16 int32 dot products per activation row, the same integers
// as the VNNI kernel's; then, per activation row, the same float operations in the same order on the same lanes
// (dot x (d_w d_a), then the minimum x d_a s_a), 16 weight rows per vector instead of 8. So an output has the same
// bits on either kernel, whichever rows share the call.
#include "gguf_simd.inc"

#include <cstring>

namespace specrt::ops {
namespace {

struct alignas(64) TileConfig {
    uint8_t palette = 1, start_row = 0;
    uint8_t reserved[14] = {};
    uint16_t colsb[16] = {};
    uint8_t rows[16] = {};
};

// Blocks staged at once: their codes (512 bytes a block) and dots (up to 1 KiB) stay in L1 (a longer row: in parts)
constexpr int kMaxBlocks = 16;

// Tiles 0 and 2: an activation block [mr x 32 bytes]; 1 and 3: the 16 weight rows' block [8 x 64 bytes: row k holds
// elements 4k..4k+3 of each weight row, VNNI's layout]; 4 to 7: dots [mr x 16 int32]. Alternating between them lets
// a block's multiply start before the previous one's dots are stored. Loaded only when the thread's configuration
// differs (loading one costs ~50 ns, reading it back a few): the same thread may run other code that configures the
// tiles its own way between two calls.
void configure(int mr) {
    TileConfig want, have;
    for (int t = 0; t < 8; ++t) {
        const bool weights = t == 1 || t == 3;
        want.rows[t] = static_cast<uint8_t>(weights ? 8 : mr);
        want.colsb[t] = t == 0 || t == 2 ? 32 : 64;
    }
    _tile_storeconfig(&have);
    if (std::memcmp(&have, &want, sizeof want) != 0) _tile_loadconfig(&want);
}

// One block's multiply: dots[mr x 16] = the activation rows' block x the 16 weight rows' codes, activations in tile
// TA, codes in TB, dots in TC (the tile intrinsics take the tile's number as a literal, hence a macro).
#define SPECRT_AMX_MULTIPLY(TA, TB, TC, a, a_stride, codes, dots) \
    do {                                                             \
        _tile_zero(TC);                                              \
        _tile_loadd(TA, a, a_stride);                                \
        _tile_loadd(TB, codes, 64);                                  \
        if constexpr (traits(f).code_bits == 8) _tile_dpbssd(TC, TA, TB); \
        else _tile_dpbsud(TC, TA, TB);                               \
        _tile_stored(TC, dots, 64);                                  \
    } while (0)

// MR activation rows from i0 x groups g and g + 1 (a group of zeros where `second` is null), blocks [b0, b1), added
// to acc. Three passes, so that no step waits on the one before: the codes of every block laid out for the tiles,
// then the multiplies (4 dot tiles in turn), then the scales applied to the stored dots.
template <Format f, int MR>
void pair_blocks(const Packed& w, const int8_t* q, const float* d, const float* ds, int64_t i0, const uint8_t* first,
                 const uint8_t* second, int64_t step, int64_t b0, int64_t b1, __m512* acc) {
    constexpr FormatTraits t = traits(f);
    constexpr int record = packed_record(f), codes_at = packed_codes_at(f);
    const int64_t blocks = w.blocks, n = b1 - b0;
    alignas(64) static thread_local uint8_t codes[kMaxBlocks][8 * 64];
    alignas(64) static thread_local int32_t dots[kMaxBlocks][kAmxRows * 16];
    // The codes are laid out here and computed on afterwards, so what is asked for ahead is the next part's records
    // (the same blocks of the next pair of groups after a pair's last part): they arrive while this part computes.
    const int64_t ahead = (b1 < blocks ? n : 2 * blocks - b0) * record;
    for (int64_t b = 0; b < n; ++b) {
        const uint8_t *r0 = first + (b0 + b) * record, *r1 = second + (b0 + b) * step;
        prefetch<record>(r0 + ahead);
        if (step) prefetch<record>(r1 + ahead);
        uint8_t* out = codes[b];
        if constexpr (t.code_bits == 8) {
            for (int j = 0; j < 8; ++j)
                _mm512_store_si512(out + 64 * j, join(r0 + codes_at + 32 * j, r1 + codes_at + 32 * j));
        } else {  // low nibbles: elements 4p.. (tile rows 0-3); high: 16 + 4p.. (rows 4-7)
            const __m512i nibble = _mm512_set1_epi8(0x0F);
            for (int p = 0; p < 4; ++p) {
                const __m512i v = join(r0 + codes_at + 32 * p, r1 + codes_at + 32 * p);
                _mm512_store_si512(out + 64 * p, _mm512_and_si512(v, nibble));
                _mm512_store_si512(out + 64 * (4 + p), _mm512_and_si512(_mm512_srli_epi16(v, 4), nibble));
            }
        }
    }
    const int8_t* a = q + (i0 * blocks + b0) * kBlock;
    const int64_t a_stride = blocks * kBlock;
    int64_t b = 0;
    for (; b + 4 <= n; b += 4) {
        SPECRT_AMX_MULTIPLY(0, 1, 4, a + b * kBlock, a_stride, codes[b], dots[b]);
        SPECRT_AMX_MULTIPLY(2, 3, 5, a + (b + 1) * kBlock, a_stride, codes[b + 1], dots[b + 1]);
        SPECRT_AMX_MULTIPLY(0, 1, 6, a + (b + 2) * kBlock, a_stride, codes[b + 2], dots[b + 2]);
        SPECRT_AMX_MULTIPLY(2, 3, 7, a + (b + 3) * kBlock, a_stride, codes[b + 3], dots[b + 3]);
    }
    for (; b < n; ++b) SPECRT_AMX_MULTIPLY(0, 1, 4, a + b * kBlock, a_stride, codes[b], dots[b]);
    for (b = 0; b < n; ++b) {
        const uint8_t *r0 = first + (b0 + b) * record, *r1 = second + (b0 + b) * step;
        const __m512 dw = join_ph(r0, r1);
        if constexpr (t.code_bits == 8) {
            for (int ii = 0; ii < MR; ++ii) {
                const int64_t at = (i0 + ii) * blocks + b0 + b;
                const __m512 dot = _mm512_cvtepi32_ps(_mm512_load_si512(dots[b] + 16 * ii));
                acc[ii] = _mm512_fmadd_ps(dot, _mm512_mul_ps(dw, _mm512_set1_ps(d[at])), acc[ii]);
            }
        } else {
            const __m512 mw = t.has_min ? join_ph(r0 + 2 * kGroup, r1 + 2 * kGroup)
                                       : _mm512_mul_ps(dw, _mm512_set1_ps(static_cast<float>(t.code_offset)));
            for (int ii = 0; ii < MR; ++ii) {
                const int64_t at = (i0 + ii) * blocks + b0 + b;
                const __m512 dot = _mm512_cvtepi32_ps(_mm512_load_si512(dots[b] + 16 * ii));
                acc[ii] = _mm512_fmadd_ps(dot, _mm512_mul_ps(dw, _mm512_set1_ps(d[at])), acc[ii]);
                acc[ii] = _mm512_fmadd_ps(mw, _mm512_set1_ps(ds[at]), acc[ii]);
            }
        }
    }
}

#undef SPECRT_AMX_MULTIPLY

// MR activation rows from i0 x groups g and g + 1 (a group of zeros where `second` is null): y's rows g * 8 ...
template <Format f, int MR>
void pair_rows(const Packed& w, const int8_t* q, const float* d, const float* ds, int64_t i0, int64_t g,
               const uint8_t* second, int64_t n_total, float* y) {
    constexpr int record = packed_record(f);
    alignas(64) static const uint8_t zeros[record] = {};
    const uint8_t* first = w.data.data() + g * w.blocks * record;
    const int64_t step = second ? record : 0;
    if (!second) second = zeros;
    __m512 acc[MR];
    for (int ii = 0; ii < MR; ++ii) acc[ii] = _mm512_setzero_ps();
    const int64_t parts = (w.blocks + kMaxBlocks - 1) / kMaxBlocks, part = (w.blocks + parts - 1) / parts;
    for (int64_t b0 = 0; b0 < w.blocks; b0 += part)
        pair_blocks<f, MR>(w, q, d, ds, i0, first, second, step, b0, std::min(w.blocks, b0 + part), acc);
    const int64_t row0 = g * kGroup, valid = std::min<int64_t>(step ? 2 * kGroup : kGroup, w.n - row0);
    const __mmask16 keep = static_cast<__mmask16>((1u << valid) - 1);
    for (int ii = 0; ii < MR; ++ii) _mm512_mask_storeu_ps(y + (i0 + ii) * n_total + row0, keep, acc[ii]);
}

template <Format f, int MR>
void groups_of(const Packed& w, const int8_t* q, const float* d, const float* ds, int64_t i0, int64_t g0, int64_t g1,
               int64_t n_total, float* y) {
    const int64_t record = packed_record(f);
    for (int64_t g = g0; g < g1; g += 2) {
        const uint8_t* second = g + 1 < g1 ? w.data.data() + (g + 1) * w.blocks * record : nullptr;
        pair_rows<f, MR>(w, q, d, ds, i0, g, second, n_total, y);
    }
}

template <Format f, int MR = kAmxRows>
void rows_pass(int mr, const Packed& w, const int8_t* q, const float* d, const float* ds, int64_t i0, int64_t g0,
               int64_t g1, int64_t n_total, float* y) {
    if constexpr (MR > 0) {
        if (mr == MR) return groups_of<f, MR>(w, q, d, ds, i0, g0, g1, n_total, y);
        return rows_pass<f, MR - 1>(mr, w, q, d, ds, i0, g0, g1, n_total, y);
    }
}

}  // namespace

void packed_amx(const Packed& w, const int8_t* q, const float* d, const int32_t*, const float* ds, int64_t m,
                int64_t g0, int64_t g1, int64_t n_total, float* y, int /*prefetch_from: its own*/) {
    for (int64_t i0 = 0; i0 < m; i0 += kAmxRows) {
        const int mr = static_cast<int>(std::min<int64_t>(kAmxRows, m - i0));
        configure(mr);
        with_format(w.format, [&](auto fmt) {  // plain formats (matmul_packed sends no other)
            if constexpr (traits(decltype(fmt)::value).plain)
                rows_pass<decltype(fmt)::value>(mr, w, q, d, ds, i0, g0, g1, n_total, y);
        });
    }
}

}  // namespace specrt::ops
