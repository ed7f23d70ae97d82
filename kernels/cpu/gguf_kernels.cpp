#include "gguf_kernels.h"

#include "attention.inc"
#include "elementwise.inc"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <iterator>
#include <mutex>
#include <new>

#include <sys/mman.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cpuid.h>

namespace specrt::ops {

namespace {

// -- scalar reference ----------------------------------------------------------------------------------------------

// Per (row, block): the halves' dots with their code offsets folded in, times D d_a, then the minimum times d_a s:
// Σ_h D_h d_a (Σ_half c q + code_offset Σ_half q) + M d_a Σ q.
void rows_scalar(Format f, const uint8_t* w, const Activations& a, int64_t n0, int64_t n1, int64_t n_total, float* y) {
    const FormatTraits& t = traits(f);
    const int64_t blocks = a.blocks, supers = blocks / blocks_per_super(f);
    std::vector<float> acc(a.m);
    Unpacked u;
    for (int64_t n = n0; n < n1; ++n) {
        std::fill(acc.begin(), acc.end(), 0.0f);
        const uint8_t* row = w + n * supers * t.block_bytes;
        for (int64_t sb = 0; sb < supers; ++sb) {
            t.unpack(row + sb * t.block_bytes, &u);
            for (int j = 0; j < blocks_per_super(f); ++j) {
                const SubScales sub = sub_scales(f, u, j);
                const int64_t b = sb * blocks_per_super(f) + j;
                for (int64_t i = 0; i < a.m; ++i) {
                    const int8_t* q = a.q.data() + (i * blocks + b) * kBlock;
                    int32_t dot[2] = {0, 0};
                    for (int k = 0; k < kBlock; ++k) dot[k / 16] += code(f, u, j * kBlock + k) * q[k];
                    const int32_t half0 = a.h[i * blocks + b], half1 = a.s[i * blocks + b] - half0;
                    const float da = a.d[i * blocks + b];
                    acc[i] += sub.D[0] * da * static_cast<float>(dot[0] + t.code_offset * half0) +
                              sub.D[1] * da * static_cast<float>(dot[1] + t.code_offset * half1) +
                              sub.M * a.ds[i * blocks + b];
                }
            }
        }
        for (int64_t i = 0; i < a.m; ++i) y[i * n_total + n] = acc[i];
    }
}

}  // namespace

// in gguf_avx2.cpp and gguf_avx512.cpp, each compiled for its instruction set (gguf_simd.inc)
void rows_avx2(Format f, const uint8_t* w, const int8_t* q, const float* d, const int32_t* s, int64_t m,
               int64_t blocks, int64_t n0, int64_t n1, int64_t n_total, float* y);
void rows_vnni(Format f, const uint8_t* w, const int8_t* q, const float* d, const int32_t* s, int64_t m,
               int64_t blocks, int64_t n0, int64_t n1, int64_t n_total, float* y);
void quantize_avx2(const float* x, int64_t b0, int64_t b1, int8_t* q, float* d, int32_t* s);
void quantize_vnni(const float* x, int64_t b0, int64_t b1, int8_t* q, float* d, int32_t* s);
void packed_avx2(const Packed& w, const ActRows& a, int64_t g0, int64_t g1, int64_t n_total, float* y,
                 int prefetch_from);
void packed_vnni(const Packed& w, const ActRows& a, int64_t g0, int64_t g1, int64_t n_total, float* y,
                 int prefetch_from);
void packed_vnni_wide(const Packed& w, const ActRows& a, int64_t g0, int64_t g1, int64_t n_total, float* y,
                      int prefetch_from);
#ifdef SPECRT_OPS_AMX
void packed_amx(const Packed& w, const int8_t* q, const float* d, const int32_t* s, const float* ds, int64_t m,
                int64_t g0, int64_t g1, int64_t n_total, float* y, int prefetch_from);  // gguf_amx.cpp
#endif
void attention_avx2(const AttentionShape& s, const float* q, const void* k, const void* v, const float* bias,
                    const AttentionTask& task, float* scratch, float* out);
void attention_avx512(const AttentionShape& s, const float* q, const void* k, const void* v, const float* bias,
                      const AttentionTask& task, float* scratch, float* out);
void swiglu_avx2(const float* y, int64_t m, int64_t half, int64_t c0, int64_t c1, float* out);
void swiglu_avx512(const float* y, int64_t m, int64_t half, int64_t c0, int64_t c1, float* out);
void rms_norm_avx2(const float* x, const float* w, int64_t m, int64_t d, float eps, float* y);
void rms_norm_avx512(const float* x, const float* w, int64_t m, int64_t d, float eps, float* y);


std::string format_names() {
    std::string names;
    for (const FormatTraits& t : kFormats) names += (names.empty() ? "" : ", ") + std::string(t.name);
    return names;
}

bool parse_format(const std::string& name, Format* f) {
    for (size_t i = 0; i < std::size(kFormats); ++i)
        if (name == kFormats[i].name) {
            *f = static_cast<Format>(i);
            return true;
        }
    return false;
}

const char* isa_name(Isa isa) {
    switch (isa) {
        case Isa::Amx: return "amx";
        case Isa::Avx512Vnni: return "avx512vnni";
        case Isa::Avx2: return "avx2";
        default: return "scalar";
    }
}

namespace {

// Whether this process may use AMX's tile registers: the CPU has AMX-TILE and AMX-INT8 (CPUID leaf 7: EDX bits 24
// and 25) and Linux grants the process the tile data state they need (arch_prctl ARCH_REQ_XCOMP_PERM for
// XFEATURE_XTILEDATA, Linux 5.16 and newer; granted once, for every thread of the process). Asked once.
bool amx_granted() {
#ifdef SPECRT_OPS_AMX
    static const bool granted = [] {
        unsigned a, b, c, d;
        if (!__get_cpuid_count(7, 0, &a, &b, &c, &d) || !(d & (1u << 24)) || !(d & (1u << 25))) return false;
        constexpr long kReqXcompPerm = 0x1023, kXtiledata = 18;
        return syscall(SYS_arch_prctl, kReqXcompPerm, kXtiledata) == 0;
    }();
    return granted;
#else
    return false;  // built by a compiler without AMX intrinsics
#endif
}

}  // namespace

bool supported(Isa isa) {
    __builtin_cpu_init();
    switch (isa) {
        case Isa::Amx: return amx_granted() && supported(Isa::Avx512Vnni);
        case Isa::Avx512Vnni:
            return __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512vl") &&
                   __builtin_cpu_supports("avx512bw") && supported(Isa::Avx2);
        case Isa::Avx2: return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
        default: return true;
    }
}

Isa best_isa() {
    // AMX where the CPU has it and Linux grants the tiles: its multiplies take a product's rows 16 at a time (a batch
    // of requests' verify or decoding step), the same bits as VNNI's (gguf_amx.cpp); SPECRT_OPS_ISA asks for a lower
    // one.
    Isa best = Isa::Scalar;
    for (Isa isa : {Isa::Avx2, Isa::Avx512Vnni, Isa::Amx})
        if (supported(isa)) best = isa;
    const char* want = std::getenv("SPECRT_OPS_ISA");
    if (want) {
        for (Isa isa : {Isa::Scalar, Isa::Avx2, Isa::Avx512Vnni, Isa::Amx})
            if (std::strcmp(want, isa_name(isa)) == 0 && supported(isa)) return isa;
    }
    return best;
}

namespace {

bool intel_cpu() {
    static const bool intel = [] {
        unsigned a, b, c, d;  // vendor "GenuineIntel" in EBX, EDX, ECX
        return __get_cpuid(0, &a, &b, &c, &d) && b == 0x756e6547 && d == 0x49656e69 && c == 0x6c65746e;
    }();
    return intel;
}

}  // namespace

int prefetch_rows() {
    if (const char* env = std::getenv("SPECRT_OPS_PREFETCH_ROWS")) {
        const int n = std::atoi(env);
        if (n >= 1 && n <= 9) return n;
    }
    return intel_cpu() ? 1 : 4;
}

bool wide_vectors() {
    if (const char* env = std::getenv("SPECRT_OPS_WIDE")) {
        if (std::strcmp(env, "0") == 0) return false;
        if (std::strcmp(env, "1") == 0) return true;
    }
    return intel_cpu();
}

void quantize(Isa isa, const float* x, int64_t m, int64_t k, Activations& out) {
    const int64_t blocks = k / kBlock;
    out.m = m;
    out.blocks = blocks;
    out.q.resize(m * k);
    out.d.resize(m * blocks);
    out.s.resize(m * blocks);
    if (isa != Isa::Scalar) {
        (isa >= Isa::Avx512Vnni ? quantize_vnni : quantize_avx2)(x, 0, m * blocks, out.q.data(), out.d.data(),
                                                                  out.s.data());
    } else {
        for (int64_t i = 0; i < m * blocks; ++i) {
            const float* v = x + i * kBlock;
            float amax = 0.0f;
            for (int j = 0; j < kBlock; ++j) amax = std::max(amax, std::fabs(v[j]));
            const float d = amax / 127.0f, inv = d > 0 ? 1.0f / d : 0.0f;
            int32_t sum = 0;
            for (int j = 0; j < kBlock; ++j) {
                const int8_t q = static_cast<int8_t>(std::nearbyint(v[j] * inv));
                out.q[i * kBlock + j] = q;
                sum += q;
            }
            out.d[i] = d;
            out.s[i] = sum;
        }
    }
    out.ds.resize(m * blocks);
    out.h.resize(m * blocks);
    for (int64_t i = 0; i < m * blocks; ++i) {
        out.ds[i] = out.d[i] * static_cast<float>(out.s[i]);
        int32_t half = 0;
        for (int j = 0; j < kBlock / 2; ++j) half += out.q[i * kBlock + j];
        out.h[i] = half;
    }
}

void swiglu(Isa isa, const float* y, int64_t m, int64_t half, int64_t c0, int64_t c1, float* out) {
    switch (isa) {
        case Isa::Amx:
        case Isa::Avx512Vnni: swiglu_avx512(y, m, half, c0, c1, out); break;
        case Isa::Avx2: swiglu_avx2(y, m, half, c0, c1, out); break;
        default: swiglu_rows(y, m, half, c0, c1, out);
    }
}

void rms_norm(Isa isa, const float* x, const float* w, int64_t m, int64_t d, float eps, float* y) {
    switch (isa) {
        case Isa::Amx:
        case Isa::Avx512Vnni: rms_norm_avx512(x, w, m, d, eps, y); break;
        case Isa::Avx2: rms_norm_avx2(x, w, m, d, eps, y); break;
        default: rms_norm_rows(x, w, m, d, eps, y);
    }
}

void matmul_rows(Isa isa, Format f, const uint8_t* w, const Activations& a, int64_t n0, int64_t n1, int64_t n_total,
                 float* y) {
    if (!traits(f).plain) isa = Isa::Scalar;  // the SIMD row kernels read Q4_0, Q4_1 and Q8_0 (gguf_simd.inc's tile)
    switch (isa) {
        case Isa::Amx:
        case Isa::Avx512Vnni:
            rows_vnni(f, w, a.q.data(), a.d.data(), a.s.data(), a.m, a.blocks, n0, n1, n_total, y);
            break;
        case Isa::Avx2: rows_avx2(f, w, a.q.data(), a.d.data(), a.s.data(), a.m, a.blocks, n0, n1, n_total, y); break;
        default: rows_scalar(f, w, a, n0, n1, n_total, y);
    }
}

namespace {

// One row's file block, unpacked, into its lane j of a group's packed super-block (gguf_kernels.h, Packed).
void pack_lane(Format f, const Unpacked& u, int j, uint8_t* super) {
    const FormatTraits& t = traits(f);
    const int header = packed_header(f), record = packed_record(f), codes_at = packed_codes_at(f);
    if (t.scales != Scales::Block) {
        std::memcpy(super + 2 * j, &u.d, 2);
        if (t.scales == Scales::Super) std::memcpy(super + 2 * kGroup + 2 * j, &u.m, 2);
    }
    for (int b = 0; b < blocks_per_super(f); ++b) {
        uint8_t* rec = super + header + b * record;
        const uint8_t* c = u.codes + b * kBlock;
        switch (t.scales) {
            case Scales::Block:
                std::memcpy(rec + 2 * j, &u.d, 2);
                if (t.has_min) std::memcpy(rec + 2 * kGroup + 2 * j, &u.m, 2);
                break;
            case Scales::Super:
                rec[j] = static_cast<uint8_t>(u.sc[b]);
                rec[kGroup + j] = u.mn[b];
                break;
            case Scales::Super16:
                rec[j] = static_cast<uint8_t>(u.sc[2 * b]);
                rec[kGroup + j] = static_cast<uint8_t>(u.sc[2 * b + 1]);
                break;
        }
        uint8_t* codes = rec + codes_at;
        if (t.code_bits == 8) {  // vector v: elements 4v..4v+3
            for (int v = 0; v < 8; ++v) std::memcpy(codes + 32 * v + 4 * j, c + 4 * v, 4);
            continue;
        }
        for (int p = 0; p < 4; ++p)  // nibbles: elements 4p+k (low) and 16+4p+k (high)
            for (int k = 0; k < 4; ++k)
                codes[32 * p + 4 * j + k] = static_cast<uint8_t>((c[4 * p + k] & 0x0F) | (c[16 + 4 * p + k] & 0x0F) << 4);
        uint8_t* high = codes + 128;
        for (int k = 0; k < 4; ++k) {
            if (t.code_bits == 5) {  // bit v of byte k: bit 4 of element 4v+k
                uint8_t bits = 0;
                for (int v = 0; v < 8; ++v) bits |= static_cast<uint8_t>(((c[4 * v + k] >> 4) & 1) << v);
                high[4 * j + k] = bits;
            } else if (t.code_bits == 6) {  // bits 2p, 2p+1 of byte k: bits 4-5 of element 4p+k (then 16+4p+k)
                uint8_t lo = 0, hi = 0;
                for (int p = 0; p < 4; ++p) {
                    lo |= static_cast<uint8_t>(((c[4 * p + k] >> 4) & 3) << (2 * p));
                    hi |= static_cast<uint8_t>(((c[16 + 4 * p + k] >> 4) & 3) << (2 * p));
                }
                high[4 * j + k] = lo;
                high[32 + 4 * j + k] = hi;
            }
        }
    }
}

}  // namespace

void pack(Format f, const uint8_t* w, int64_t n, int64_t blocks, Packed& out) {
    const FormatTraits& t = traits(f);
    const int64_t supers = blocks / blocks_per_super(f), super_bytes = packed_super(f);
    out.format = f;
    out.n = n;
    out.blocks = blocks;
    out.groups = (n + kGroup - 1) / kGroup;
    out.data = WeightBuffer(static_cast<size_t>(out.groups * supers * super_bytes));
    Unpacked u;
    for (int64_t g = 0; g < out.groups; ++g)
        for (int64_t sb = 0; sb < supers; ++sb)
            for (int j = 0; j < kGroup; ++j) {
                const int64_t row = g * kGroup + j;
                if (row >= n) continue;  // zero: scale 0, codes 0
                t.unpack(w + (row * supers + sb) * t.block_bytes, &u);
                pack_lane(f, u, j, out.data.data() + (g * supers + sb) * super_bytes);
            }
}

void release_file_pages(const void* p, size_t n) {
    if (const char* env = std::getenv("SPECRT_OPS_KEEP_PAGES"); env && std::strcmp(env, "1") == 0) return;
    const long page = sysconf(_SC_PAGESIZE);
    const uintptr_t begin = (reinterpret_cast<uintptr_t>(p) + page - 1) & ~static_cast<uintptr_t>(page - 1);
    const uintptr_t end = (reinterpret_cast<uintptr_t>(p) + n) & ~static_cast<uintptr_t>(page - 1);
    if (end <= begin) return;
    // /proc/self/maps: "start-end perms offset dev inode path"; a file mapping has an inode and a path
    FILE* maps = std::fopen("/proc/self/maps", "r");
    if (!maps) return;
    char line[4096];
    bool file_backed = false;
    while (std::fgets(line, sizeof line, maps)) {
        unsigned long lo = 0, hi = 0, inode = 0;
        char perms[8] = {}, path[2] = {};
        if (std::sscanf(line, "%lx-%lx %7s %*s %*s %lu %1s", &lo, &hi, perms, &inode, path) < 4) continue;
        if (lo <= begin && end <= hi) {
            file_backed = inode != 0 && path[0] == '/';
            break;
        }
    }
    std::fclose(maps);
    if (file_backed) madvise(reinterpret_cast<void*>(begin), end - begin, MADV_DONTNEED);
}

namespace {

constexpr size_t kHugePage = size_t{2} << 20, kChunk = size_t{32} << 20, kAlign = 64;

struct Chunk {
    uint8_t* base;
    size_t size, used = 0;
    int live = 0;  // buffers carved from it and not yet freed
};

std::mutex arena_mutex;
Chunk* arena_current = nullptr;  // the chunk new buffers are carved from

Chunk* map_chunk(size_t size) {  // size: a multiple of 2 MiB; mapped 2 MiB-aligned (the excess unmapped)
    const size_t span = size + kHugePage;
    void* p = mmap(nullptr, span, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) throw std::bad_alloc();
    uint8_t* raw = static_cast<uint8_t*>(p);
    uint8_t* base = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(raw) + kHugePage - 1) & ~(kHugePage - 1));
    if (base > raw) munmap(raw, base - raw);
    if (raw + span > base + size) munmap(base + size, raw + span - (base + size));
    madvise(base, size, MADV_HUGEPAGE);  // a request: refused (EINVAL) where the kernel has no THP, harmless
    return new Chunk{base, size};
}

