// kernel_ab: two builds of the GGUF matrix kernels (runtime/cpp/ops) in one process, timed in turn on SmolLM2's
// shapes: a base tree's (compiled with -Dspecrt=specrt_base, so its namespace is specrt_base::ops) against this tree's.
// Built and run by scripts/kernel_ab.sh, which explains the output.
#define specrt specrt_base
#include "base/gguf_kernels.h"
#undef specrt
#include "gguf_kernels.h"

#include <algorithm>
#include <chrono>
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
    const A::Isa base_isa = static_cast<A::Isa>(static_cast<int>(isa));
    std::printf("%s, one thread; time of this tree's call / the base's (median of %d paired runs), GMAC/s of this "
                "tree's best run, and whether the outputs are the same bits\n", B::isa_name(isa), pairs);
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
            std::vector<double> ratio;
            double best = 1e9;
            for (int p = 0; p < pairs; ++p) {
                const double t = seconds(ours, calls), t0 = seconds(base, calls);
                ratio.push_back(t / t0);
                best = std::min(best, t);
            }
            std::sort(ratio.begin(), ratio.end());
            std::printf("  M=%-2d %.3f %4.0f %s", m, ratio[ratio.size() / 2], s.n * s.k * m / best / 1e9,
                        same ? "same" : "DIFF");
        }
        std::printf("\n");
    }
}
