// specrt-cpp: the C API from the command line (an example of embedding it).
//   specrt-cpp ART --input-ids 1,2,3 [--method ar|ngram] [--max-new-tokens 64] [--threads N] [--ignore-eos] [--json]
// prints the generated token ids and the decode speed; a bad artifact or request is one line on stderr, exit 1.
#include "specrt.h"

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

static int usage(const char* why) {
    std::fprintf(stderr, "specrt-cpp: %s\nusage: specrt-cpp ART --input-ids 1,2,3 [--method ar|ngram] [--max-new-tokens 64] "
                         "[--threads N] [--ignore-eos] [--json]\n", why);
    return 2;
}

int main(int argc, char** argv) {
    const char* art = nullptr;
    std::vector<int64_t> prompt;
    size_t max_new = 64;
    specrt_options options{0, "ar"};
    bool ignore_eos = false, as_json = false;
    for (int i = 1; i < argc; ++i) {
        std::string a = argv[i];
        auto value = [&]() -> const char* { return i + 1 < argc ? argv[++i] : nullptr; };
        if (a == "--input-ids") {
            const char* v = value();
            if (!v) return usage("--input-ids needs a value");
            for (const char* p = v; *p;) {
                char* end;
                long long id = std::strtoll(p, &end, 10);
                if (end == p) return usage("--input-ids: comma-separated integers");
                prompt.push_back(id);
                p = *end == ',' ? end + 1 : end;
                if (*end && *end != ',') return usage("--input-ids: comma-separated integers");
            }
        } else if (a == "--max-new-tokens") {
            const char* v = value();
            if (!v || std::atoll(v) < 0) return usage("--max-new-tokens needs a count");
            max_new = static_cast<size_t>(std::atoll(v));
        } else if (a == "--method") {
            const char* v = value();
            if (!v) return usage("--method needs a name");
            options.method = v;
        } else if (a == "--threads") {
            const char* v = value();
            if (!v) return usage("--threads needs a count");
            options.threads = std::atoi(v);
        } else if (a == "--ignore-eos") {
            ignore_eos = true;
        } else if (a == "--json") {
            as_json = true;
        } else if (!art && a.rfind("--", 0) != 0) {
            art = argv[i];
        } else {
            return usage(("unknown argument " + a).c_str());
        }
    }
    if (!art) return usage("give an artifact directory");
    specrt_engine* engine = nullptr;
    if (specrt_engine_open(art, &options, &engine) != SPECRT_OK) {
        std::fprintf(stderr, "specrt-cpp: %s\n", specrt_last_error());
        return 1;
    }
    std::vector<int64_t> out(max_new);
    size_t n = 0;
    specrt_status s = specrt_generate(engine, prompt.data(), prompt.size(), max_new, ignore_eos, out.data(), &n);
    if (s != SPECRT_OK) {
        std::fprintf(stderr, "specrt-cpp: %s\n", specrt_last_error());
        specrt_engine_close(engine);
        return 1;
    }
    double secs = specrt_last_decode_seconds(engine);
    size_t accepted = 0, rounds = specrt_last_rounds(engine, &accepted);
    double tps = n > 1 && secs > 0 ? (n - 1) / secs : 0.0;
    std::string ids;
    for (size_t i = 0; i < n; ++i) ids += (i ? "," : "") + std::to_string(out[i]);
    if (as_json)
        std::printf("{\"output_ids\": [%s], \"decode_tokens_per_s\": %.3f, \"rounds\": %zu, \"accepted\": %zu}\n",
                    ids.c_str(), tps, rounds, accepted);
    else std::printf("%s\n-- %zu tokens, decode %.1f tok/s, %zu rounds, %zu drafts accepted\n", ids.c_str(), n, tps,
                     rounds, accepted);
    specrt_engine_close(engine);
    return 0;
}
