// The AVX-512 VNNI kernels (vpdpbusd on 256-bit vectors, and on 512-bit ones for packed weights where
// wide_vectors(); compiled with the AVX-512 flags, called only where the CPU has avx512vnni, avx512vl and avx512bw).
#include "gguf_simd.inc"
#include "attention.inc"
#include "elementwise.inc"

namespace specrt::ops {
void rows_vnni(Format f, const uint8_t* w, const int8_t* q, const float* d, const int32_t* s, int64_t m,
               int64_t blocks, int64_t n0, int64_t n1, int64_t n_total, float* y) {
    rows_simd<true>(f, w, q, d, s, m, blocks, n0, n1, n_total, y);
}
void attention_avx512(const AttentionShape& s, const float* q, const void* k, const void* v, const float* bias,
                    const AttentionTask& task, float* scratch, float* out) {
    attention_group_impl(s, q, k, v, bias, task, scratch, out);
}
void packed_vnni(const Packed& w, const ActRows& a, int64_t g0, int64_t g1, int64_t n_total, float* y,
                 int prefetch_from) {
    packed_simd<true>(w, a, g0, g1, n_total, y, prefetch_from);
}
void packed_vnni_wide(const Packed& w, const ActRows& a, int64_t g0, int64_t g1, int64_t n_total, float* y,
                      int prefetch_from) {
    packed_simd512(w, a, g0, g1, n_total, y, prefetch_from);
}
void quantize_vnni(const float* x, int64_t b0, int64_t b1, int8_t* q, float* d, int32_t* s) {
    quantize_blocks(x, b0, b1, q, d, s);
}
void swiglu_avx512(const float* y, int64_t m, int64_t half, int64_t c0, int64_t c1, float* out) {
    swiglu_rows(y, m, half, c0, c1, out);
}
void rms_norm_avx512(const float* x, const float* w, int64_t m, int64_t d, float eps, float* y) {
    rms_norm_rows(x, w, m, d, eps, y);
}
}  // namespace specrt::ops
