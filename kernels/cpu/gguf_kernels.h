// Matrix products with weights in GGUF's own blocks (Q4_0, Q4_1, Q8_0: the file's bytes, unchanged): activations
// quantized per 32-element block to int8 with their block sums, integer dot products per block, the Q4_0 offset and
// Q4_1 minimums folded in through the block sums (as llama.cpp does), on the best instruction set the CPU has
// (AVX-512 VNNI, AVX2, else a scalar reference), chosen at run time; where the CPU has AMX-INT8 (Intel since Sapphire
// Rapids), products of several activation rows over packed weights take its tile multiplies.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

namespace specrt::ops {

enum class Format { Q4_0, Q4_1, Q8_0 };
constexpr int kBlock = 32;
constexpr int kGroup = 8;  // weight rows per packed record
  // weight rows per packed record

// A GGUF weight format is one entry of kFormats (ggml's type_traits habit): a block of 32 weights is `block_bytes`
// bytes, an fp16 scale d first; weight i is d (c_i + code_offset) + m, with m the fp16 at `min_at` (0: none). The
// packed dot of a block with activation codes q (scale d_a) is d d_a Σ c q + (m + code_offset d) d_a Σ q. The code
// layouts the kernels unpack: 4 bits (unsigned, elements 0..15 in the low nibbles, 16..31 in the high) or 8 (signed).
struct FormatTraits {
    const char* name;
    int block_bytes;
    int min_at;
    int codes_at;
    int code_bits;
    int code_offset;
};
inline constexpr FormatTraits kFormats[] = {
    {"Q4_0", 18, 0, 2, 4, -8},
    {"Q4_1", 20, 2, 4, 4, 0},
    {"Q8_0", 34, 0, 2, 8, 0},
};
constexpr const FormatTraits& traits(Format f) { return kFormats[static_cast<int>(f)]; }

// Calls fn with the format as a compile-time constant (std::integral_constant<Format, f>): the one switch over formats.
template <class Fn>
decltype(auto) with_format(Format f, Fn&& fn) {
    switch (f) {
        case Format::Q4_0: return fn(std::integral_constant<Format, Format::Q4_0>{});
        case Format::Q4_1: return fn(std::integral_constant<Format, Format::Q4_1>{});
        default: return fn(std::integral_constant<Format, Format::Q8_0>{});
    }
}
// In rising order; Amx is Avx512Vnni with AMX's tile multiplies for packed products, 16 rows at a time (kAmxRows).
enum class Isa { Scalar, Avx2, Avx512Vnni, Amx };

constexpr int block_bytes(Format f) { return traits(f).block_bytes; }
bool parse_format(const std::string& name, Format* f);
const char* isa_name(Isa isa);
// The best instruction set this CPU runs, AMX's tile multiplies included where the CPU and Linux allow them;
// $SPECRT_OPS_ISA (scalar, avx2, avx512vnni) asks for a lower one.
Isa best_isa();
bool supported(Isa isa);

// M rows of activations, quantized: per (row, block) a scale d, the int8 codes and their sum.
struct Activations {
    int64_t m = 0, blocks = 0;
    std::vector<int8_t> q;    // [m, blocks, 32]
    std::vector<float> d;     // [m, blocks]
    std::vector<int32_t> s;   // [m, blocks]: sum of the block's codes
    std::vector<float> ds;    // [m, blocks]: d * s (what a block's minimum is multiplied by)
};
void quantize(Isa isa, const float* a, int64_t m, int64_t k, Activations& out);

// The weights repacked once per session, 8 rows at a time, for the SIMD kernels: per (group of 8 rows, block) the 8
// scales (fp16), for Q4_1 the 8 minimums (fp16), then the codes as 32-byte vectors with one 32-bit lane per row:
// vector c holds bytes 4c..4c+3 of each row's codes (Q4: 4 vectors, the low nibbles elements 4c.., the high ones
// 16+4c..; Q8_0: 8 vectors), so that one vector op serves 8 rows and leaves each row's sum in its own lane, in row
// order. Rows past N are zero. The same bits as the file's blocks: each row's products are computed from exactly
// its own codes and scales.
// Zeroed memory for packed weights, carved from 2 MiB-aligned chunks of 32 MiB that the kernel is asked to back with
// transparent huge pages (madvise MADV_HUGEPAGE, honoured where /sys/kernel/mm/transparent_hugepage/enabled is
// "madvise" or "always"): streaming a model's weights every step then walks 2 MiB pages, not 4 KiB ones. A chunk is
// unmapped when the last buffer in it is freed. $SPECRT_OPS_HUGEPAGES=0: plain heap memory instead.
class WeightBuffer {
public:
    WeightBuffer() = default;
    explicit WeightBuffer(size_t bytes);
    WeightBuffer(const WeightBuffer&) = delete;
    WeightBuffer& operator=(const WeightBuffer&) = delete;
    WeightBuffer(WeightBuffer&& o) noexcept { swap(o); }
    WeightBuffer& operator=(WeightBuffer&& o) noexcept {
        WeightBuffer(std::move(o)).swap(*this);
        return *this;
    }
    ~WeightBuffer();
    uint8_t* data() const { return data_; }
    size_t size() const { return size_; }
    bool empty() const { return size_ == 0; }

private:
    void swap(WeightBuffer& o) noexcept {
        std::swap(data_, o.data_);
        std::swap(size_, o.size_);
        std::swap(chunk_, o.chunk_);
    }
    uint8_t* data_ = nullptr;
    size_t size_ = 0;
    void* chunk_ = nullptr;  // the arena chunk it was carved from (null: heap memory)
};

struct Packed {
    Format format = Format::Q4_0;
    int64_t n = 0, groups = 0, blocks = 0;
    WeightBuffer data;  // [groups, blocks, record]
};
// Passes over packed weights of at least this many activation rows ask for each record ahead of the hardware's own
// prefetching: from 1 row on Intel CPUs, from 4 elsewhere (measured in the default model's target calls on a Xeon:
// a decoding step 11% and a verify of 2-3 tokens 20-26% faster than from 4; on an EPYC 1-2 rows were slower with
// it). $SPECRT_OPS_PREFETCH_ROWS = 1..9 (9: never) says otherwise; read at each call (an op reads it once, when
// its session is made).
int prefetch_rows();
// Whether packed products on AVX-512 VNNI take two groups at a time, 16 weight rows per 512-bit vector (the same
// bits as 8 per 256-bit one): by default on Intel CPUs (measured on a 2-core Xeon whose cores issue a 512-bit
// vpdpbusd as often as a 256-bit one: the default model's verify of 8 tokens 0.91x the time, of 4 0.94x, a decoding
// step 0.98x; Intel cores with a single 512-bit multiply port, not measured, may gain nothing); not elsewhere (on a
// 2-core EPYC a 512-bit vpdpbusd issued half as often). $SPECRT_OPS_WIDE = 0 or 1 says otherwise; read at each call
// (an op reads it once, when its session is made).
bool wide_vectors();

// Isa::Amx: the tile multiplies take a call's rows in whole passes of 16 (a tile's most), the rest take the VNNI
// kernel. A tile multiply costs the same whatever its rows: alone on one thread (scripts/kernel_ab.sh, SmolLM2's
// shapes, a 2-core Xeon) AMX took 1.02-1.08x the 8-lane VNNI kernel's time at 4 rows, 0.71-0.74x at 8, 0.50-0.66x
// at 16; in the default model's calls on 2 threads (specrt profile), where the weights stream from memory, against
// the 16-lane VNNI kernel (wide_vectors()): 0.96-0.99x at 16, 32, 48 and 64 rows, but 1.03-1.07x at 10 and 12 and
// 1.08-1.14x at 20, 24 and 40 (a last pass of 4 or 8 rows on the tiles).
constexpr int kAmxRows = 16;
// A packed record: kGroup rows' fp16 scales (and minimums), then their codes, 4 bytes of each row in turn.
constexpr int packed_scales(Format f) { return traits(f).min_at ? 2 : 1; }
constexpr int packed_codes_at(Format f) { return kGroup * 2 * packed_scales(f); }
constexpr int packed_record(Format f) { return packed_codes_at(f) + kGroup * kBlock * traits(f).code_bits / 8; }
void pack(Format f, const uint8_t* w, int64_t n, int64_t blocks, Packed& out);
// y[i, n] for the rows of groups [g0, g1) of packed weights and all M activation rows; y is [M, n_total].
void matmul_packed(Isa isa, const Packed& w, const Activations& a, int64_t g0, int64_t g1, int64_t n_total, float* y,
                   int prefetch_from = prefetch_rows(), bool wide = wide_vectors());

// y[i, n] for rows n in [n0, n1) of weights w ([N, blocks * block_bytes]) and all M activation rows; y is [M, N].
void matmul_rows(Isa isa, Format f, const uint8_t* w, const Activations& a, int64_t n0, int64_t n1, int64_t n_total,
                 float* y);

// Element-wise kernels (elementwise.inc), the same bits on every instruction set and whatever the call's rows:
// out [m, half] = silu(y[:, :half]) * y[:, half:] for y [m, 2 half] (SwiGLU on a stacked gate/up product), columns
// [c0, c1) of it, and y [m, d] = x / sqrt(mean(x^2) + eps) * w per row.
void swiglu(Isa isa, const float* y, int64_t m, int64_t half, int64_t c0, int64_t c1, float* out);
void rms_norm(Isa isa, const float* x, const float* w, int64_t m, int64_t d, float eps, float* y);

// One row of a GGUF tensor ([blocks * block_bytes]) as float32 (an embedding lookup).
void dequantize_row(Format f, const uint8_t* row, int64_t blocks, float* out);

}  // namespace specrt::ops
