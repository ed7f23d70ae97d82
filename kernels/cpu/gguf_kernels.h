// Matrix products with weights in GGUF's own blocks (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 and the K-quants Q4_K, Q5_K, Q6_K:
// the file's bytes): activations quantized per 32-element block to int8 with their block sums, integer dot products
// per block, the scales, offsets and minimums applied in float32 (as llama.cpp does), on the best instruction set the
// CPU has (AVX-512 VNNI, AVX2, else a scalar reference), chosen at run time; where the CPU has AMX-INT8 (Intel since
// Sapphire Rapids), products of several activation rows over packed Q4_0 / Q4_1 / Q8_0 weights take its tile
// multiplies.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

namespace specrt::ops {

// In kFormats' order.
enum class Format { Q4_0, Q4_1, Q8_0, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K };
constexpr int kBlock = 32;  // activation block: the elements one integer dot product covers
constexpr int kGroup = 8;   // weight rows per packed record

// How a format's blocks scale their codes:
//   Block:   one fp16 scale d per 32 weights (and, with a minimum, an fp16 m): w = d (c + code_offset) + m.
//   Super:   256 weights share fp16 d and dmin; each 32 has 6-bit integers sc and mn: w = (d sc) c - (dmin mn).
//   Super16: 256 weights share fp16 d; each 16 has an int8 sc: w = (d sc) (c + code_offset).
// d sc and dmin mn are exact in float32 (11 + 8 significant bits at most), so every format's weights are
// D (c + code_offset) + M with float32 D and M per 16 or 32 weights: the form the kernels and the reference compute.
enum class Scales { Block, Super, Super16 };

struct Unpacked;  // one file block, unpacked (below)

// A GGUF weight format is one entry of kFormats (ggml's type_traits habit): a file block holds `block_elems` weights
// in `block_bytes` bytes; its codes are unsigned `code_bits`-bit integers (8: signed) and `unpack` reads them, with
// the block's scales, from the file's own layout. Nothing else in the kernels knows a format's layout.
struct FormatTraits {
    const char* name;
    int block_elems;
    int block_bytes;
    int code_bits;
    int code_offset;
    Scales scales;
    bool has_min;
    // a plain block: 32 weights, fp16 d [, fp16 m], then 4- or 8-bit codes (Q4_0, Q4_1, Q8_0): what the row kernel
    // reads in the file (gguf_simd.inc's tile) and AMX in the packed records (gguf_amx.cpp); the others take the
    // scalar rows and the VNNI packed kernel there
    bool plain;
    void (*unpack)(const uint8_t* block, Unpacked* out);
};

// One file block: the fp16 bits of its scale and minimum (Super: d and dmin; Block without a minimum: m = 0), the
// sub-block integers (Super: sc[0..7] and mn[0..7], 6 bits; Super16: sc[0..15], int8) and every code, in element order.
struct Unpacked {
    uint16_t d = 0, m = 0;
    int8_t sc[16] = {};
    uint8_t mn[8] = {};
    uint8_t codes[256] = {};  // unsigned codes; Q8_0: the int8 codes' bits
};

void unpack_q4_0(const uint8_t*, Unpacked*);
void unpack_q4_1(const uint8_t*, Unpacked*);
void unpack_q8_0(const uint8_t*, Unpacked*);
void unpack_q5_0(const uint8_t*, Unpacked*);
void unpack_q5_1(const uint8_t*, Unpacked*);
void unpack_q4_k(const uint8_t*, Unpacked*);
void unpack_q5_k(const uint8_t*, Unpacked*);
void unpack_q6_k(const uint8_t*, Unpacked*);

inline constexpr FormatTraits kFormats[] = {
    {"Q4_0", 32, 18, 4, -8, Scales::Block, false, true, unpack_q4_0},
    {"Q4_1", 32, 20, 4, 0, Scales::Block, true, true, unpack_q4_1},
    {"Q8_0", 32, 34, 8, 0, Scales::Block, false, true, unpack_q8_0},
    {"Q5_0", 32, 22, 5, -16, Scales::Block, false, false, unpack_q5_0},
    {"Q5_1", 32, 24, 5, 0, Scales::Block, true, false, unpack_q5_1},
    {"Q4_K", 256, 144, 4, 0, Scales::Super, true, false, unpack_q4_k},
    {"Q5_K", 256, 176, 5, 0, Scales::Super, true, false, unpack_q5_k},
    {"Q6_K", 256, 210, 6, -32, Scales::Super16, false, false, unpack_q6_k},
};
// Block j (32 weights) of an unpacked file block as numbers: weight i is D[i / 16] (c_i + code_offset) + M, D and M
// exact in float32 (Scales above).
struct SubScales {
    float D[2];
    float M;
};
SubScales sub_scales(Format f, const Unpacked& u, int j);
int32_t code(Format f, const Unpacked& u, int i);  // code i as the integer the dot products multiply
float half_to_float(uint16_t h);

constexpr const FormatTraits& traits(Format f) { return kFormats[static_cast<int>(f)]; }
constexpr int kFormatCount = static_cast<int>(sizeof kFormats / sizeof kFormats[0]);

// Calls fn with the format as a compile-time constant (std::integral_constant<Format, f>): the one switch over formats.
template <class Fn>
decltype(auto) with_format(Format f, Fn&& fn) {
    switch (f) {
        case Format::Q4_0: return fn(std::integral_constant<Format, Format::Q4_0>{});
        case Format::Q4_1: return fn(std::integral_constant<Format, Format::Q4_1>{});
        case Format::Q5_0: return fn(std::integral_constant<Format, Format::Q5_0>{});
        case Format::Q5_1: return fn(std::integral_constant<Format, Format::Q5_1>{});
        case Format::Q4_K: return fn(std::integral_constant<Format, Format::Q4_K>{});
        case Format::Q5_K: return fn(std::integral_constant<Format, Format::Q5_K>{});
        case Format::Q6_K: return fn(std::integral_constant<Format, Format::Q6_K>{});
        default: return fn(std::integral_constant<Format, Format::Q8_0>{});
    }
}
// In rising order; Amx is Avx512Vnni with AMX's tile multiplies for packed products, 16 rows at a time (kAmxRows).
enum class Isa { Scalar, Avx2, Avx512Vnni, Amx };

constexpr int block_bytes(Format f) { return traits(f).block_bytes; }
// Bytes of a row of k weights (k a multiple of the format's block_elems).
constexpr int64_t row_bytes(Format f, int64_t k) { return k / traits(f).block_elems * traits(f).block_bytes; }
bool parse_format(const std::string& name, Format* f);
// "Q4_0, Q4_1, ..." (for errors)
std::string format_names();
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
    std::vector<int32_t> h;   // [m, blocks]: sum of the block's first 16 codes (for scales per 16 weights)
};
void quantize(Isa isa, const float* a, int64_t m, int64_t k, Activations& out);
// M activation rows of an Activations, from a row on, as the packed kernels read them.
struct ActRows {
    const int8_t* q;
    const float* d;
    const int32_t* s;
    const float* ds;
    const int32_t* h;
    int64_t m;
};


