// kernel_ab: two builds of the kernels (kernels/cpu) in one process, timed in turn on SmolLM2's shapes: a base
// tree's (compiled with -Dspecrt=specrt_base, so its namespace is specrt_base::ops) against this tree's. The GGUF
// matrix products, then attention over the cache. Built and run by scripts/kernel_ab.sh, which explains the output.
#define specrt specrt_base
#include "base/attention.h"
#include "base/gguf_kernels.h"
#undef specrt
#include "attention.h"
#include "gguf_kernels.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>
#include <vector>

namespace A = specrt_base::ops;
namespace B = specrt::ops;

template <class F>
double seconds(F f, int calls) {
    const auto t0 = std::chrono::steady_clock::now();
    for (int c = 0; c < calls; ++c) f();
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() / calls;
}

struct Paired {
    double ratio;  // median over the pairs of ours / base
    double best;   // our fastest call, seconds
};

// `pairs` runs of `calls` calls each of ours then the base's (a machine whose speed drifts moves both alike)
template <class Ours, class Base>
Paired paired(Ours ours, Base base, int pairs, int calls) {
    std::vector<double> ratio;
    double best = 1e9;
    for (int p = 0; p < pairs; ++p) {
        const double t = seconds(ours, calls), t0 = seconds(base, calls);
        ratio.push_back(t / t0);
        best = std::min(best, t);
    }
    std::sort(ratio.begin(), ratio.end());
    return {ratio[ratio.size() / 2], best};
}

// A tree's attention_plan, with the bias (trees since the keys' cut at the last visible one) or without
template <class Shape>
auto plan_of(const Shape& s, const float* bias, int) -> decltype(attention_plan(s, bias)) {
    return attention_plan(s, bias);
}
template <class Shape>
auto plan_of(const Shape& s, const float*, long) -> decltype(attention_plan(s)) {
    return attention_plan(s);
}

// 32-byte aligned scratch for one task (attention_scratch floats), as the custom op gives each thread
struct Scratch {
    explicit Scratch(int64_t floats) : buf(floats + 8) {}
    float* data() { return buf.data() + ((32 - reinterpret_cast<uintptr_t>(buf.data()) % 32) % 32) / sizeof(float); }
    std::vector<float> buf;
};

// SmolLM2's attention (9 query heads, 3 KV heads of 64, float32 cache) for T query tokens over L keys, causal within
// the T new ones, the bias W >= L keys wide (a cache allocated past the position: the keys past L masked for every
// query): every task of the call in turn on one thread, as attention_plan cuts it. Reports time per (query head,
// key): the share of a row's scores, softmax and weighted values one visible key costs.
void attention(int pairs, B::Isa isa, A::Isa base_isa) {
    std::printf("attention, 9 heads over 3 KV heads of 64, one thread: time of this tree's call / the base's, "
                "ns per (head, visible key) of this tree's best run, same bits\n");
    std::mt19937 rng(2);
    std::normal_distribution<float> normal;
    const int64_t H = 9, Hkv = 3, D = 64, S = 1024;
    const int64_t cases[][2] = {{136, 136}, {320, 320}, {900, 900}, {136, 256}, {320, 512}};
    for (const auto& c : cases) {
        const int64_t keys = c[0], width = c[1];
        std::printf("L=%-4ld of %-4ld              ", static_cast<long>(keys), static_cast<long>(width));
        for (int64_t T : {1, 2, 3, 4, 8}) {
            const B::AttentionShape s{1, T, H, Hkv, D, S, width, T, 0.125f};
            const A::AttentionShape sa{1, T, H, Hkv, D, S, width, T, 0.125f};
            std::vector<float> q(T * H * D), k(Hkv * S * D), v(Hkv * S * D), bias(T * width), y(T * H * D),
                base_y(T * H * D);
            for (std::vector<float>* x : {&q, &k, &v})
                for (float& e : *x) e = normal(rng);
            const float masked = -3.4028235e38f / 2;  // the exporter's mask
            for (int64_t t = 0; t < T; ++t)
                for (int64_t l = 0; l < width; ++l) bias[t * width + l] = l <= keys - T + t ? 0.0f : masked;
            const std::vector<B::AttentionTask> tasks = plan_of(s, bias.data(), 0);
            const std::vector<A::AttentionTask> base_tasks = plan_of(sa, bias.data(), 0);
            Scratch scratch(B::attention_scratch(s)), base_scratch(A::attention_scratch(sa));
            auto ours = [&] {
                for (const B::AttentionTask& t : tasks)
                    B::attention_run(isa, s, q.data(), k.data(), v.data(), bias.data(), t, scratch.data(), y.data());
            };
            auto base = [&] {
                for (const A::AttentionTask& t : base_tasks)
                    A::attention_run(base_isa, sa, q.data(), k.data(), v.data(), bias.data(), t, base_scratch.data(),
                                     base_y.data());
            };
            ours();
            base();
            const bool same = std::memcmp(y.data(), base_y.data(), y.size() * sizeof(float)) == 0;
            const int calls = static_cast<int>(std::max<int64_t>(3, 20000000 / (T * H * width * D)));
            const Paired r = paired(ours, base, pairs, calls);
            std::printf("  T=%ld %.3f %5.2f %s", static_cast<long>(T), r.ratio, r.best * 1e9 / (T * H * keys),
                        same ? "same" : "DIFF");
        }
        std::printf("\n");
    }
}

