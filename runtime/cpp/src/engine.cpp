// specrt's C++ runtime, first slice: the artifact's manifest and target graph on ONNX Runtime's C++ API, and greedy
// plain decoding ("ar") and n-gram drafting with packed verification ("ngram") behind the C API of include/specrt.h. The calls are filled as the Python runtime's
// call contract fills them (runtime/calls/target.py: prefill chunks, decode grid); the KV cache is one buffer per
// layer bound as both past and present (runtime/backends/ort.py), grown by GROWTH positions where the graph's cache
// length is the named axis S.
#include "specrt.h"

#include <onnxruntime/onnxruntime_cxx_api.h>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <set>
#include <stdexcept>
#include <string>
#include <thread>
#include <variant>
#include <vector>

namespace fs = std::filesystem;
using json = nlohmann::json;

namespace {

constexpr int kFormatVersion = 4;  // specrt/artifact.py FORMAT_VERSION
constexpr int64_t kGrowth = 64;    // positions a sized cache grows by (runtime/backends/ort.py GROWTH)
const char* const kCacheLen = "S";

struct Error : std::runtime_error {
    specrt_status status;
    Error(specrt_status s, const std::string& message) : std::runtime_error(message), status(s) {}
};

thread_local std::string last_error;

using Dim = std::variant<int64_t, std::string>;
using Bucket = std::map<std::string, int64_t>;

struct TensorSpec {
    std::string name, dtype;
    std::vector<Dim> shape;

    std::vector<int64_t> resolve(const Bucket& sizes) const {
        std::vector<int64_t> out;
        for (const Dim& d : shape) {
            if (std::holds_alternative<int64_t>(d)) {
                out.push_back(std::get<int64_t>(d));
            } else {
                auto it = sizes.find(std::get<std::string>(d));
                if (it == sizes.end()) throw Error(SPECRT_ERROR_ARTIFACT, name + ": axis " + std::get<std::string>(d) + " has no size");
                out.push_back(it->second);
            }
        }
        return out;
    }
    bool named(const std::string& axis) const {
        return std::any_of(shape.begin(), shape.end(), [&](const Dim& d) {
            return std::holds_alternative<std::string>(d) && std::get<std::string>(d) == axis;
        });
    }
};

struct GraphSpec {
    std::string name, file;
    int64_t max_seq = 0;
    std::vector<TensorSpec> inputs, outputs;
    std::map<std::string, std::vector<Bucket>> buckets;

