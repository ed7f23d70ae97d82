// specrt-cpp: the C API from the command line (an example of embedding it).
//   specrt-cpp ART (--prompt TEXT | --input-ids 1,2,3) [more prompts] [--raw | --system TEXT] [--method M] [--scheduler S] [--max-new-tokens 64]
//              [--threads N] [--gamma G] [--slots N] [--tree W] [--temperature T --top-k K --top-p P --seed S] [--ignore-eos]
//              [--stop TEXT]...
//              [--repeat N] [--json]
// Every prompt (each --input-ids, each repeated N times) is queued at once and the engine is stepped until all have
// finished, several in flight over the artifact's slots. Text prompts go through the chat template (unless --raw)
// and print the generated text (streamed as it comes when there is one request); id prompts print the ids. Then the
// decode speed. A bad artifact or request is one line on stderr, exit 1.
#include "specrt.h"

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <string>
#include <vector>

static const char* kUsage =
    "usage: specrt-cpp ART (--prompt TEXT | --input-ids 1,2,3)... [--raw | --system TEXT] [--method ar|ngram|dspark|mtp|dspark+ngram|mtp+ngram] "
    "[--scheduler fixed|threshold|sps|sps-async] [--max-new-tokens 64] [--threads N] [--gamma G] [--tree W] [--temperature T] "
    "[--top-k K] [--top-p P] [--seed S] [--ignore-eos] [--stop TEXT]... [--repeat N] [--json]";

static int usage(const std::string& why) {
    std::fprintf(stderr, "specrt-cpp: %s\n%s\n", why.c_str(), kUsage);
    return 2;
}

static bool number(const char* v, double* out) {
    if (!v || !*v) return false;
    char* end;
    *out = std::strtod(v, &end);
    return *end == 0;
}