bool hugepages_wanted() {
    const char* env = std::getenv("SPECRT_OPS_HUGEPAGES");
    return env == nullptr || std::strcmp(env, "0") != 0;
}

}  // namespace

WeightBuffer::WeightBuffer(size_t bytes) : size_(bytes) {
    if (bytes == 0) return;
    if (!hugepages_wanted()) {
        data_ = static_cast<uint8_t*>(::operator new(bytes, std::align_val_t(kAlign)));
        std::memset(data_, 0, bytes);
        return;
    }
    std::lock_guard<std::mutex> lock(arena_mutex);
    const size_t need = (bytes + kAlign - 1) & ~(kAlign - 1);
    Chunk* c = arena_current;
    if (c == nullptr || c->size - c->used < need) {
        c = map_chunk(std::max(kChunk, (need + kHugePage - 1) & ~(kHugePage - 1)));
        if (arena_current && arena_current->live == 0) {  // nothing lives in the old one: give it back
            munmap(arena_current->base, arena_current->size);
            delete arena_current;
        }
        arena_current = c;
    }
    data_ = c->base + c->used;
    c->used += need;
    ++c->live;
    chunk_ = c;
    std::memset(data_, 0, bytes);  // a chunk's memory may have held a freed buffer
}

WeightBuffer::~WeightBuffer() {
    if (data_ == nullptr) return;
    if (chunk_ == nullptr) {
        ::operator delete(data_, std::align_val_t(kAlign));
        return;
    }
    std::lock_guard<std::mutex> lock(arena_mutex);
    Chunk* c = static_cast<Chunk*>(chunk_);
    if (--c->live > 0) return;
    if (c == arena_current) {
        c->used = 0;  // empty: carve from its start again
        return;
    }
    munmap(c->base, c->size);
    delete c;
}

