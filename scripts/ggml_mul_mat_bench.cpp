// llama.cpp's own matrix products (ggml_mul_mat on ggml's CPU backend) timed one call at a time, for
// scripts/bench_ops.py --ggml: the figures beside specrt::MatMulGGUF and ONNX Runtime's MatMulNBits.
//
//   ggml_mul_mat_bench FORMAT N K THREADS CALLS WEIGHTS ACTIVATIONS M[,M...]
//
// FORMAT q4_0 | q4_1 | q8_0; WEIGHTS a file of N rows of K elements in that GGUF format (the bytes bench_ops.py gives
// MatMulGGUF), ACTIVATIONS a file of float32 rows of K elements (a call of M rows takes the first M), the weights in
// a plain CPU buffer: llama.cpp repacks (interleaves) rows of Q4_0 on x86 when it loads a model, but
// neither Q4_1 nor Q8_0 (the default model's formats; ggml-cpu/repack.cpp of llama-cpp-python 0.3.36), so a plain
// buffer is what its decoding multiplies. One line of JSON per M: the median microseconds of
// ggml_backend_graph_compute over CALLS calls (after 10 unmeasured) on a thread pool of THREADS threads kept between
// calls (as llama.cpp keeps one), and the product's last row (for the caller to check it against its own). Built against the headers of the llama.cpp that llama-cpp-python vendors and
// linked with the libraries it installs (bench_ops.py --ggml does both).
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iterator>
#include <sstream>
#include <string>
#include <vector>

#include "ggml-alloc.h"
#include "ggml-backend.h"
#include "ggml-cpu.h"
#include "ggml.h"

namespace {

[[noreturn]] void die(const std::string& what) {
    std::fprintf(stderr, "ggml_mul_mat_bench: %s\n", what.c_str());
    std::exit(1);
}

ggml_type format_type(const std::string& f) {
    if (f == "q4_0") return GGML_TYPE_Q4_0;
    if (f == "q4_1") return GGML_TYPE_Q4_1;
    if (f == "q8_0") return GGML_TYPE_Q8_0;
    die("unknown format " + f + " (q4_0, q4_1, q8_0)");
}

// The weights as a tensor in a CPU buffer, and a graph computing them times an activation of M rows.
struct Product {
    ggml_context* weights_ctx = nullptr;
    ggml_context* graph_ctx = nullptr;
    ggml_backend_buffer_t weights_buf = nullptr;
    ggml_gallocr_t alloc = nullptr;
    ggml_cgraph* graph = nullptr;
    ggml_tensor* x = nullptr;
    ggml_tensor* y = nullptr;

    Product(ggml_type type, int64_t n, int64_t k, int64_t m, const std::string& bytes) {
        ggml_init_params wp{2 * ggml_tensor_overhead(), nullptr, true};
        weights_ctx = ggml_init(wp);
        ggml_tensor* w = ggml_new_tensor_2d(weights_ctx, type, k, n);
        if (ggml_nbytes(w) != bytes.size()) die("the weights file does not hold N x K elements of the format");
        weights_buf = ggml_backend_alloc_ctx_tensors_from_buft(weights_ctx, ggml_backend_cpu_buffer_type());
        if (!weights_buf) die("cannot allocate the weights");
        ggml_backend_buffer_set_usage(weights_buf, GGML_BACKEND_BUFFER_USAGE_WEIGHTS);
        ggml_backend_tensor_set(w, bytes.data(), 0, bytes.size());
        ggml_init_params gp{ggml_tensor_overhead() * 8 + ggml_graph_overhead(), nullptr, true};
        graph_ctx = ggml_init(gp);
        x = ggml_new_tensor_2d(graph_ctx, GGML_TYPE_F32, k, m);
        y = ggml_mul_mat(graph_ctx, w, x);
        graph = ggml_new_graph(graph_ctx);
        ggml_build_forward_expand(graph, y);
        alloc = ggml_gallocr_new(ggml_backend_cpu_buffer_type());
        if (!ggml_gallocr_alloc_graph(alloc, graph)) die("cannot allocate the graph");
    }
    ~Product() {
        ggml_gallocr_free(alloc);
        ggml_backend_buffer_free(weights_buf);
        ggml_free(graph_ctx);
        ggml_free(weights_ctx);
    }
};

}  // namespace

int main(int argc, char** argv) {
    if (argc != 9) die("usage: FORMAT N K THREADS CALLS WEIGHTS ACTIVATIONS M[,M...]");
    const ggml_type type = format_type(argv[1]);
    const int64_t n = std::atoll(argv[2]), k = std::atoll(argv[3]);
    const int threads = std::atoi(argv[4]), calls = std::atoi(argv[5]);
    std::ifstream f(argv[6], std::ios::binary);
    if (!f) die(std::string("cannot read ") + argv[6]);
    const std::string bytes((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
    std::ifstream af(argv[7], std::ios::binary);
    if (!af) die(std::string("cannot read ") + argv[7]);
    const std::string acts((std::istreambuf_iterator<char>(af)), std::istreambuf_iterator<char>());
    std::vector<int64_t> rows;
    std::stringstream ms(argv[8]);
    for (std::string t; std::getline(ms, t, ',');) rows.push_back(std::atoll(t.c_str()));

    ggml_cpu_init();
    ggml_backend_t backend = ggml_backend_cpu_init();
    ggml_backend_cpu_set_n_threads(backend, threads);
    ggml_threadpool_params tpp = ggml_threadpool_params_default(threads);
    ggml_threadpool* pool = ggml_threadpool_new(&tpp);
    ggml_backend_cpu_set_threadpool(backend, pool);
    for (int64_t m : rows) {
        if (static_cast<int64_t>(acts.size()) < m * k * 4) die("the activations file holds fewer than M rows");
        Product p(type, n, k, m, bytes);
        ggml_backend_tensor_set(p.x, acts.data(), 0, m * k * sizeof(float));
        std::vector<double> us;
        for (int i = 0; i < calls + 10; ++i) {
            const auto t0 = std::chrono::steady_clock::now();
            if (ggml_backend_graph_compute(backend, p.graph) != GGML_STATUS_SUCCESS) die("compute failed");
            const auto t1 = std::chrono::steady_clock::now();
            if (i >= 10) us.push_back(std::chrono::duration<double, std::micro>(t1 - t0).count());
        }
        std::sort(us.begin(), us.end());
        std::vector<float> last(n);
        ggml_backend_tensor_get(p.y, last.data(), (m - 1) * n * sizeof(float), n * sizeof(float));
        std::printf("{\"M\": %lld, \"us\": %.1f, \"last_row\": [", static_cast<long long>(m), us[us.size() / 2]);
        for (int64_t j = 0; j < n; ++j) std::printf(j ? ", %.6g" : "%.6g", last[j]);
        std::printf("]}\n");
        std::fflush(stdout);
    }
    ggml_threadpool_free(pool);
    ggml_backend_free(backend);
    return 0;
}
