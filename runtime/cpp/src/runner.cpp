#include "runner.h"
#include "io_names.h"
#include "rules.h"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <numeric>
#include <dlfcn.h>
#include <sched.h>
#include <sys/mman.h>

namespace specrt {

namespace {

constexpr int64_t kGrowth = 64;  // positions a sized cache grows by (runtime/backends/ort.py GROWTH)

std::string first_line(const std::string& s) { return s.substr(0, s.find('\n')); }

size_t count(const std::vector<int64_t>& shape) {
    size_t n = 1;
    for (int64_t d : shape) n *= static_cast<size_t>(d);
    return n;
}

// The graph file's declared I/O against the manifest's (specrt/artifact.py check_graph_io).
void check_graph_io(Ort::Session& session, const GraphSpec& spec) {
    Ort::AllocatorWithDefaultOptions alloc;
    std::map<std::string, std::vector<Dim>> declared;
    auto add = [&](size_t n, bool input) {
        for (size_t i = 0; i < n; ++i) {
            auto name = input ? session.GetInputNameAllocated(i, alloc) : session.GetOutputNameAllocated(i, alloc);
            Ort::TypeInfo type = input ? session.GetInputTypeInfo(i) : session.GetOutputTypeInfo(i);
            auto info = type.GetTensorTypeAndShapeInfo();  // a view into `type`: keep it alive
            std::vector<int64_t> dims = info.GetShape();
            std::vector<const char*> names(dims.size());
            info.GetSymbolicDimensions(names.data(), names.size());
            std::vector<Dim> shape;
            for (size_t k = 0; k < dims.size(); ++k) {
                if (names[k] && names[k][0]) shape.emplace_back(std::string(names[k]));
                else shape.emplace_back(dims[k]);
            }
            declared[name.get()] = shape;
        }
    };
    add(session.GetInputCount(), true);
    add(session.GetOutputCount(), false);
    for (const auto* list : {&spec.inputs, &spec.outputs}) {
        for (const TensorSpec& t : *list) {
            auto it = declared.find(t.name);
            if (it == declared.end())
                throw Error(SPECRT_ERROR_ARTIFACT, spec.file + ": the graph has no " + t.name + " (corrupt artifact? re-export it)");
            if (it->second != t.shape)
                throw Error(SPECRT_ERROR_ARTIFACT, spec.file + ": " + t.name + " is " + dims_text(it->second) +
                                                       " in the graph, " + dims_text(t.shape) + " in the manifest");
        }
    }
}

// The cache length and buckets the graph file records it was exported for against the manifest's (specrt/artifact.py
// check_graph_meta); files exported before graphs recorded them are checked by their declared shapes only.
void check_graph_meta(Ort::Session& session, const GraphSpec& spec) {
    Ort::AllocatorWithDefaultOptions alloc;
    Ort::ModelMetadata meta = session.GetModelMetadata();
    Ort::AllocatedStringPtr text = meta.LookupCustomMetadataMapAllocated(rules::kGraphMeta, alloc);
    if (!text) return;
    int64_t max_seq = 0;
    std::map<std::string, std::vector<Bucket>> buckets;
    try {
        const nlohmann::json j = nlohmann::json::parse(text.get());
        max_seq = j.at("max_seq").get<int64_t>();
        for (const auto& [use, list] : j.at("buckets").items())
            for (const auto& b : list) buckets[use].push_back(b.get<Bucket>());
    } catch (const nlohmann::json::exception&) {
        throw Error(SPECRT_ERROR_ARTIFACT, spec.file + ": its " + rules::kGraphMeta +
                                               " metadata is malformed (corrupt artifact? re-export it)");
    }
    if (max_seq != spec.max_seq)
        throw Error(SPECRT_ERROR_ARTIFACT, spec.file + " was exported for " + std::to_string(max_seq) +
                                               " cache positions but the manifest says max_seq " +
                                               std::to_string(spec.max_seq) +
                                               " (manifest and graphs disagree; re-export the artifact)");
    if (buckets != spec.buckets)
        throw Error(SPECRT_ERROR_ARTIFACT, spec.file + " was exported for other shapes than the manifest's " + spec.name +
                                               " buckets (manifest and graphs disagree; re-export the artifact)");
}

// libspecrt_ops: $SPECRT_OPS_LIB, else beside this library (the build puts both in one folder)
fs::path ops_library() {
    if (const char* given = std::getenv("SPECRT_OPS_LIB"); given && *given) {
        if (!fs::is_regular_file(given))
            throw Error(SPECRT_ERROR_ARTIFACT, std::string("$SPECRT_OPS_LIB names ") + given +
                                                   ", which is not a file (libspecrt_ops.so)");
        // the library's own entry point, looked up before ONNX Runtime loads it (specrt/native.py _isa)
        void* lib = dlopen(given, RTLD_NOW | RTLD_LOCAL);
        const bool ours = lib && dlsym(lib, "specrt_ops_isa") && dlsym(lib, "RegisterCustomOps");
        const std::string why = lib ? "it lacks specrt_ops_isa / RegisterCustomOps" : first_line(dlerror());
        if (lib) dlclose(lib);
        if (!ours)
            throw Error(SPECRT_ERROR_ARTIFACT, std::string("$SPECRT_OPS_LIB names ") + given +
                                                   ", which is not specrt's kernels library (libspecrt_ops.so): " + why);
        return given;
    }
    Dl_info info;
    if (dladdr(reinterpret_cast<void*>(&ops_library), &info) && info.dli_fname) {
        fs::path beside = fs::path(info.dli_fname).parent_path() / "libspecrt_ops.so";
        if (fs::is_regular_file(beside)) return beside;
    }
    throw Error(SPECRT_ERROR_ARTIFACT, "this artifact runs on specrt's CPU kernels (exported with --kernels specrt) "
                                       "and libspecrt_ops.so is neither beside libspecrt nor named by $SPECRT_OPS_LIB: "
                                       "build it (cmake --build build/cpp --target specrt_ops)");
}

std::unique_ptr<Ort::Session> open_session(Ort::Env& env, const fs::path& dir, const GraphSpec& spec, int threads,
                                           bool spin) {
    fs::path file = dir / spec.file;
    if (!fs::is_regular_file(file)) throw Error(SPECRT_ERROR_ARTIFACT, file.string() + " is missing (corrupt artifact? re-export it)");
    Ort::SessionOptions so;
    so.SetIntraOpNumThreads(threads > 0 ? threads : default_threads());
    so.SetInterOpNumThreads(1);
    so.SetGraphOptimizationLevel(GraphOptimizationLevel::ORT_ENABLE_ALL);
    so.SetLogSeverityLevel(3);
    // drafts run in turn with the target: idle spinning threads would steal the cores it needs next
    if (global_pool_threads() == (threads > 0 ? threads : default_threads())) {
        // the process's one pool, which every session of an engine shares: the target's threads, spinning after a
        // call, cannot steal the cores a draft head's call needs next (they are the same threads)
        so.DisablePerSessionThreads();
    } else if (!spin) {
        so.AddConfigEntry("session.intra_op.allow_spinning", "0");
    }
    const fs::path ops = spec.kernels ? ops_library() : fs::path();
    std::unique_ptr<Ort::Session> session;
    try {
        if (!ops.empty()) so.RegisterCustomOpsLibrary(ops.c_str());
        session = std::make_unique<Ort::Session>(env, file.c_str(), so);
    } catch (const Ort::Exception& e) {
        throw Error(SPECRT_ERROR_ARTIFACT, "cannot load " + spec.file + ": " + first_line(e.what()));
    }
    check_graph_meta(*session, spec);
    check_graph_io(*session, spec);
    return session;
}

}  // namespace

int default_threads() {  // the cores this process may run on (os.sched_getaffinity in Python)
    cpu_set_t set;
    CPU_ZERO(&set);
    if (sched_getaffinity(0, sizeof(set), &set) == 0) return std::max(1, CPU_COUNT(&set));
    return 1;
}

namespace {
int pool_threads = 0;  // the global pool's size, fixed by the first engine of the process
}

Ort::Env& ort_env(int threads) {
    // ONNX Runtime has one environment per process: its global thread pool is sized for the first engine opened;
    // an engine asking for another count later runs sessions with threads of their own
    load_onnxruntime();
    static Ort::Env env = [threads] {
        pool_threads = threads > 0 ? threads : default_threads();
        Ort::ThreadingOptions tp;
        tp.SetGlobalIntraOpNumThreads(pool_threads);
        tp.SetGlobalInterOpNumThreads(1);
        tp.SetGlobalSpinControl(1);
        return Ort::Env(tp, ORT_LOGGING_LEVEL_ERROR, "specrt");
    }();
    return env;
}

int global_pool_threads() { return pool_threads; }

Runner::Runner(Ort::Env& env, const fs::path& dir, const GraphSpec& spec, int threads, bool spin)
    : spec_(spec), greedy_spec_(spec) {
    session_ = open_session(env, dir, spec, threads, spin);
    if (auto g = spec.greedy()) {
        greedy_spec_ = *g;
        greedy_session_ = open_session(env, dir, greedy_spec_, threads, spin);
    }
    for (const TensorSpec& t : spec.inputs) {
        if (t.name.rfind(io::kPastPrefix, 0) != 0) continue;
        if (t.dtype == "float16" || t.dtype == "bfloat16") {  // `specrt export --kv-dtype`
            cache_type_ = t.dtype == "float16" ? ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16
                                               : ONNX_TENSOR_ELEMENT_DATA_TYPE_BFLOAT16;
            cache_item_ = 2;
        } else if (t.dtype != "float32") {
            throw Error(SPECRT_ERROR_ARTIFACT,
                        spec.file + ": a " + t.dtype + " KV cache (this runtime reads float32, float16 and bfloat16)");
        }
        if (!cache_specs_.empty() && t.dtype != cache_specs_.front().dtype)
            throw Error(SPECRT_ERROR_ARTIFACT, spec.file + ": KV caches of more than one type");
        if (t.shape.size() != 4) throw Error(SPECRT_ERROR_ARTIFACT, spec.file + ": " + t.name + " is not [B, H, S, D]");
        cache_specs_.push_back(t);
    }
    for (const auto* list : {&spec.inputs, &spec.outputs})
        for (const TensorSpec& t : *list)
            if (t.name.rfind(io::kPastPrefix, 0) != 0 && t.name.rfind(io::kPresentPrefix, 0) != 0 && t.dtype != "int64" &&
                t.dtype != "float32")
                throw Error(SPECRT_ERROR_ARTIFACT, spec.file + ": " + t.name + " is " + t.dtype +
                                                       " (this runtime reads int64 and float32 graphs)");
    sized_ = spec.sized_cache();
}

void Runner::allocate(int64_t slots) {
    if (slots == slots_ && !cache_.empty()) return;
    slots_ = slots;
    calls_.clear();
    cache_.clear();
    cache_block_ = CacheBlock();  // the old one's memory is free before the new one is taken
    length_ = 0;
    resize(sized_ ? std::min(kGrowth, spec_.max_seq) : spec_.max_seq);
    prime();
}

// Each decoding bucket that fits the slots run once on the fresh cache, before any other call of its batch: ONNX
// Runtime keeps one memory plan per XOR of a call's input dimensions, set by the first call of that key, and for a
// target graph a decoding call and every verify of the same batch share it (runtime/backends/ort.py `_prime`).
void Runner::prime() {
    auto it = spec_.buckets.find("decode");
    if (it == spec_.buckets.end()) return;
    bool ran = false;
    for (const Bucket& bucket : it->second) {
        if (bucket.at("B") > slots_ || !primed_.insert(bucket).second) continue;
        Tensors& in = inputs(0, bucket);
        for (auto& [name, t] : in) {
            std::fill(t.i.begin(), t.i.end(), 0);
            std::fill(t.f.begin(), t.f.end(), 0.0f);
            if (name == io::kTokenRows || name == io::kLogitRows) std::iota(t.i.begin(), t.i.end(), 0);
        }
        run(0, bucket);
        ran = true;
    }
    if (ran && cache_block_.size())
        std::memset(cache_block_.data(), 0, cache_block_.size());  // what they wrote: zeroed, as promised
}

Tensors& Runner::inputs(int64_t slot, const Bucket& bucket, bool greedy) { return call(slot, bucket, greedy).in; }

Tensors& Runner::run(int64_t slot, const Bucket& bucket, bool greedy) {
    Call& c = call(slot, bucket, greedy);
    if (sized_) {
        const auto& w = c.in.at(io::kWriteIndex).i;
        int64_t need = *std::max_element(w.begin(), w.end()) + bucket.at("T");
        if (need > length_ && length_ < spec_.max_seq) resize(std::min(spec_.max_seq, (need + kGrowth - 1) / kGrowth * kGrowth));
    }
    if (c.length != length_) bind_cache(c);
    try {
        (c.greedy ? greedy_session_ : session_)->Run(Ort::RunOptions{nullptr}, *c.binding);
    } catch (const Ort::Exception& e) {
        throw Error(SPECRT_ERROR_RUNTIME, spec_.file + ": " + first_line(e.what()));
    }
    return c.out;
}

void Runner::move_rows(int64_t slot, const std::vector<int64_t>& from, const std::vector<int64_t>& to) {
    for (size_t i = 0; i < cache_specs_.size(); ++i) {
        const std::vector<int64_t> shape = cache_specs_[i].resolve({{"B", slots_}, {io::kCacheLen, length_}});
        const int64_t heads = shape[1], row = shape[3] * static_cast<int64_t>(cache_item_);
        for (int64_t h = 0; h < heads; ++h) {
            uint8_t* base = cache_[i] + (slot * heads + h) * length_ * row;
            for (size_t k = 0; k < from.size(); ++k)
                if (from[k] != to[k]) std::memcpy(base + to[k] * row, base + from[k] * row, row);
        }
    }
}

Runner::Call& Runner::call(int64_t slot, const Bucket& bucket, bool greedy) {
    greedy = greedy && greedy_session_;
    Key key{greedy, slot, bucket};
    auto it = calls_.find(key);
    if (it != calls_.end()) return it->second;
    const int64_t b = bucket.at("B");
    if (slot < 0 || slot + b > slots_)  // checked before the call is kept: a refused call leaves nothing behind
        throw Error(SPECRT_ERROR_REQUEST, spec_.name + ": a call over slots [" + std::to_string(slot) + ", " +
                                              std::to_string(slot + b) + "), " + std::to_string(slots_) + " allocated");
    Call c;
    c.slot = slot;
    c.slots = b;
    c.greedy = greedy;
    const GraphSpec& spec = greedy ? greedy_spec_ : spec_;
    c.binding = std::make_unique<Ort::IoBinding>(greedy ? *greedy_session_ : *session_);
    auto mem = Ort::MemoryInfo::CreateCpu(OrtArenaAllocator, OrtMemTypeDefault);
    for (bool input : {true, false}) {
        for (const TensorSpec& t : input ? spec.inputs : spec.outputs) {
            if (t.name.rfind(input ? io::kPastPrefix : io::kPresentPrefix, 0) == 0) continue;
            Tensor& x = (input ? c.in : c.out)[t.name];
            x.dtype = t.dtype;
            x.shape = t.resolve(bucket);
            if (t.dtype == "int64") {
                x.i.assign(count(x.shape), 0);
                c.values.push_back(Ort::Value::CreateTensor<int64_t>(mem, x.i.data(), x.i.size(), x.shape.data(), x.shape.size()));
            } else {
                x.f.assign(count(x.shape), 0.0f);
                c.values.push_back(Ort::Value::CreateTensor<float>(mem, x.f.data(), x.f.size(), x.shape.data(), x.shape.size()));
            }
            if (input) c.binding->BindInput(t.name.c_str(), c.values.back());
            else c.binding->BindOutput(t.name.c_str(), c.values.back());
        }
    }
    Call& kept = calls_.emplace(key, std::move(c)).first->second;
    bind_cache(kept);
    return kept;
}

// Each layer's cache rows [slot, slot + B) as both past and present.
void Runner::bind_cache(Call& c) {
    auto mem = Ort::MemoryInfo::CreateCpu(OrtArenaAllocator, OrtMemTypeDefault);
    c.cache_values.clear();
    for (size_t i = 0; i < cache_specs_.size(); ++i) {
        const TensorSpec& t = cache_specs_[i];
        std::vector<int64_t> shape = t.resolve({{"B", c.slots}, {io::kCacheLen, length_}});
        size_t per_slot = count(shape) / static_cast<size_t>(c.slots);
        c.cache_values.push_back(Ort::Value::CreateTensor(mem, cache_[i] + c.slot * per_slot * cache_item_,
                                                          count(shape) * cache_item_, shape.data(), shape.size(),
                                                          cache_type_));
        c.binding->BindInput(t.name.c_str(), c.cache_values.back());
        std::string present = io::kPresentPrefix + t.name.substr(sizeof(io::kPastPrefix) - 1);
        c.binding->BindOutput(present.c_str(), c.cache_values.back());
    }
    c.length = length_;
}

// (Re)allocate every layer's cache at `length` positions per slot, keeping what it holds.
void Runner::resize(int64_t length) {
    std::vector<std::vector<int64_t>> shapes;
    std::vector<size_t> at;  // each layer's offset in the block, on its own cache lines
    size_t total = 0;
    for (const TensorSpec& t : cache_specs_) {
        shapes.push_back(t.resolve({{"B", slots_}, {io::kCacheLen, length}}));
        at.push_back(total);
        total += (count(shapes.back()) * cache_item_ + 63) / 64 * 64;
    }
    CacheBlock block(total);  // zero bits: 0.0 in each type
    std::vector<uint8_t*> next;
    for (size_t i = 0; i < cache_specs_.size(); ++i) {
        next.push_back(block.data() + at[i]);
        if (!cache_.empty() && length_ > 0) {  // [B, H, S, D]: copy each (slot, head)'s first min(S) rows
            const std::vector<int64_t>& shape = shapes[i];
            const int64_t rows = shape[0] * shape[1], row = shape[3] * static_cast<int64_t>(cache_item_),
                          keep = std::min(length, length_);
            for (int64_t r = 0; r < rows; ++r)
                std::memcpy(next[i] + r * length * row, cache_[i] + r * length_ * row, keep * row);
        }
    }
    cache_block_ = std::move(block);
    cache_ = std::move(next);
    length_ = length;
}

CacheBlock::CacheBlock(size_t bytes) : size_(bytes) {
    if (bytes == 0) return;
    constexpr size_t kHugePage = size_t{2} << 20;
    mapped_ = (bytes + kHugePage - 1) / kHugePage * kHugePage;
    const size_t span = mapped_ + kHugePage;
    void* p = mmap(nullptr, span, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED)
        throw Error(SPECRT_ERROR_RUNTIME, "cannot allocate " + std::to_string(bytes >> 20) + " MiB of KV cache");
    uint8_t* raw = static_cast<uint8_t*>(p);
    data_ = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(raw) + kHugePage - 1) & ~(kHugePage - 1));
    if (data_ > raw) munmap(raw, data_ - raw);
    if (raw + span > data_ + mapped_) munmap(data_ + mapped_, raw + span - (data_ + mapped_));
    madvise(data_, mapped_, MADV_HUGEPAGE);  // a request: refused (EINVAL) where the kernel has no THP, harmless
    std::memset(data_, 0, bytes);           // the pages taken now, not by the first calls that write them
}

CacheBlock::~CacheBlock() {
    if (data_) munmap(data_, mapped_);
}

}  // namespace specrt