    // The smallest bucket of `use` whose sizes are all >= need (fewest slots, then tokens, then budget).
    Bucket bucket(const std::string& use, const Bucket& need = {}) const {
        auto it = buckets.find(use);
        const Bucket* best = nullptr;
        if (it != buckets.end()) {
            for (const Bucket& b : it->second) {
                bool fits = std::all_of(need.begin(), need.end(), [&](const auto& kv) {
                    auto f = b.find(kv.first);
                    return f != b.end() && f->second >= kv.second;
                });
                if (fits && (!best || order(b) < order(*best))) best = &b;
            }
        }
        if (!best) throw Error(SPECRT_ERROR_REQUEST, "graph " + name + ": no " + use + " bucket holds the request");
        return *best;
    }
    static std::vector<int64_t> order(const Bucket& b) {  // the manifest's key order: B, T, P, R (C)
        std::vector<int64_t> v;
        for (const char* k : {"B", "T", "P", "R", "C"}) {
            auto it = b.find(k);
            if (it != b.end()) v.push_back(it->second);
        }
        return v;
    }
    bool sized_cache() const {
        return std::any_of(inputs.begin(), inputs.end(),
                           [](const TensorSpec& t) { return t.name.rfind("past.", 0) == 0 && t.named(kCacheLen); });
    }
};

struct Manifest {
    int64_t vocab_size = 0, max_seq = 0, gamma = 0;  // gamma: drafts a verify call takes at most (verify_len - 1)
    std::set<int64_t> eos;
    GraphSpec target;
};

TensorSpec tensor_spec(const json& j) {
    TensorSpec t{j.at("name").get<std::string>(), j.at("dtype").get<std::string>(), {}};
    for (const json& d : j.at("shape")) {
        if (d.is_string()) t.shape.emplace_back(d.get<std::string>());
        else t.shape.emplace_back(d.get<int64_t>());
    }
    return t;
}

Manifest load_manifest(const fs::path& dir) {
    fs::path path = dir / "manifest.json";
    std::ifstream f(path);
    if (!f) throw Error(SPECRT_ERROR_ARTIFACT, dir.string() + " is not a specrt artifact (no manifest.json)");
    Manifest m;
    try {
        json j = json::parse(f);
        int version = j.at("format_version").get<int>();
        if (version != kFormatVersion)
            throw Error(SPECRT_ERROR_ARTIFACT, dir.string() + ": artifact format " + std::to_string(version) +
                                                   ", this runtime reads format " + std::to_string(kFormatVersion) +
                                                   " (re-export it with this version of specrt)");
        m.gamma = j.at("export").at("verify_len").get<int64_t>() - 1;
        const json& model = j.at("model");
        m.vocab_size = model.at("vocab_size").get<int64_t>();
        for (const json& e : model.at("eos_token_ids")) m.eos.insert(e.get<int64_t>());
        if (j.contains("tokenizer") && j["tokenizer"].is_object() && j["tokenizer"].contains("eos_token_ids") &&
            j["tokenizer"]["eos_token_ids"].is_array())
            for (const json& e : j["tokenizer"]["eos_token_ids"]) m.eos.insert(e.get<int64_t>());
        const json& g = j.at("graphs").at("target");
        GraphSpec& t = m.target;
        t.name = "target";
        t.file = g.at("file").get<std::string>();
        t.max_seq = g.at("max_seq").get<int64_t>();
        for (const json& x : g.at("inputs")) t.inputs.push_back(tensor_spec(x));
        for (const json& x : g.at("outputs")) t.outputs.push_back(tensor_spec(x));
        for (const auto& [use, list] : g.at("buckets").items())
            for (const json& b : list) t.buckets[use].push_back(b.get<Bucket>());
        m.max_seq = t.max_seq;
    } catch (const json::exception& e) {
        throw Error(SPECRT_ERROR_ARTIFACT, path.string() + ": not a valid manifest (" + e.what() + ")");
    }
    fs::path rel(m.target.file);
    if (rel.is_absolute() || rel.lexically_normal().string().rfind("..", 0) == 0)
        throw Error(SPECRT_ERROR_ARTIFACT, path.string() + ": graph file " + m.target.file + " leaves the artifact");
    return m;
}

std::string dims_text(const std::vector<Dim>& shape) {
    std::string s = "[";
    for (size_t i = 0; i < shape.size(); ++i) {
        if (i) s += ", ";
        s += std::holds_alternative<int64_t>(shape[i]) ? std::to_string(std::get<int64_t>(shape[i]))
                                                       : std::get<std::string>(shape[i]);
    }
    return s + "]";
}

// The graph file's declared I/O against the manifest's, as specrt/artifact.py check_graph_io does.
void check_graph_io(Ort::Session& session, const GraphSpec& spec) {
    Ort::AllocatorWithDefaultOptions alloc;
    std::map<std::string, std::vector<Dim>> declared;
    auto add = [&](size_t count, bool input) {
        for (size_t i = 0; i < count; ++i) {
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

// One graph family on one session: host buffers and a binding per bucket, the KV cache bound in place.
class Runner {
public:
    Runner(Ort::Env& env, const fs::path& dir, const GraphSpec& spec, int threads) : spec_(spec) {
        fs::path file = dir / spec.file;
        if (!fs::is_regular_file(file)) throw Error(SPECRT_ERROR_ARTIFACT, file.string() + " is missing (corrupt artifact? re-export it)");
        Ort::SessionOptions so;
        so.SetIntraOpNumThreads(threads > 0 ? threads : static_cast<int>(std::max(1u, std::thread::hardware_concurrency())));
        so.SetInterOpNumThreads(1);
        so.SetGraphOptimizationLevel(GraphOptimizationLevel::ORT_ENABLE_ALL);
        so.SetLogSeverityLevel(3);
        try {
            session_ = std::make_unique<Ort::Session>(env, file.c_str(), so);
        } catch (const Ort::Exception& e) {
            throw Error(SPECRT_ERROR_ARTIFACT, "cannot load " + spec.file + ": " + first_line(e.what()));
        }
        check_graph_io(*session_, spec);
        for (const TensorSpec& t : spec.inputs) {
            if (t.name.rfind("past.", 0) == 0) {
                if (t.dtype != "float32") throw Error(SPECRT_ERROR_ARTIFACT, spec.file + ": a " + t.dtype + " KV cache (this runtime reads float32)");
                cache_specs_.push_back(t);
            }
        }
        sized_ = spec.sized_cache();
    }

    void allocate(int64_t slots) {
        slots_ = slots;
        resize(sized_ ? std::min(kGrowth, spec_.max_seq) : spec_.max_seq);
    }

    // The bound host inputs of a call over slots [0, B) at `bucket`: fill them, then run().
    std::map<std::string, std::vector<int64_t>>& inputs(const Bucket& bucket) { return call(bucket).in; }

    const std::vector<float>& run(const Bucket& bucket, const std::string& output) {
        Call& c = call(bucket);
        if (sized_) {
            int64_t need = *std::max_element(c.in.at("write_index").begin(), c.in.at("write_index").end()) + bucket.at("T");
            if (need > length_ && length_ < spec_.max_seq) {
                resize(std::min(spec_.max_seq, (need + kGrowth - 1) / kGrowth * kGrowth));
            }
        }
        if (c.length != length_) bind_cache(c);
        try {
            session_->Run(Ort::RunOptions{nullptr}, *c.binding);
        } catch (const Ort::Exception& e) {
            throw Error(SPECRT_ERROR_RUNTIME, spec_.file + ": " + first_line(e.what()));
        }
        return c.out.at(output);
    }

private:
    struct Call {
        std::map<std::string, std::vector<int64_t>> in;
        std::map<std::string, std::vector<float>> out;
        std::vector<Ort::Value> values;  // the tensors bound (views on `in`, `out` and the cache)
        std::unique_ptr<Ort::IoBinding> binding;
        int64_t slots = 0, length = -1;
    };

    static std::string first_line(const std::string& s) { return s.substr(0, s.find('\n')); }

    Call& call(const Bucket& bucket) {
        auto it = calls_.find(bucket);
        if (it != calls_.end()) return it->second;
        if (bucket.at("B") > slots_)  // checked before the call is kept: a failed call leaves nothing behind
            throw Error(SPECRT_ERROR_REQUEST, "a call over " + std::to_string(bucket.at("B")) + " slots, " +
                                                  std::to_string(slots_) + " allocated");
        Call& c = calls_[bucket];
        c.binding = std::make_unique<Ort::IoBinding>(*session_);
        c.slots = bucket.at("B");
        bind_host(c, spec_.inputs, "past.", "int64", c.in, bucket, true);
        bind_host(c, spec_.outputs, "present.", "float32", c.out, bucket, false);
        bind_cache(c);
        return c;
    }

    // Host buffers for the call's tensors of `specs` (all of dtype `dtype`, the cache's `skip` ones aside), bound as
    // its inputs or outputs.
    template <typename T>
    void bind_host(Call& c, const std::vector<TensorSpec>& specs, const char* skip, const char* dtype,
                   std::map<std::string, std::vector<T>>& buffers, const Bucket& bucket, bool input) {
        auto mem = Ort::MemoryInfo::CreateCpu(OrtArenaAllocator, OrtMemTypeDefault);
        for (const TensorSpec& t : specs) {
            if (t.name.rfind(skip, 0) == 0) continue;
            if (t.dtype != dtype)
                throw Error(SPECRT_ERROR_ARTIFACT, spec_.file + ": " + (input ? "input " : "output ") + t.name + " is " + t.dtype);
            std::vector<int64_t> shape = t.resolve(bucket);
            auto& buf = buffers[t.name];
            buf.assign(count(shape), T{});
            c.values.push_back(Ort::Value::CreateTensor<T>(mem, buf.data(), buf.size(), shape.data(), shape.size()));
            if (input) c.binding->BindInput(t.name.c_str(), c.values.back());
            else c.binding->BindOutput(t.name.c_str(), c.values.back());
        }
    }

    // Each layer's cache rows [0, B) as both past and present (the graph scatters new K/V into it in place).
    void bind_cache(Call& c) {
        auto mem = Ort::MemoryInfo::CreateCpu(OrtArenaAllocator, OrtMemTypeDefault);
        Bucket sizes{{"B", c.slots}, {kCacheLen, length_}};
        for (size_t i = 0; i < cache_specs_.size(); ++i) {
            const TensorSpec& t = cache_specs_[i];
            std::vector<int64_t> shape = t.resolve(sizes);
            c.values.push_back(Ort::Value::CreateTensor<float>(mem, cache_[i].data(), count(shape), shape.data(), shape.size()));
            c.binding->BindInput(t.name.c_str(), c.values.back());
            std::string present = "present." + t.name.substr(5);
            c.binding->BindOutput(present.c_str(), c.values.back());
        }
        c.length = length_;
    }

    // (Re)allocate every layer's cache at `length` positions per slot, keeping what it holds.
    void resize(int64_t length) {
        std::vector<std::vector<float>> next(cache_specs_.size());
        for (size_t i = 0; i < cache_specs_.size(); ++i) {
            std::vector<int64_t> shape = cache_specs_[i].resolve({{"B", slots_}, {kCacheLen, length}});
            next[i].assign(count(shape), 0.0f);
            if (!cache_.empty() && length_ > 0) {  // [B, H, S, D]: copy each (slot, head)'s first min(S) rows
                int64_t rows = shape[0] * shape[1], d = shape[3], keep = std::min(length, length_);
                for (int64_t r = 0; r < rows; ++r)
                    std::memcpy(next[i].data() + r * length * d, cache_[i].data() + r * length_ * d, keep * d * sizeof(float));
            }
        }
        cache_ = std::move(next);
        length_ = length;
    }

    static size_t count(const std::vector<int64_t>& shape) {
        size_t n = 1;
        for (int64_t d : shape) n *= static_cast<size_t>(d);
        return n;
    }

    const GraphSpec& spec_;
    std::unique_ptr<Ort::Session> session_;
    std::vector<TensorSpec> cache_specs_;
    std::vector<std::vector<float>> cache_;
    std::map<Bucket, Call> calls_;
    int64_t slots_ = 0, length_ = 0;
    bool sized_ = false;
};

Ort::Env& ort_env() {
    static Ort::Env env(ORT_LOGGING_LEVEL_ERROR, "specrt");
    return env;
}

int64_t argmax(const float* row, int64_t n) { return std::max_element(row, row + n) - row; }

}  // namespace

// Up to `steps` tokens that followed the latest earlier occurrence of the longest suffix (n <= max_n) of `history`
// (runtime/drafters.py lookup): prompt lookup, no graph call.
std::vector<int64_t> lookup(const std::vector<int64_t>& history, size_t max_n, size_t steps) {
    const size_t size = history.size();
    for (size_t n = std::min(max_n, size - 1); n >= 1; --n) {
        // windows start at 0..size-1-n: strictly before the suffix itself, each followed by >= 1 token
        for (size_t start = size - 1 - n + 1; start-- > 0;) {
            if (std::equal(history.end() - n, history.end(), history.begin() + start)) {
                size_t from = start + n, to = std::min(size, from + steps);
                return std::vector<int64_t>(history.begin() + from, history.begin() + to);
            }
        }
    }
    return {};
}

struct specrt_engine {
    Manifest manifest;
    std::unique_ptr<Runner> target;
    bool ngram = false;
    double decode_seconds = 0.0;
    size_t rounds = 0, accepted = 0;

    specrt_engine(const char* dir, const specrt_options* options) {
        if (!dir) throw Error(SPECRT_ERROR_REQUEST, "no artifact directory given");
        std::string method = options && options->method ? options->method : "ar";
        if (method == "ngram") ngram = true;
        else if (method != "ar")
            throw Error(SPECRT_ERROR_REQUEST, "method " + method + ": this runtime runs ar and ngram (not yet the heads)");
        fs::path path(dir);
        manifest = load_manifest(path);
        target = std::make_unique<Runner>(ort_env(), path, manifest.target, options ? options->threads : 0);
        target->allocate(1);
    }

    std::vector<int64_t> generate(const std::vector<int64_t>& prompt, size_t max_new, bool ignore_eos) {
        const int64_t capacity = manifest.max_seq - 1;  // the last position absorbs padding writes
        const int64_t gamma = ngram ? manifest.gamma : 0;
        if (prompt.empty()) throw Error(SPECRT_ERROR_REQUEST, "empty prompt");
        for (int64_t t : prompt)
            if (t < 0 || t >= manifest.vocab_size)
                throw Error(SPECRT_ERROR_REQUEST, "token id " + std::to_string(t) + " is outside the vocabulary (0.." +
                                                      std::to_string(manifest.vocab_size - 1) + ")");
        if (static_cast<int64_t>(prompt.size() + max_new) + gamma > capacity)
            throw Error(SPECRT_ERROR_REQUEST, "prompt of " + std::to_string(prompt.size()) + " tokens + max_new_tokens " +
                                                  std::to_string(max_new) + " exceeds the artifact's " +
                                                  std::to_string(capacity) + " cache positions");
        std::vector<int64_t> out;
        rounds = accepted = 0;
        if (max_new == 0) return out;
        const int64_t vocab = manifest.vocab_size;
        // prefill, chunk by chunk (runtime/calls/target.py prefill): the logits of each chunk's last token
        Bucket pb = manifest.target.bucket("prefill");
        const int64_t t = pb.at("T"), n = static_cast<int64_t>(prompt.size());
        auto& in = target->inputs(pb);
        const std::vector<float>* logits = nullptr;
        for (int64_t start = 0; start < n; start += t) {
            int64_t len = std::min(t, n - start);
            std::fill(in.at("input_ids").begin(), in.at("input_ids").end(), 0);
            std::copy(prompt.begin() + start, prompt.begin() + start + len, in.at("input_ids").begin());
            for (int64_t k = 0; k < t; ++k) in.at("position_ids")[k] = start + k;
            in.at("write_index")[0] = start;
            auto& rows = in.at("token_rows");
            for (size_t k = 0; k < rows.size(); ++k) rows[k] = static_cast<int64_t>(k);
            in.at("logit_rows")[0] = len - 1;
            logits = &target->run(pb, "logits");
        }
        std::vector<int64_t> history(prompt);
        int64_t length = n;  // tokens in the cache; the last of `history` (the anchor) is not yet
        auto finished = [&](int64_t token) {
            return out.size() >= max_new || (!ignore_eos && manifest.eos.count(token));
        };
        auto emit = [&](int64_t token) {
            out.push_back(token);
            history.push_back(token);
            return finished(token);
        };
        if (emit(argmax(logits->data(), vocab))) return out;
        // each verify length's call (0: a decode step), chosen once rather than every round
        std::vector<Bucket> calls{manifest.target.bucket("decode", {{"B", 1}})};
        for (int64_t ell = 1; ell <= gamma; ++ell)
            calls.push_back(manifest.target.bucket("verify", {{"B", 1}, {"T", ell + 1}, {"P", ell + 1}}));
        auto t0 = std::chrono::steady_clock::now();
        while (true) {
            // draft (n-gram lookups) and schedule (fixed: every draft, capped by gamma and the token budget)
            std::vector<int64_t> drafts = gamma ? lookup(history, 3, static_cast<size_t>(gamma)) : std::vector<int64_t>{};
            const int64_t room = std::clamp<int64_t>(static_cast<int64_t>(max_new - out.size()) - 1, 0, gamma);
            const int64_t ell = std::min<int64_t>(static_cast<int64_t>(drafts.size()), room);
            // verify [anchor, d_1..d_ell] at positions L..L+ell (runtime/calls/target.py grid, packed rows)
            const Bucket& b = calls[ell];
            const int64_t T = b.at("T");
            auto& v = target->inputs(b);
            v.at("input_ids")[0] = history.back();
            for (int64_t k = 1; k < T; ++k) v.at("input_ids")[k] = k <= ell ? drafts[k - 1] : 0;
            for (int64_t k = 0; k < T; ++k) v.at("position_ids")[k] = length + k;
            v.at("write_index")[0] = length;
            auto& rows = v.at("token_rows");  // the anchor and the drafts, then cells no token uses
            for (size_t k = 0; k < rows.size(); ++k) rows[k] = static_cast<int64_t>(k);
            auto& lrows = v.at("logit_rows");
            for (size_t k = 0; k < lrows.size(); ++k) lrows[k] = static_cast<int64_t>(k);
            const std::vector<float>& l = target->run(b, "logits");
            // accept: the longest prefix of drafts equal to the target's argmax before them, then the bonus
            int64_t a = 0;
            while (a < ell && argmax(l.data() + a * vocab, vocab) == drafts[a]) ++a;
            const int64_t bonus = argmax(l.data() + a * vocab, vocab);
            ++rounds;
            accepted += static_cast<size_t>(a);
            length += a + 1;
            bool done = false;
            for (int64_t k = 0; k < a && !done; ++k) done = emit(drafts[k]);
            if (done || emit(bonus)) break;
        }
        decode_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
        return out;
    }
};

namespace {

template <typename F>
specrt_status guarded(F&& f) {
    try {
        f();
        return SPECRT_OK;
    } catch (const Error& e) {
        last_error = e.what();
        return e.status;
    } catch (const Ort::Exception& e) {
        last_error = std::string("onnxruntime: ") + e.what();
        return SPECRT_ERROR_RUNTIME;
    } catch (const std::exception& e) {
        last_error = e.what();
        return SPECRT_ERROR_RUNTIME;
    }
}

}  // namespace

extern "C" {

specrt_status specrt_engine_open(const char* artifact_dir, const specrt_options* options, specrt_engine** engine) {
    if (!engine) {
        last_error = "specrt_engine_open: engine is NULL";
        return SPECRT_ERROR_REQUEST;
    }
    *engine = nullptr;
    return guarded([&] { *engine = new specrt_engine(artifact_dir, options); });
}

void specrt_engine_close(specrt_engine* engine) { delete engine; }

specrt_status specrt_generate(specrt_engine* engine, const int64_t* prompt, size_t n_prompt, size_t max_new_tokens,
                              int ignore_eos, int64_t* out, size_t* n_out) {
    if (!engine || (!prompt && n_prompt) || (!out && max_new_tokens) || !n_out) {
        last_error = "specrt_generate: a NULL argument";
        return SPECRT_ERROR_REQUEST;
    }
    *n_out = 0;
    return guarded([&] {
        std::vector<int64_t> ids = engine->generate(std::vector<int64_t>(prompt, prompt + n_prompt), max_new_tokens,
                                                    ignore_eos != 0);
        std::copy(ids.begin(), ids.end(), out);
        *n_out = ids.size();
    });
}

int64_t specrt_vocab_size(const specrt_engine* engine) { return engine ? engine->manifest.vocab_size : 0; }

double specrt_last_decode_seconds(const specrt_engine* engine) { return engine ? engine->decode_seconds : 0.0; }

size_t specrt_last_rounds(const specrt_engine* engine, size_t* accepted) {
    if (accepted) *accepted = engine ? engine->accepted : 0;
    return engine ? engine->rounds : 0;
}

const char* specrt_last_error(void) { return last_error.c_str(); }

}  // extern "C"