// The weights repacked once per session, 8 rows at a time, for the SIMD kernels. Per group of 8 rows, per
// super-block of the format (256 weights for the K-quants, else 32) a header, then per block of 32 a record:
//   header  Super: the 8 rows' d, then dmin (fp16); Super16: their d; Block: none
//   record  Block: the 8 scales (fp16) [, the 8 minimums]; Super: 8 sc, 8 mn (uint8); Super16: 8 sc of the first 16
//           weights, 8 of the last 16 (int8); then the codes as 32-byte vectors with one 32-bit lane per row.
// Codes of 4 to 6 bits: 4 vectors of nibbles, vector p holding elements 4p..4p+3 of each row in its low nibbles and
// 16+4p..16+4p+3 in its high ones; 5 bits: one more vector whose byte k of a lane has in bit v bit 4 of element
// 4v+k; 6 bits: two more, for the low-nibble elements and the high-nibble ones, with in bits 2p, 2p+1 of byte k
// bits 4-5 of element 4p+k (or 16+4p+k). Q8_0: 8 vectors, vector j elements 4j..4j+3 (signed). One vector op then
// serves 8 rows and leaves each row's sum in its own lane, in row order. Rows past N are zero. The same numbers as
// the file's blocks: each row's products are computed from exactly its own codes and scales.
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
// The packed layout's sizes (bytes): a super-block's header, a block's scales, its codes, its record, a super-block.
constexpr int blocks_per_super(Format f) { return traits(f).block_elems / kBlock; }
constexpr int packed_header(Format f) {
    return traits(f).scales == Scales::Super ? 4 * kGroup : traits(f).scales == Scales::Super16 ? 2 * kGroup : 0;
}
constexpr int packed_codes_at(Format f) {
    return traits(f).scales == Scales::Block ? kGroup * 2 * (traits(f).has_min ? 2 : 1) : 2 * kGroup;
}
constexpr int packed_record(Format f) { return packed_codes_at(f) + kGroup * kBlock * traits(f).code_bits / 8; }
constexpr int packed_super(Format f) { return packed_header(f) + blocks_per_super(f) * packed_record(f); }
void pack(Format f, const uint8_t* w, int64_t n, int64_t blocks, Packed& out);
// Where [p, p + n) lies in a mapping of a file (ONNX Runtime maps an artifact's page-aligned external weights), its
// whole pages leave this process's resident memory (madvise MADV_DONTNEED: a later read maps them again from the
// file, unchanged); anywhere else nothing happens. After packing, a weight is in memory once, not twice.
// $SPECRT_OPS_KEEP_PAGES=1 keeps them.
void release_file_pages(const void* p, size_t n);
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

// One row of k weights of a GGUF tensor (row_bytes(f, k) bytes) as float32 (an embedding lookup).
void dequantize_row(Format f, const uint8_t* row, int64_t k, float* out);

}  // namespace specrt::ops