int main(int argc, char** argv) {
    const char* art = nullptr;
    std::vector<std::vector<int64_t>> prompts;
    std::vector<std::string> texts;  // text prompts (added after the id prompts)
    bool raw = false;
    const char* system = nullptr;  // a system message before each text prompt
    std::vector<const char*> stops;  // --stop texts (params.stop_strings points into it)
    specrt_options options;
    specrt_options_init(&options);
    specrt_params params;
    specrt_params_init(&params);
    params.max_new_tokens = 64;
    bool as_json = false;
    long repeat = 1;
    for (int i = 1; i < argc; ++i) {
        std::string a = argv[i];
        const char* v = nullptr;
        auto value = [&]() { return v = (i + 1 < argc ? argv[++i] : nullptr); };
        double x = 0;
        if (a == "--input-ids") {
            if (!value()) return usage("--input-ids needs a value");
            std::vector<int64_t>& prompt = prompts.emplace_back();
            for (const char* p = v; *p;) {
                char* end;
                long long id = std::strtoll(p, &end, 10);
                if (end == p || (*end && *end != ',')) return usage("--input-ids: comma-separated integers");
                prompt.push_back(id);
                p = *end == ',' ? end + 1 : end;
            }
        } else if (a == "--prompt") {
            if (!value()) return usage("--prompt needs a text");
            texts.push_back(v);
        } else if (a == "--system") {
            if (!value()) return usage("--system needs a text");
            system = v;
        } else if (a == "--raw") {
            raw = true;
        } else if (a == "--method") {
            if (!value()) return usage("--method needs a name");
            options.method = v;
        } else if (a == "--scheduler") {
            if (!value()) return usage("--scheduler needs a name");
            options.scheduler = v;
        } else if (a == "--max-new-tokens" || a == "--threads" || a == "--gamma" || a == "--top-k" || a == "--seed" ||
                   a == "--repeat" || a == "--slots" || a == "--tree") {
            if (!number(value(), &x) || x < (a == "--seed" ? -1 : 0) || x != static_cast<long long>(x))
                return usage(a + " needs a whole number");
            if (a == "--max-new-tokens") params.max_new_tokens = static_cast<size_t>(x);
            else if (a == "--threads") options.threads = static_cast<int>(x);
            else if (a == "--gamma") options.gamma = static_cast<int>(x);
            else if (a == "--top-k") params.top_k = static_cast<int>(x);
            else if (a == "--seed") params.seed = static_cast<int64_t>(x);
            else if (a == "--slots") options.slots = static_cast<int>(x);
            else if (a == "--tree") options.tree = static_cast<int>(x);
            else repeat = static_cast<long>(x);
        } else if (a == "--temperature" || a == "--top-p") {
            if (!number(value(), &x)) return usage(a + " needs a number");
            (a == "--temperature" ? params.temperature : params.top_p) = x;
        } else if (a == "--ignore-eos") {
            params.ignore_eos = 1;
        } else if (a == "--stop") {
            if (!value()) return usage("--stop needs a text");
            stops.push_back(v);
            params.stop_strings = stops.data();
            params.n_stop_strings = stops.size();
        } else if (a == "--json") {
            as_json = true;
        } else if (a == "--help" || a == "-h") {
            std::printf("%s\n", kUsage);
            return 0;
        } else if (!art && a.rfind("--", 0) != 0) {
            art = argv[i];
        } else {
            return usage("unknown argument " + a);
        }
    }
    if (!art) return usage("give an artifact directory");
    specrt_engine* engine = nullptr;
    if (specrt_engine_open(art, &options, &engine) != SPECRT_OK) {
        std::fprintf(stderr, "specrt-cpp: %s\n", specrt_last_error());
        return 1;
    }
    auto failed = [&]() {
        std::fprintf(stderr, "specrt-cpp: %s\n", specrt_last_error());
        specrt_engine_close(engine);
        return 1;
    };
    if (prompts.empty() && texts.empty()) prompts.emplace_back();  // the engine says what is wrong with an empty prompt
    struct Output {
        std::vector<int64_t> ids;
        std::string text;
        bool is_text = false;
        std::string finish;  // why it ended
    };
    std::map<int64_t, Output> outputs;  // request id -> what it generated (ids count up from 0, in the order added)
    for (long r = 0; r < repeat; ++r) {
        for (const auto& prompt : prompts) {
            int64_t id = 0;
            if (specrt_add_request(engine, prompt.data(), prompt.size(), &params, &id) != SPECRT_OK) return failed();
            outputs[id];
        }
        for (const auto& text : texts) {
            int64_t id = 0;
            if (system) {
                const specrt_message chat[] = {{"system", system}, {"user", text.c_str()}};
                if (specrt_add_chat(engine, chat, 2, &params, &id) != SPECRT_OK) return failed();
            } else if (specrt_add_text(engine, text.c_str(), raw, &params, &id) != SPECRT_OK) {
                return failed();
            }
            outputs[id].is_text = true;
        }
    }
    const bool stream = !as_json && outputs.size() == 1 && outputs.begin()->second.is_text;
    while (specrt_has_unfinished(engine)) {
        const specrt_event* events = nullptr;
        size_t n = 0;
        if (specrt_step(engine, &events, &n) != SPECRT_OK) return failed();
        for (size_t i = 0; i < n; ++i) {
            Output& o = outputs[events[i].request_id];
            o.ids.insert(o.ids.end(), events[i].token_ids, events[i].token_ids + events[i].n_tokens);
            o.text.append(events[i].text, events[i].n_text);
            if (events[i].finish_reason) o.finish = events[i].finish_reason;
            if (stream) {
                std::fwrite(events[i].text, 1, events[i].n_text, stdout);
                std::fflush(stdout);
            }
        }
    }
    specrt_stats s = specrt_get_stats(engine);
    size_t tokens = 0;
    std::string all, all_texts, all_reasons;
    auto quoted = [](const std::string& t) {  // a JSON string (the text is valid UTF-8)
        std::string q = "\"";
        for (unsigned char c : t) {
            if (c == '"' || c == '\\') q += '\\', q += static_cast<char>(c);
            else if (c == '\n') q += "\\n";
            else if (c == '\t') q += "\\t";
            else if (c == '\r') q += "\\r";
            else if (c < 0x20) {
                char buf[8];
                std::snprintf(buf, sizeof(buf), "\\u%04x", c);
                q += buf;
            } else q += static_cast<char>(c);
        }
        return q + "\"";
    };
    for (const auto& [id, o] : outputs) {
        std::string ids;
        for (size_t i = 0; i < o.ids.size(); ++i) ids += (i ? "," : "") + std::to_string(o.ids[i]);
        all += (all.empty() ? "[" : ", [") + ids + "]";
        all_texts += (all_texts.empty() ? "" : ", ") + quoted(o.text);
        all_reasons += (all_reasons.empty() ? "" : ", ") + quoted(o.finish);
        tokens += o.ids.empty() ? 0 : o.ids.size() - 1;  // the first token of each comes from its prefill
        if (!as_json && !stream) std::printf("%s\n", o.is_text ? o.text.c_str() : ids.c_str());
    }
    if (stream) std::printf("\n");
    const double tps = s.decode_seconds > 0 ? tokens / s.decode_seconds : 0.0;
    if (as_json)
        std::printf("{\"outputs\": [%s], \"texts\": [%s], \"finish_reasons\": [%s], \"decode_tokens_per_s\": %.3f, "
                    "\"decode_seconds\": %.6f, \"rounds\": %zu, \"accepted\": %zu, \"head_calls\": %zu, \"gamma\": %d}\n",
                    all.c_str(), all_texts.c_str(), all_reasons.c_str(), tps, s.decode_seconds, s.rounds, s.accepted, s.head_calls,
                    specrt_gamma(engine));
    else
        std::fprintf(stderr, "-- %zu requests, %zu tokens, decode %.1f tok/s, %zu rounds, %zu drafts accepted\n",
                     outputs.size(), s.generated, tps, s.rounds, s.accepted);
    specrt_engine_close(engine);
    return 0;
}
