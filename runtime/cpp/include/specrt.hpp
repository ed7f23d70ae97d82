// specrt's C++ API: a header-only layer over the C API of specrt.h (so it needs no C++ ABI from the library):
// RAII handles, std types, and specrt::Exception carrying the C API's status and message.
//
//   specrt::EngineOptions options;
//   options.method = "dspark+ngram";
//   options.scheduler = "sps";
//   specrt::Engine engine("art", options);
//   std::string text = engine.generate_text("Why is the sky blue?");
//
// Threads: as the C API (one engine driven by one thread at a time).
#ifndef SPECRT_HPP
#define SPECRT_HPP

#include "specrt.h"

#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace specrt {

class Exception : public std::runtime_error {
public:
    Exception(specrt_status status, const std::string& message) : std::runtime_error(message), status_(status) {}
    specrt_status status() const { return status_; }

private:
    specrt_status status_;
};

struct EngineOptions {
    std::string method = "ar", scheduler = "fixed";
    int threads = 0, gamma = 0, slots = 0, ngram = 3;
    double threshold = 0.3;
    int tree = 1;  // 2..8: draft trees of this width (ngram, dspark, dspark+ngram)
};

struct GenerateOptions {
    size_t max_new_tokens = 128;
    double temperature = 0.0, top_p = 1.0;
    int top_k = 0;
    int64_t seed = -1;
    std::vector<int64_t> stop_token_ids;
    std::vector<std::string> stop_strings;  // the request ends where its text first holds one (cut before it)
    bool ignore_eos = false;
    bool raw = false;  // text: skip the chat template
};

struct Event {
    int64_t request_id;
    std::vector<int64_t> token_ids;
    std::string text;
    std::string finish_reason;  // "" while the request runs
};

class Engine {
public:
    explicit Engine(const std::string& artifact_dir, const EngineOptions& options = {}) {
        specrt_options o;
        specrt_options_init(&o);
        o.threads = options.threads;
        o.method = options.method.c_str();
        o.scheduler = options.scheduler.c_str();
        o.gamma = options.gamma;
        o.slots = options.slots;
        o.ngram = options.ngram;
        o.threshold = options.threshold;
        o.tree = options.tree;
        check(specrt_engine_open(artifact_dir.c_str(), &o, &engine_));
    }
    ~Engine() { specrt_engine_close(engine_); }
    Engine(const Engine&) = delete;
    Engine& operator=(const Engine&) = delete;
    Engine(Engine&& other) noexcept : engine_(std::exchange(other.engine_, nullptr)) {}
    Engine& operator=(Engine&& other) noexcept {
        std::swap(engine_, other.engine_);
        return *this;
    }

    int64_t add(const std::vector<int64_t>& prompt, const GenerateOptions& g = {}) {
        std::vector<const char*> stops;
        specrt_params p = params(g, stops);
        int64_t id = 0;
        check(specrt_add_request(engine_, prompt.data(), prompt.size(), &p, &id));
        return id;
    }
    int64_t add(const std::string& text, const GenerateOptions& g = {}) {
        std::vector<const char*> stops;
        specrt_params p = params(g, stops);
        int64_t id = 0;
        check(specrt_add_text(engine_, text.c_str(), g.raw, &p, &id));
        return id;
    }
    // A conversation ((role, content) pairs) through the chat template, with the generation prompt.
    int64_t add(const std::vector<std::pair<std::string, std::string>>& messages, const GenerateOptions& g = {}) {
        std::vector<specrt_message> m;
        for (const auto& [role, content] : messages) m.push_back(specrt_message{role.c_str(), content.c_str()});
        std::vector<const char*> stops;
        specrt_params p = params(g, stops);
        int64_t id = 0;
        check(specrt_add_chat(engine_, m.data(), m.size(), &p, &id));
        return id;
    }
    std::vector<Event> step() {
        const specrt_event* events = nullptr;
        size_t n = 0;
        check(specrt_step(engine_, &events, &n));
        std::vector<Event> out;
        for (size_t i = 0; i < n; ++i)
            out.push_back(Event{events[i].request_id,
                                std::vector<int64_t>(events[i].token_ids, events[i].token_ids + events[i].n_tokens),
                                std::string(events[i].text, events[i].n_text),
                                events[i].finish_reason ? events[i].finish_reason : ""});
        return out;
    }
    void abort(int64_t request_id) { check(specrt_abort(engine_, request_id)); }
    bool has_unfinished() const { return specrt_has_unfinished(engine_) != 0; }

    std::vector<int64_t> generate(const std::vector<int64_t>& prompt, const GenerateOptions& g = {}) {
        std::vector<int64_t> out(g.max_new_tokens);
        size_t n = 0;
        std::vector<const char*> stops;
        specrt_params p = params(g, stops);
        check(specrt_generate(engine_, prompt.data(), prompt.size(), &p, out.data(), &n));
        out.resize(n);
        return out;
    }
    // One text request on an idle engine, start to finish: its text.
    std::string generate_text(const std::string& text, const GenerateOptions& g = {}) {
        int64_t id = add(text, g);
        std::string out;
        while (has_unfinished())
            for (const Event& e : step())
                if (e.request_id == id) out += e.text;
        return out;
    }

    std::vector<int64_t> tokenize(const std::string& text, bool raw = false) {
        size_t n = 0;
        specrt_status s = specrt_tokenize(engine_, text.c_str(), raw, nullptr, 0, &n);
        if (s != SPECRT_OK && n == 0) check(s);
        std::vector<int64_t> ids(n);
        check(specrt_tokenize(engine_, text.c_str(), raw, ids.data(), ids.size(), &n));
        return ids;
    }
    std::string detokenize(const std::vector<int64_t>& ids, bool skip_special = false) {
        size_t n = 0;
        specrt_status s = specrt_detokenize(engine_, ids.data(), ids.size(), skip_special, nullptr, 0, &n);
        if (s != SPECRT_OK && n == 0 && !ids.empty()) check(s);
        std::string text(n + 1, '\0');
        check(specrt_detokenize(engine_, ids.data(), ids.size(), skip_special, text.data(), text.size(), &n));
        text.resize(n);
        return text;
    }

    int64_t vocab_size() const { return specrt_vocab_size(engine_); }
    int gamma() const { return specrt_gamma(engine_); }
    specrt_stats stats() const { return specrt_get_stats(engine_); }
    specrt_engine* handle() { return engine_; }

private:
    static void check(specrt_status s) {
        if (s != SPECRT_OK) throw Exception(s, specrt_last_error());
    }
    // `stops` holds the stop strings' pointers for as long as p is used
    static specrt_params params(const GenerateOptions& g, std::vector<const char*>& stops) {
        specrt_params p;
        specrt_params_init(&p);
        p.temperature = g.temperature;
        p.top_k = g.top_k;
        p.top_p = g.top_p;
        p.seed = g.seed;
        p.max_new_tokens = g.max_new_tokens;
        p.stop_token_ids = g.stop_token_ids.data();
        p.n_stop_token_ids = g.stop_token_ids.size();
        p.ignore_eos = g.ignore_eos;
        for (const std::string& stop : g.stop_strings) stops.push_back(stop.c_str());
        p.stop_strings = stops.data();
        p.n_stop_strings = stops.size();
        return p;
    }

    specrt_engine* engine_ = nullptr;
};

}  // namespace specrt

#endif  // SPECRT_HPP