void dequantize_row(Format f, const uint8_t* row, int64_t k, float* out) {
    const FormatTraits& t = traits(f);
    Unpacked u;
    for (int64_t sb = 0; sb < k / t.block_elems; ++sb) {
        t.unpack(row + sb * t.block_bytes, &u);
        for (int j = 0; j < blocks_per_super(f); ++j) {
            const SubScales sub = sub_scales(f, u, j);
            float* o = out + sb * t.block_elems + j * kBlock;
            // D (c + offset) + M, as gguf dequantizes (the M term only where the format has one: -0.0 stays)
            for (int i = 0; i < kBlock; ++i) {
                const float w = sub.D[i / 16] * static_cast<float>(code(f, u, j * kBlock + i) + t.code_offset);
                o[i] = t.has_min ? w + sub.M : w;
            }
        }
    }
}

void matmul_packed(Isa isa, const Packed& w, const Activations& a, int64_t g0, int64_t g1, int64_t n_total, float* y,
                   int prefetch_from, bool wide) {
    auto kernel = isa >= Isa::Avx512Vnni ? (wide ? packed_vnni_wide : packed_vnni) : packed_avx2;
    int64_t done = 0;  // activation rows multiplied so far
#ifdef SPECRT_OPS_AMX
    if (isa == Isa::Amx && a.m >= kAmxRows && traits(w.format).plain) {  // whole passes of 16 rows on the tiles
        done = a.m / kAmxRows * kAmxRows;
        packed_amx(w, a.q.data(), a.d.data(), a.s.data(), a.ds.data(), done, g0, g1, n_total, y, prefetch_from);
    }
#endif
    if (done == a.m) return;
    const int64_t at = done * a.blocks;  // the rest's first (row, block)
    const ActRows rest{a.q.data() + at * kBlock, a.d.data() + at, a.s.data() + at, a.ds.data() + at, a.h.data() + at,
                       a.m - done};
    kernel(w, rest, g0, g1, n_total, y + done * n_total, prefetch_from);
}

