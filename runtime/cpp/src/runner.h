// One graph family of an artifact on one ONNX Runtime session (runtime/backends/ort.py's OrtRunner): host buffers and
// an Ort::IoBinding per (slot, bucket) made on first use and reused; each layer's KV cache one buffer (all in one
// CacheBlock) bound in place as both past.* and present.* (the graph scatters new K/V into it); a cache of named
// length S grows by GROWTH positions before a call that writes past it. A draft family's greedy variant runs on its
// own session over the same cache.
#pragma once

#include "artifact.h"

#include <onnxruntime/onnxruntime_cxx_api.h>

#include <memory>
#include <set>
#include <tuple>
#include <utility>

namespace specrt {

// A host tensor of a call: int64 or float32 (scalars have one element).
struct Tensor {
    std::string dtype;
    std::vector<int64_t> shape;
    std::vector<int64_t> i;
    std::vector<float> f;

    int64_t* i64() { return i.data(); }
    float* f32() { return f.data(); }
    size_t size() const { return dtype == "int64" ? i.size() : f.size(); }
};
using Tensors = std::map<std::string, Tensor>;

// Zeroed memory for every KV cache of a runner, one anonymous mapping: 2 MiB-aligned, advised for transparent huge
// pages (madvise, where the kernel has them) and written once when made, so attention walks 2 MiB pages and no call
// takes a page fault (the Python runner's `_cache_block`, runtime/backends/ort.py).
class CacheBlock {
public:
    CacheBlock() = default;
    explicit CacheBlock(size_t bytes);
    CacheBlock(const CacheBlock&) = delete;
    CacheBlock& operator=(const CacheBlock&) = delete;
    CacheBlock(CacheBlock&& o) noexcept { swap(o); }
    CacheBlock& operator=(CacheBlock&& o) noexcept {
        CacheBlock(std::move(o)).swap(*this);
        return *this;
    }
    ~CacheBlock();
    uint8_t* data() const { return data_; }
    size_t size() const { return size_; }

private:
    void swap(CacheBlock& o) noexcept {
        std::swap(data_, o.data_);
        std::swap(size_, o.size_);
        std::swap(mapped_, o.mapped_);
    }
    uint8_t* data_ = nullptr;
    size_t size_ = 0, mapped_ = 0;  // mapped_: bytes mapped at data_ (whole 2 MiB pages)
};

class Runner {
public:
    Runner(Ort::Env& env, const fs::path& dir, const GraphSpec& spec, int threads, bool spin);

    const GraphSpec& spec() const { return spec_; }
    int64_t slots() const { return slots_; }
    // Zeroed caches for `slots` slots (bindings of another size are dropped).
    void allocate(int64_t slots);
    // The bound host inputs of a call over slots [slot, slot + B) at `bucket`: fill them in place, then run().
    Tensors& inputs(int64_t slot, const Bucket& bucket, bool greedy = false);
    // Run that call; its outputs stay valid until it runs again.
    Tensors& run(int64_t slot, const Bucket& bucket, bool greedy = false);
    // Copy cache positions from[k] to to[k] of `slot`, in order, in every layer (a draft tree's accepted path, to the
    // positions after its anchor; each to[k] <= from[k], both increasing).
    void move_rows(int64_t slot, const std::vector<int64_t>& from, const std::vector<int64_t>& to);

private:
    struct Call {
        Tensors in, out;
        std::vector<Ort::Value> values, cache_values;  // the tensors bound (views on in, out and the cache)
        std::unique_ptr<Ort::IoBinding> binding;
        int64_t slot = 0, slots = 0, length = -1;
        bool greedy = false;
    };
    using Key = std::tuple<bool, int64_t, Bucket>;

    Call& call(int64_t slot, const Bucket& bucket, bool greedy);
    void bind_cache(Call& c);
    void resize(int64_t length);
    void prime();

    GraphSpec spec_, greedy_spec_;
    std::unique_ptr<Ort::Session> session_, greedy_session_;
    std::vector<TensorSpec> cache_specs_;
    ONNXTensorElementDataType cache_type_ = ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT;  // float32, float16 or bfloat16
    size_t cache_item_ = sizeof(float);                                          // its bytes per element
    CacheBlock cache_block_;
    std::vector<uint8_t*> cache_;  // per layer's key and value, in cache_block_: [slots, Hkv, length, D] elements
    std::map<Key, Call> calls_;
    std::set<Bucket> primed_;  // decoding buckets run once on this session (prime)
    int64_t slots_ = 0, length_ = 0;
    bool sized_ = false;
};

// The process's ONNX Runtime environment, with a global intra-op pool of `threads` (0: the cores this process may run
// on) sized by the first call; global_pool_threads() says its size.
Ort::Env& ort_env(int threads);
// ONNX Runtime's library, loaded once (onnxruntime_loader.cpp); throws Error(SPECRT_ERROR_RUNTIME) naming where it
// looked when it is not found or too old. ort_env() calls it first.
void load_onnxruntime();
int global_pool_threads();
int default_threads();

}  // namespace specrt
