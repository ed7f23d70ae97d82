// The C API of include/specrt.h over specrt::Engine: no C++ type or exception crosses it.
#include "specrt.h"

#include "engine.h"

#include <algorithm>
#include <cstring>

using specrt::Error;

struct specrt_engine {
    specrt::Engine engine;
    std::vector<specrt::Event> events;
    std::vector<specrt_event> views;

    specrt_engine(const char* dir, const specrt::Options& o) : engine(dir, o) {}
};

namespace {

thread_local std::string last_error;

specrt_status fail(specrt_status s, const std::string& message) {
    last_error = message;
    return s;
}

template <typename F>
specrt_status guarded(F&& f) {
    try {
        f();
        return SPECRT_OK;
    } catch (const Error& e) {
        return fail(e.status, e.what());
    } catch (const Ort::Exception& e) {
        return fail(SPECRT_ERROR_RUNTIME, std::string("onnxruntime: ") + e.what());
    } catch (const std::bad_alloc&) {
        return fail(SPECRT_ERROR_RUNTIME, "out of memory");
    } catch (const std::exception& e) {
        return fail(SPECRT_ERROR_RUNTIME, e.what());
    }
}

// A caller's versioned struct: the fields its struct_size covers over the defaults of this library's version.
template <typename T>
T versioned(const T* given, void (*init)(T*), const char* what) {
    T out;
    init(&out);
    if (!given) return out;
    if (given->struct_size == 0)
        throw Error(SPECRT_ERROR_REQUEST, std::string(what) + "->struct_size is 0: initialize it with " + what + "_init");
    std::memcpy(&out, given, std::min(given->struct_size, sizeof(T)));
    out.struct_size = sizeof(T);
    return out;
}

specrt::Params params_of(const specrt_params* given) {
    specrt::Params out;
    if (!given) return out;
    const specrt_params copy = versioned(given, specrt_params_init, "specrt_params");
    const specrt_params* p = &copy;
    out.temperature = p->temperature;
    out.top_k = p->top_k;
    out.top_p = p->top_p;
    out.seed = p->seed;
    out.max_new_tokens = static_cast<int64_t>(p->max_new_tokens);
    if (p->stop_token_ids) out.stop_token_ids.assign(p->stop_token_ids, p->stop_token_ids + p->n_stop_token_ids);
    out.ignore_eos = p->ignore_eos != 0;
    if (p->n_stop_strings && !p->stop_strings)
        throw Error(SPECRT_ERROR_REQUEST, "specrt_params: n_stop_strings without stop_strings");
    for (size_t i = 0; i < p->n_stop_strings; ++i) {
        if (!p->stop_strings[i]) throw Error(SPECRT_ERROR_REQUEST, "specrt_params: a stop string is NULL");
        out.stop_strings.emplace_back(p->stop_strings[i]);
    }
    return out;
}

}  // namespace

