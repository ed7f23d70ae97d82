// GGUF's block layouts (ggml's block_q4_0 ... block_q6_K), read into one form (Unpacked, gguf_kernels.h): the only
// place that knows where a format keeps its scales and codes.
#include "gguf_kernels.h"

#include <cstring>

namespace specrt::ops {

namespace {

uint16_t u16(const uint8_t* p) {
    uint16_t h;
    std::memcpy(&h, p, 2);
    return h;
}

// 16 bytes of nibbles: element i in the low nibble of byte i, element 16 + i in the high one (Q4_0 ... Q5_1)
void nibbles(const uint8_t* qs, uint8_t* codes) {
    for (int i = 0; i < 16; ++i) {
        codes[i] = qs[i] & 0x0F;
        codes[i + 16] = qs[i] >> 4;
    }
}

// bit i of the 32-bit qh is bit 4 of element i (Q5_0, Q5_1)
void fifth_bits(const uint8_t* qh, uint8_t* codes) {
    uint32_t bits;
    std::memcpy(&bits, qh, 4);
    for (int i = 0; i < 32; ++i) codes[i] |= static_cast<uint8_t>(((bits >> i) & 1u) << 4);
}

// The 6-bit scale and minimum of sub-block j of a Q4_K / Q5_K block, from its 12 packed bytes (ggml's
// get_scale_min_k4): sub-blocks 0-3 in the low 6 bits of bytes j and j + 4; 4-7 split between a nibble of byte j + 4
// and the top 2 bits of bytes j - 4 and j.
void scale_min_k4(const uint8_t* s, int j, uint8_t* sc, uint8_t* mn) {
    if (j < 4) {
        *sc = s[j] & 63;
        *mn = s[j + 4] & 63;
    } else {
        *sc = static_cast<uint8_t>((s[j + 4] & 0x0F) | ((s[j - 4] >> 6) << 4));
        *mn = static_cast<uint8_t>((s[j + 4] >> 4) | ((s[j] >> 6) << 4));
    }
}

// Q4_K / Q5_K: d, dmin, 12 bytes of scales, [qh 32 bytes,] qs 128 bytes; chunk c of 64 elements: its first 32 in the
// low nibbles of qs[32c..32c+31], its last 32 in the high ones; Q5_K's bit 4 of those in bits 2c and 2c + 1 of qh.
void unpack_k(const uint8_t* p, const uint8_t* qh, const uint8_t* qs, Unpacked* out) {
    out->d = u16(p);
    out->m = u16(p + 2);
    for (int j = 0; j < 8; ++j) {
        uint8_t sc, mn;
        scale_min_k4(p + 4, j, &sc, &mn);
        out->sc[j] = static_cast<int8_t>(sc);
        out->mn[j] = mn;
    }
    for (int c = 0; c < 4; ++c)
        for (int l = 0; l < 32; ++l) {
            uint8_t lo = qs[32 * c + l] & 0x0F, hi = qs[32 * c + l] >> 4;
            if (qh) {
                lo |= static_cast<uint8_t>(((qh[l] >> (2 * c)) & 1) << 4);
                hi |= static_cast<uint8_t>(((qh[l] >> (2 * c + 1)) & 1) << 4);
            }
            out->codes[64 * c + l] = lo;
            out->codes[64 * c + 32 + l] = hi;
        }
}

}  // namespace

float half_to_float(uint16_t h) {  // IEEE half to float, exactly
    const uint32_t sign = (h & 0x8000u) << 16, exp = (h >> 10) & 0x1F, mant = h & 0x3FF;
    uint32_t bits;
    if (exp == 0) {
        if (mant == 0) {
            bits = sign;
        } else {  // subnormal: normalize
            int e = -1;
            uint32_t m = mant;
            do {
                ++e;
                m <<= 1;
            } while (!(m & 0x400));
            bits = sign | static_cast<uint32_t>(127 - 15 - e) << 23 | (m & 0x3FF) << 13;
        }
    } else if (exp == 31) {
        bits = sign | 0x7F800000u | mant << 13;
    } else {
        bits = sign | (exp + 127 - 15) << 23 | mant << 13;
    }
    float f;
    std::memcpy(&f, &bits, 4);
    return f;
}

void unpack_q4_0(const uint8_t* p, Unpacked* out) {  // d, qs[16]
    out->d = u16(p);
    nibbles(p + 2, out->codes);
}

void unpack_q4_1(const uint8_t* p, Unpacked* out) {  // d, m, qs[16]
    out->d = u16(p);
    out->m = u16(p + 2);
    nibbles(p + 4, out->codes);
}

void unpack_q8_0(const uint8_t* p, Unpacked* out) {  // d, int8 qs[32]
    out->d = u16(p);
    std::memcpy(out->codes, p + 2, 32);
}

void unpack_q5_0(const uint8_t* p, Unpacked* out) {  // d, qh[4], qs[16]
    out->d = u16(p);
    nibbles(p + 6, out->codes);
    fifth_bits(p + 2, out->codes);
}

void unpack_q5_1(const uint8_t* p, Unpacked* out) {  // d, m, qh[4], qs[16]
    out->d = u16(p);
    out->m = u16(p + 2);
    nibbles(p + 8, out->codes);
    fifth_bits(p + 4, out->codes);
}

void unpack_q4_k(const uint8_t* p, Unpacked* out) { unpack_k(p, nullptr, p + 16, out); }

void unpack_q5_k(const uint8_t* p, Unpacked* out) { unpack_k(p, p + 16, p + 48, out); }

// Q6_K: ql[128], qh[64], int8 scales[16], d. Half h (128 elements) reads ql[64h..], qh[32h..]: for l < 32, elements
// l, l + 32, l + 64, l + 96 take the low nibble of ql[l], of ql[l + 32], the high nibble of ql[l], of ql[l + 32],
// and bits 0-1, 2-3, 4-5, 6-7 of qh[l] as their bits 4-5. Scale i covers elements 16i..16i+15.
void unpack_q6_k(const uint8_t* p, Unpacked* out) {
    const uint8_t *ql = p, *qh = p + 128;
    std::memcpy(out->sc, p + 192, 16);
    out->d = u16(p + 208);
    for (int h = 0; h < 2; ++h)
        for (int l = 0; l < 32; ++l) {
            const uint8_t *a = ql + 64 * h, *b = qh + 32 * h;
            uint8_t* c = out->codes + 128 * h;
            c[l] = static_cast<uint8_t>((a[l] & 0x0F) | ((b[l] & 3) << 4));
            c[l + 32] = static_cast<uint8_t>((a[l + 32] & 0x0F) | (((b[l] >> 2) & 3) << 4));
            c[l + 64] = static_cast<uint8_t>((a[l] >> 4) | (((b[l] >> 4) & 3) << 4));
            c[l + 96] = static_cast<uint8_t>((a[l + 32] >> 4) | (((b[l] >> 6) & 3) << 4));
        }
}

SubScales sub_scales(Format f, const Unpacked& u, int j) {
    const FormatTraits& t = traits(f);
    const float d = half_to_float(u.d);
    switch (t.scales) {
        case Scales::Super: {
            const float sc = static_cast<float>(static_cast<uint8_t>(u.sc[j]));
            return {{d * sc, d * sc}, -(half_to_float(u.m) * static_cast<float>(u.mn[j]))};
        }
        case Scales::Super16:
            return {{d * static_cast<float>(u.sc[2 * j]), d * static_cast<float>(u.sc[2 * j + 1])}, 0.0f};
        default: return {{d, d}, t.has_min ? half_to_float(u.m) : 0.0f};
    }
}

int32_t code(Format f, const Unpacked& u, int i) {
    return traits(f).code_bits == 8 ? static_cast<int8_t>(u.codes[i]) : u.codes[i];
}

}  // namespace specrt::ops
