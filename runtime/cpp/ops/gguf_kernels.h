// Matrix products with weights in GGUF's own blocks (Q4_0, Q4_1, Q8_0: the file's bytes, unchanged): activations
// quantized per 32-element block to int8 with their block sums, integer dot products per block, the Q4_0 offset and
// Q4_1 minimums folded in through the block sums (as llama.cpp does), on the best instruction set the CPU has
// (AVX-512 VNNI, AVX2, else a scalar reference), chosen at run time.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace specrt::ops {

enum class Format { Q4_0, Q4_1, Q8_0 };
enum class Isa { Scalar, Avx2, Avx512Vnni };

constexpr int kBlock = 32;
constexpr int block_bytes(Format f) { return f == Format::Q4_0 ? 18 : f == Format::Q4_1 ? 20 : 34; }
bool parse_format(const std::string& name, Format* f);
const char* isa_name(Isa isa);
// The best instruction set this CPU runs; $SPECRT_OPS_ISA (scalar, avx2, avx512vnni) asks for a lower one.
Isa best_isa();
bool supported(Isa isa);

// M rows of activations, quantized: per (row, block) a scale d, the int8 codes and their sum.
struct Activations {
    int64_t m = 0, blocks = 0;
    std::vector<int8_t> q;    // [m, blocks, 32]
    std::vector<float> d;     // [m, blocks]
    std::vector<int32_t> s;   // [m, blocks]: sum of the block's codes
};
void quantize(const float* a, int64_t m, int64_t k, Activations& out);

// y[i, n] for rows n in [n0, n1) of weights w ([N, blocks * block_bytes]) and all M activation rows; y is [M, N].
void matmul_rows(Isa isa, Format f, const uint8_t* w, const Activations& a, int64_t n0, int64_t n1, int64_t n_total,
                 float* y);

// One row of a GGUF tensor ([blocks * block_bytes]) as float32 (an embedding lookup).
void dequantize_row(Format f, const uint8_t* row, int64_t blocks, float* out);

}  // namespace specrt::ops