extern "C" {

void specrt_options_init(specrt_options* o) {
    if (o) *o = specrt_options{sizeof(specrt_options), 0, "ar", "fixed", 0, 0, 3, 0.3, 1};
}

void specrt_params_init(specrt_params* p) {
    if (p) *p = specrt_params{sizeof(specrt_params), 0.0, 0, 1.0, -1, 128, nullptr, 0, 0, nullptr, 0};
}

specrt_status specrt_engine_open(const char* artifact_dir, const specrt_options* options, specrt_engine** engine) {
    if (!engine) return fail(SPECRT_ERROR_REQUEST, "specrt_engine_open: engine is NULL");
    *engine = nullptr;
    if (!artifact_dir) return fail(SPECRT_ERROR_REQUEST, "specrt_engine_open: no artifact directory given");
    return guarded([&] {
        const specrt_options given = versioned(options, specrt_options_init, "specrt_options");
        specrt::Options o;
        o.threads = given.threads;
        if (given.method) o.method = given.method;
        if (given.scheduler) o.scheduler = given.scheduler;
        o.gamma = given.gamma;
        o.slots = given.slots;
        o.ngram = given.ngram;
        o.threshold = given.threshold;
        o.tree = given.tree;
        *engine = new specrt_engine(artifact_dir, o);
    });
}

void specrt_engine_close(specrt_engine* engine) { delete engine; }

specrt_status specrt_add_request(specrt_engine* engine, const int64_t* prompt, size_t n_prompt,
                                 const specrt_params* params, int64_t* request_id) {
    if (!engine || (!prompt && n_prompt)) return fail(SPECRT_ERROR_REQUEST, "specrt_add_request: a NULL argument");
    return guarded([&] {
        int64_t id = engine->engine.add(std::vector<int64_t>(prompt, prompt + n_prompt), params_of(params));
        if (request_id) *request_id = id;
    });
}

specrt_status specrt_add_text(specrt_engine* engine, const char* text, int raw, const specrt_params* params,
                              int64_t* request_id) {
    if (!engine || !text) return fail(SPECRT_ERROR_REQUEST, "specrt_add_text: a NULL argument");
    return guarded([&] {
        std::vector<int64_t> ids = engine->engine.encode_text(text, raw != 0);
        int64_t id = engine->engine.add(ids, params_of(params));
        if (request_id) *request_id = id;
    });
}

specrt_status specrt_add_chat(specrt_engine* engine, const specrt_message* messages, size_t n_messages,
                              const specrt_params* params, int64_t* request_id) {
    if (!engine || (!messages && n_messages)) return fail(SPECRT_ERROR_REQUEST, "specrt_add_chat: a NULL argument");
    for (size_t i = 0; i < n_messages; ++i)
        if (!messages[i].role || !messages[i].content)
            return fail(SPECRT_ERROR_REQUEST, "specrt_add_chat: message " + std::to_string(i) + " has a NULL role or content");
    return guarded([&] {
        std::vector<std::pair<std::string, std::string>> chat;
        for (size_t i = 0; i < n_messages; ++i) chat.emplace_back(messages[i].role, messages[i].content);
        int64_t id = engine->engine.add(engine->engine.encode_chat(chat), params_of(params));
        if (request_id) *request_id = id;
    });
}

specrt_status specrt_tokenize(specrt_engine* engine, const char* text, int raw, int64_t* ids, size_t capacity,
                              size_t* n_ids) {
    if (!engine || !text || !n_ids || (!ids && capacity)) return fail(SPECRT_ERROR_REQUEST, "specrt_tokenize: a NULL argument");
    return guarded([&] {
        std::vector<int64_t> out = engine->engine.encode_text(text, raw != 0);
        *n_ids = out.size();
        if (out.size() > capacity)
            throw Error(SPECRT_ERROR_REQUEST, "specrt_tokenize: " + std::to_string(out.size()) + " ids, room for " +
                                                  std::to_string(capacity));
        std::copy(out.begin(), out.end(), ids);
    });
}

specrt_status specrt_detokenize(specrt_engine* engine, const int64_t* ids, size_t n_ids, int skip_special, char* text,
                                size_t capacity, size_t* n_text) {
    if (!engine || (!ids && n_ids) || !n_text || (!text && capacity))
        return fail(SPECRT_ERROR_REQUEST, "specrt_detokenize: a NULL argument");
    return guarded([&] {
        std::string out = engine->engine.tokenizer().decode(std::vector<int64_t>(ids, ids + n_ids), skip_special != 0);
        *n_text = out.size();
        if (out.size() + 1 > capacity)
            throw Error(SPECRT_ERROR_REQUEST, "specrt_detokenize: " + std::to_string(out.size() + 1) + " bytes, room for " +
                                                  std::to_string(capacity));
        std::memcpy(text, out.c_str(), out.size() + 1);
    });
}

specrt_status specrt_step(specrt_engine* engine, const specrt_event** events, size_t* n_events) {
    if (!engine || !events || !n_events) return fail(SPECRT_ERROR_REQUEST, "specrt_step: a NULL argument");
    *events = nullptr;
    *n_events = 0;
    return guarded([&] {
        engine->events = engine->engine.step();
        engine->views.clear();
        for (const specrt::Event& e : engine->events)
            engine->views.push_back(specrt_event{e.id, e.tokens.data(), e.tokens.size(), e.text.c_str(), e.text.size(),
                                                 e.finish.empty() ? nullptr : e.finish.c_str()});
        *events = engine->views.data();
        *n_events = engine->views.size();
    });
}

specrt_status specrt_abort(specrt_engine* engine, int64_t request_id) {
    if (!engine) return fail(SPECRT_ERROR_REQUEST, "specrt_abort: engine is NULL");
    if (!engine->engine.abort(request_id))
        return fail(SPECRT_ERROR_REQUEST, "request " + std::to_string(request_id) + " is not unfinished");
    return SPECRT_OK;
}

int specrt_has_unfinished(const specrt_engine* engine) { return engine && engine->engine.unfinished(); }

specrt_status specrt_generate(specrt_engine* engine, const int64_t* prompt, size_t n_prompt,
                              const specrt_params* params, int64_t* out, size_t* n_out) {
    if (!engine || (!prompt && n_prompt) || !out || !n_out) return fail(SPECRT_ERROR_REQUEST, "specrt_generate: a NULL argument");
    *n_out = 0;
    if (engine->engine.unfinished())
        return fail(SPECRT_ERROR_REQUEST, "specrt_generate needs an idle engine; finish or abort the pending requests first");
    return guarded([&] {
        specrt::Engine& e = engine->engine;
        e.add(std::vector<int64_t>(prompt, prompt + n_prompt), params_of(params));
        e.reset_stats();
        size_t n = 0;
        try {
            while (e.unfinished())
                for (const specrt::Event& ev : e.step())
                    for (int64_t t : ev.tokens) out[n++] = t;
        } catch (...) {
            e.abort_all();  // leave the engine idle for the next request
            throw;
        }
        *n_out = n;
    });
}

int64_t specrt_vocab_size(const specrt_engine* engine) { return engine ? engine->engine.manifest().vocab_size : 0; }

int specrt_gamma(const specrt_engine* engine) { return engine ? static_cast<int>(engine->engine.gamma()) : 0; }

specrt_stats specrt_get_stats(const specrt_engine* engine) {
    specrt_stats s{0, 0, 0, 0.0, 0.0, 0};
    if (!engine) return s;
    const specrt::Stats& x = engine->engine.stats();
    s.rounds = static_cast<size_t>(x.rounds);
    s.accepted = static_cast<size_t>(x.accepted);
    s.generated = static_cast<size_t>(x.generated);
    s.decode_seconds = x.decode_s;
    s.prefill_seconds = x.prefill_s;
    s.head_calls = static_cast<size_t>(x.head_calls);
    return s;
}

const char* specrt_last_error(void) { return last_error.c_str(); }

}  // extern "C"