namespace {

// One past the last key bias row `row` does not mask; L where it masks every key (its weights are then all alike,
// and every key counts).
int64_t visible_keys(const float* row, int64_t L) {
    int64_t n = L;
    while (n > 0 && row[n - 1] <= kMasked) --n;
    return n == 0 ? L : n;
}

std::vector<AttentionTask> plan_rows(const AttentionShape& s, const uint8_t* computed) {
    const int64_t G = s.heads / s.kv_heads;
    auto on = [&](int64_t b, int64_t t) { return computed == nullptr || computed[b * s.tokens + t] != 0; };
    std::vector<AttentionTask> tasks;
    for (int64_t b = 0; b < s.batch; ++b)
        for (int64_t h = 0; h < s.kv_heads; ++h)
            for (int64_t t = 0; t < s.tokens;) {  // runs of computed tokens, kTokensPerTask at a time
                if (!on(b, t)) {
                    ++t;
                    continue;
                }
                int64_t t1 = t + 1;
                while (t1 < s.tokens && t1 - t < kTokensPerTask && on(b, t1)) ++t1;
                tasks.push_back({b, h, t, t1, 0, G});
                t = t1;
            }
    if (static_cast<int64_t>(tasks.size()) >= kMinTasks) return tasks;
    // Too few for the threads: one token per task, then, if still too few, the G heads in pairs. A task's rows share
    // each key and value read from L2 (a row alone reads all of them: at 1-2 tokens attention was bound by that)
    std::vector<AttentionTask> split;
    for (const AttentionTask& task : tasks)
        for (int64_t t = task.t0; t < task.t1; ++t) split.push_back({task.b, task.kv_head, t, t + 1, 0, G});
    if (static_cast<int64_t>(split.size()) >= kMinTasks) return split;
    std::vector<AttentionTask> pairs;
    for (const AttentionTask& task : split)
        for (int64_t g = 0; g < G; g += 2)
            pairs.push_back({task.b, task.kv_head, task.t0, task.t1, g, std::min(G, g + 2)});
    return pairs;
}

}  // namespace

