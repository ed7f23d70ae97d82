// Algorithm 1 in isolation (src/steps.cpp admission), as tests/test_schedulers.py checks runtime/steps.py's: reads
// cases from stdin, each as whitespace-separated numbers
//   n g fixed_ms P  a[n*g]  active[n]  verify_ms[P+1]  has_explore  [explore[P+1]]
// and prints one JSON line per case, {"lengths": [...], "rate": r, "explored": b}, for tests/test_cpp.py to compare
// with steps.admission on the same arrays.
#include "steps.h"

#include <cstdio>
#include <iostream>
#include <vector>

using namespace specrt;

int main() {
    int64_t n, g, P;
    double fixed;
    while (std::cin >> n >> g >> fixed >> P) {
        std::vector<float> a(n * g);
        std::vector<char> active(n);
        std::vector<double> curve(P + 1);
        std::vector<char> explore;
        for (float& x : a) std::cin >> x;
        for (char& x : active) {
            int v;
            std::cin >> v;
            x = static_cast<char>(v);
        }
        for (double& x : curve) std::cin >> x;
        int has;
        std::cin >> has;
        if (has) {
            explore.resize(P + 1);
            for (char& x : explore) {
                int v;
                std::cin >> v;
                x = static_cast<char>(v);
            }
        }
        if (!std::cin) {
            std::fprintf(stderr, "admission_test: a case ended early\n");
            return 2;
        }
        const Admission out = admission(a, n, g, active, fixed, curve, explore);
        std::printf("{\"lengths\": [");
        for (int64_t i = 0; i < n; ++i) std::printf("%s%lld", i ? ", " : "", static_cast<long long>(out.lengths[i]));
        std::printf("], \"rate\": %.17g, \"explored\": %s}\n", out.rate, out.explored ? "true" : "false");
    }
    return 0;
}