int main(int argc, char** argv) {
    const int pairs = argc > 1 ? std::atoi(argv[1]) : 21;
    struct Shape {
        const char* name;
        int64_t n, k;
        B::Format f;
    } shapes[] = {{"q_proj/o_proj 576x576 Q4_1", 576, 576, B::Format::Q4_1},
                  {"gate/up 1536x576 Q4_1", 1536, 576, B::Format::Q4_1},
                  {"down 576x1536 Q4_1", 576, 1536, B::Format::Q4_1},
                  {"gate/up 1536x576 Q8_0", 1536, 576, B::Format::Q8_0},
                  {"lm_head 49152x576 Q8_0", 49152, 576, B::Format::Q8_0}};
    const B::Isa isa = B::best_isa();
    const A::Isa base_isa = A::best_isa();  // its own best: a base tree may lack this tree's newest kernels
    std::printf("%s (base: %s), one thread; time of this tree's call / the base's (median of %d paired runs), GMAC/s of this "
                "tree's best run, and whether the outputs are the same bits\n",
                B::isa_name(isa), A::isa_name(base_isa), pairs);
    std::mt19937 rng(1);
    std::normal_distribution<float> normal;
    for (const Shape& s : shapes) {
        const int64_t blocks = s.k / B::kBlock;
        const int bytes = B::block_bytes(s.f);
        std::vector<uint8_t> w(s.n * blocks * bytes);
        for (uint8_t& x : w) x = static_cast<uint8_t>(rng());
        for (int64_t b = 0; b < s.n * blocks; ++b) {  // finite fp16 scales (and minimums): 2^-7, -2^-7
            uint8_t* p = w.data() + b * bytes;
            p[0] = 0x00, p[1] = 0x20;
            if (s.f == B::Format::Q4_1) p[2] = 0x00, p[3] = 0xA0;
        }
        B::Packed packed;
        B::pack(s.f, w.data(), s.n, blocks, packed);
        A::Packed base_packed;
        A::pack(static_cast<A::Format>(static_cast<int>(s.f)), w.data(), s.n, blocks, base_packed);
        std::printf("%-28s", s.name);
        for (int m : {1, 2, 4, 8, 16}) {
            std::vector<float> a(m * s.k), y(m * s.n), base_y(m * s.n);
            for (float& x : a) x = normal(rng);
            B::Activations acts;
            B::quantize(isa, a.data(), m, s.k, acts);
            A::Activations base_acts;
            A::quantize(base_isa, a.data(), m, s.k, base_acts);
            auto ours = [&] { B::matmul_packed(isa, packed, acts, 0, packed.groups, s.n, y.data()); };
            auto base = [&] {
                A::matmul_packed(base_isa, base_packed, base_acts, 0, base_packed.groups, s.n, base_y.data());
            };
            ours();
            base();
            const bool same = std::memcmp(y.data(), base_y.data(), y.size() * sizeof(float)) == 0;
            const int calls = static_cast<int>(std::max<int64_t>(2, 30000000 / (s.n * s.k * m)));
            const Paired r = paired(ours, base, pairs, calls);
            std::printf("  M=%-2d %.3f %4.0f %s", m, r.ratio, s.n * s.k * m / r.best / 1e9, same ? "same" : "DIFF");
        }
        std::printf("\n");
    }
    attention(pairs, isa, base_isa);
}