std::vector<AttentionTask> attention_plan(const AttentionShape& s, const float* bias, const uint8_t* computed) {
    std::vector<int64_t> visible(s.batch * s.bias_tokens);  // per bias row, read once
    for (int64_t b = 0; b < s.batch; ++b)
        for (int64_t t = 0; t < s.bias_tokens; ++t)
            visible[b * s.bias_tokens + t] = visible_keys(bias_row(s, bias, b, t), s.keys);
    std::vector<AttentionTask> tasks = plan_rows(s, computed);
    for (AttentionTask& task : tasks) {
        task.keys = 0;
        for (int64_t t = task.t0; t < task.t1; ++t)
            task.keys = std::max(task.keys, visible[task.b * s.bias_tokens + (s.bias_tokens == 1 ? 0 : t)]);
    }
    return tasks;
}

int64_t attention_scratch(const AttentionShape& s) {  // scores, then the scaled queries (32-byte aligned)
    const int64_t rows = kTokensPerTask * (s.heads / s.kv_heads);
    return rows * ((s.keys + 7) / 8 * 8) + rows * s.head_dim + 8;
}

namespace {

uint16_t to_f16(float f) {  // IEEE half, rounded to nearest even (F16C's and ONNX Runtime's Cast)
    uint32_t x;
    std::memcpy(&x, &f, 4);
    const uint16_t sign = static_cast<uint16_t>((x >> 16) & 0x8000u);
    const uint32_t ax = x & 0x7FFFFFFFu;
    if (ax > 0x7F800000u) return sign | 0x7E00u;  // NaN
    if (ax >= 0x47800000u) return sign | 0x7C00u;  // 65536 and up (and infinity): infinity
    if (ax < 0x38800000u) {  // below 2^-14: a subnormal half, |f| 2^24 rounded to an integer (exact scaling)
        float a;
        std::memcpy(&a, &ax, 4);
        return sign | static_cast<uint16_t>(std::nearbyint(a * 16777216.0f));
    }
    // normal: round the 23-bit mantissa to 10 at bit 13, ties to even; the carry may reach the exponent (or infinity)
    return sign | static_cast<uint16_t>((ax + 0xFFFu + ((ax >> 13) & 1u) - 0x38000000u) >> 13);
}

uint16_t to_bf16(float f) {  // bfloat16, rounded to nearest even
    uint32_t x;
    std::memcpy(&x, &f, 4);
    if ((x & 0x7FFFFFFFu) > 0x7F800000u) return static_cast<uint16_t>((x >> 16) | 0x40u);  // NaN stays NaN
    return static_cast<uint16_t>((x + 0x7FFFu + ((x >> 16) & 1u)) >> 16);
}

void store_row(CacheType type, const float* x, int64_t n, void* dst) {
    switch (type) {
        case CacheType::F16:
            for (int64_t d = 0; d < n; ++d) static_cast<uint16_t*>(dst)[d] = to_f16(x[d]);
            break;
        case CacheType::BF16:
            for (int64_t d = 0; d < n; ++d) static_cast<uint16_t*>(dst)[d] = to_bf16(x[d]);
            break;
        default: std::memcpy(dst, x, n * sizeof(float));
    }
}

// y = x cos + rotate_half(x) sin, rotate_half(x) = [-x2, x1]
void rope(const float* x, const float* cos, const float* sin, int64_t n, float* y) {
    const int64_t half = n / 2;
    for (int64_t d = 0; d < half; ++d) {
        const float a = x[d] * cos[d], b = -x[d + half] * sin[d];
        y[d] = a + b;
    }
    for (int64_t d = half; d < n; ++d) {
        const float a = x[d] * cos[d], b = x[d - half] * sin[d];
        y[d] = a + b;
    }
}

}  // namespace

