// The C++ API of specrt.hpp (over the C API) on the artifact named by $SPECRT_TEST_ARTIFACT (a skip without one):
// generate equals add/step, exceptions carry the C API's status and message, a moved engine keeps working, and where
// the artifact has a tokenizer, text round-trips.
#include "specrt.hpp"

#include <cstdio>
#include <cstdlib>
#include <cstring>

static int failures = 0;
#define CHECK(cond, what)                                                     \
    do {                                                                      \
        if (!(cond)) {                                                        \
            std::fprintf(stderr, "FAILED %s:%d: %s\n", __FILE__, __LINE__, what); \
            ++failures;                                                       \
        }                                                                     \
    } while (0)

int main() {
    const char* art = std::getenv("SPECRT_TEST_ARTIFACT");
    if (!art || !*art) {
        std::fprintf(stderr, "SPECRT_TEST_ARTIFACT is not set: no artifact to test on (tests/test_cpp.py sets it)\n");
        return 77;
    }
    try {
        specrt::Engine missing("/nonexistent/artifact");
        CHECK(false, "opening a missing artifact throws");
    } catch (const specrt::Exception& e) {
        CHECK(e.status() == SPECRT_ERROR_ARTIFACT && std::strstr(e.what(), "not a specrt artifact"), "its status and message");
    }
    specrt::EngineOptions options;
    options.method = "ngram";
    options.threads = 1;
    specrt::Engine engine(art, options);
    specrt::GenerateOptions g;
    g.max_new_tokens = 10;
    g.ignore_eos = true;
    const std::vector<int64_t> prompt{5, 6, 7, 5, 6, 7, 5};
    std::vector<int64_t> first = engine.generate(prompt, g);
    CHECK(first.size() == 10, "generate gives max_new_tokens tokens");
    specrt::Engine moved = std::move(engine);
    int64_t id = moved.add(prompt, g);
    std::vector<int64_t> stepped;
    std::string finish;
    while (moved.has_unfinished())
        for (const specrt::Event& e : moved.step())
            if (e.request_id == id) {
                stepped.insert(stepped.end(), e.token_ids.begin(), e.token_ids.end());
                finish = e.finish_reason;
            }
    CHECK(stepped == first && finish == "length", "add/step gives generate's tokens, then finishes at its length");
    try {
        moved.add(std::vector<int64_t>{});
        CHECK(false, "an empty prompt throws");
    } catch (const specrt::Exception& e) {
        CHECK(e.status() == SPECRT_ERROR_REQUEST && std::strstr(e.what(), "empty prompt"), "a request error");
    }
    try {
        std::vector<int64_t> ids = moved.tokenize("hello world", true);
        CHECK(!ids.empty() && moved.detokenize(ids) == "hello world", "text round-trips through the tokenizer");
    } catch (const specrt::Exception& e) {
        CHECK(std::strstr(e.what(), "no tokenizer") != nullptr, "without a tokenizer, text says so");
    }
    if (failures) std::fprintf(stderr, "%d checks failed\n", failures);
    else std::printf("cpp_api_test: all checks passed\n");
    return failures ? 1 : 0;
}