void rope_rows(const AttentionShape& s, const float* qkv, int64_t p, const int64_t* cells, const float* cos,
               const float* sin, const int64_t* slots, float* q_grid, void* k, void* v, const float* q_norm,
               const float* k_norm, float eps) {
    const int64_t D = s.head_dim, H = s.heads, Hkv = s.kv_heads, width = (H + 2 * Hkv) * D;
    const int64_t item = s.cache_type == CacheType::F32 ? 4 : 2;
    float rotated[kMaxHeadDim], normed[kMaxHeadDim];
    // a head's input to the rope: as it is, or RMS-normed first (Qwen3's q and k norms)
    auto head = [&](const float* x, const float* w) {
        if (w == nullptr) return x;
        rms_norm_rows(x, w, 1, D, eps, normed);
        return static_cast<const float*>(normed);
    };
    for (int64_t i = 0; i < p; ++i) {
        const int64_t c = cells[i], b = c / s.tokens, slot = slots[c];
        const float *x = qkv + i * width, *cs = cos + c * D, *sn = sin + c * D;
        for (int64_t h = 0; h < H; ++h) rope(head(x + h * D, q_norm), cs, sn, D, q_grid + (c * H + h) * D);
        for (int64_t h = 0; h < Hkv; ++h) {
            const int64_t at = ((b * Hkv + h) * s.cache + slot) * D * item;
            rope(head(x + (H + h) * D, k_norm), cs, sn, D, rotated);
            store_row(s.cache_type, rotated, D, static_cast<uint8_t*>(k) + at);
            store_row(s.cache_type, x + (H + Hkv + h) * D, D, static_cast<uint8_t*>(v) + at);
        }
    }
}

void attention_run(Isa isa, const AttentionShape& s, const float* q, const void* k, const void* v,
                   const float* bias, const AttentionTask& task, float* scratch, float* out) {
    switch (isa) {
        case Isa::Amx:
        case Isa::Avx512Vnni: attention_avx512(s, q, k, v, bias, task, scratch, out); break;
        case Isa::Avx2: attention_avx2(s, q, k, v, bias, task, scratch, out); break;
        default: attention_group_impl(s, q, k, v, bias, task, scratch, out);
    }
}

}  // namespace specrt::ops
