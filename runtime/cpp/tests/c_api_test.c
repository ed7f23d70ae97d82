/* The C API from C (this file is compiled as C99, so the header must be C): the request lifecycle (add, step, abort),
 * generate, and errors for bad calls, on the artifact named by $SPECRT_TEST_ARTIFACT (ctest reports a skip without
 * one; tests/test_cpp.py runs it with a tiny artifact). */
#include "specrt.h"

#include <stdio.h>
#include <stdlib.h>
#include <stddef.h>
#include <string.h>

static int failures = 0;

#define CHECK(cond, what)                                                                      \
    do {                                                                                       \
        if (!(cond)) {                                                                         \
            fprintf(stderr, "FAILED %s:%d: %s (last error: %s)\n", __FILE__, __LINE__, what, \
                    specrt_last_error());                                                      \
            ++failures;                                                                        \
        }                                                                                      \
    } while (0)

int main(void) {
    const char* art = getenv("SPECRT_TEST_ARTIFACT");
    if (!art || !*art) {
        fprintf(stderr, "SPECRT_TEST_ARTIFACT is not set: no artifact to test on (tests/test_cpp.py sets it)\n");
        return 77;
    }
    specrt_engine* engine = NULL;
    specrt_options options;
    specrt_options_init(&options);
    options.threads = 1;
    options.method = "ngram";

    CHECK(specrt_engine_open("/nonexistent/artifact", &options, &engine) == SPECRT_ERROR_ARTIFACT, "a missing artifact");
    CHECK(engine == NULL, "no engine after a failed open");
    CHECK(strstr(specrt_last_error(), "not a specrt artifact") != NULL, "the error names the problem");
    CHECK(specrt_engine_open(art, &options, NULL) == SPECRT_ERROR_REQUEST, "a NULL engine pointer");
    options.method = "nonsense";
    CHECK(specrt_engine_open(art, &options, &engine) == SPECRT_ERROR_REQUEST, "an unknown method");
    options.method = "ngram";
    if (specrt_engine_open(art, &options, &engine) != SPECRT_OK) {
        fprintf(stderr, "cannot open %s: %s\n", art, specrt_last_error());
        return 1;
    }

    specrt_params params;
    specrt_params_init(&params);
    params.max_new_tokens = 12;
    params.ignore_eos = 1;
    const int64_t prompt[] = {5, 6, 7, 5, 6, 7, 5, 6};
    int64_t out[12];
    size_t n = 0;
    CHECK(specrt_generate(engine, prompt, 8, &params, out, &n) == SPECRT_OK && n == 12, "generate 12 tokens");
    int64_t first[12];
    memcpy(first, out, sizeof(first));

    /* the same request through add / step: the same tokens; and one aborted while it runs */
    int64_t id = -1, other = -1;
    CHECK(specrt_add_request(engine, prompt, 8, &params, &id) == SPECRT_OK, "add a request");
    CHECK(specrt_add_request(engine, prompt, 3, &params, &other) == SPECRT_OK && other != id, "add a second");
    CHECK(specrt_has_unfinished(engine), "requests are pending");
    CHECK(specrt_generate(engine, prompt, 8, &params, out, &n) == SPECRT_ERROR_REQUEST, "generate needs an idle engine");
    size_t got = 0, steps = 0;
    int finished = 0;
    while (specrt_has_unfinished(engine)) {
        const specrt_event* events = NULL;
        size_t count = 0;
        CHECK(specrt_step(engine, &events, &count) == SPECRT_OK, "step");
        if (++steps == 1) CHECK(specrt_abort(engine, other) == SPECRT_OK, "abort a running request");
        for (size_t i = 0; i < count; ++i) {
            if (events[i].request_id != id) continue;
            for (size_t k = 0; k < events[i].n_tokens && got < 12; ++k, ++got)
                CHECK(events[i].token_ids[k] == first[got], "add/step gives generate's tokens");
            if (events[i].finish_reason) finished = strcmp(events[i].finish_reason, "length") == 0;
        }
    }
    CHECK(got == 12 && finished, "the request finished at its length");
    CHECK(specrt_abort(engine, other) == SPECRT_ERROR_REQUEST, "aborting a finished request is an error");

    /* bad requests: errors, and the engine still works after them */
    const int64_t bad[] = {5, 1 << 30};
    CHECK(specrt_add_request(engine, bad, 2, &params, &id) == SPECRT_ERROR_REQUEST, "a token outside the vocabulary");
    CHECK(strstr(specrt_last_error(), "outside the vocabulary") != NULL, "its message");
    CHECK(specrt_add_request(engine, prompt, 0, &params, &id) == SPECRT_ERROR_REQUEST, "an empty prompt");
    CHECK(specrt_add_request(engine, NULL, 3, &params, &id) == SPECRT_ERROR_REQUEST, "a NULL prompt");
    params.temperature = -1.0;
    CHECK(specrt_add_request(engine, prompt, 8, &params, &id) == SPECRT_ERROR_REQUEST, "a negative temperature");
    params.temperature = 0.0;
    params.top_p = 0.0;
    CHECK(specrt_add_request(engine, prompt, 8, &params, &id) == SPECRT_ERROR_REQUEST, "top_p 0");
    params.top_p = 1.0;
    params.max_new_tokens = 0;
    CHECK(specrt_add_request(engine, prompt, 8, &params, &id) == SPECRT_ERROR_REQUEST, "max_new_tokens 0");
    params.max_new_tokens = 12;
    CHECK(!specrt_has_unfinished(engine), "refused requests leave nothing queued");
    CHECK(specrt_generate(engine, prompt, 8, &params, out, &n) == SPECRT_OK && n == 12 &&
              memcmp(out, first, sizeof(first)) == 0, "the engine still generates the same tokens");
    CHECK(specrt_step(engine, NULL, NULL) == SPECRT_ERROR_REQUEST, "step with NULL outputs");

    /* versioned structs: one never initialized is an error; a caller built against an older, shorter specrt_params
     * (no stop strings) gets the defaults of the fields it does not have */
    specrt_params zeroed;
    memset(&zeroed, 0, sizeof zeroed);
    CHECK(specrt_add_request(engine, prompt, 8, &zeroed, &id) == SPECRT_ERROR_REQUEST, "params with struct_size 0");
    CHECK(strstr(specrt_last_error(), "specrt_params_init") != NULL, "its message names the fix");
    specrt_options unset;
    memset(&unset, 0, sizeof unset);
    specrt_engine* none = NULL;
    CHECK(specrt_engine_open(art, &unset, &none) == SPECRT_ERROR_REQUEST && none == NULL, "options with struct_size 0");
    specrt_params older = params;
    older.struct_size = offsetof(specrt_params, stop_strings);
    older.stop_strings = (const char* const*)1; /* past the caller's struct: never read */
    older.n_stop_strings = 3;
    CHECK(specrt_generate(engine, prompt, 8, &older, out, &n) == SPECRT_OK && n == 12 &&
              memcmp(out, first, sizeof(first)) == 0, "an older specrt_params: the same tokens, no stop strings");

    /* stop strings: the request ends where its text first holds one, the text cut before it (with a tokenizer) */
    char text[4096];
    size_t n_text = 0;
    const char* stops[1];
    params.stop_strings = stops;
    params.n_stop_strings = 1;
    if (specrt_detokenize(engine, first, 12, 1, text, sizeof text, &n_text) == SPECRT_OK) {
        char piece[64] = {0};
        size_t n_piece = 0;
        size_t k = 3; /* a stop string: the text of the first token from the fourth on that has some */
        while (k < 12 && (specrt_detokenize(engine, first + k, 1, 1, piece, sizeof piece, &n_piece) != SPECRT_OK ||
                          n_piece == 0 || strchr(piece, '\xef') != NULL))
            ++k;
        if (k < 12) {
            stops[0] = piece;
            CHECK(specrt_add_request(engine, prompt, 8, &params, &id) == SPECRT_OK, "add a request with a stop string");
            const char* reason = NULL;
            char seen[4096] = {0};
            while (specrt_has_unfinished(engine)) {
                const specrt_event* events = NULL;
                size_t count = 0;
                CHECK(specrt_step(engine, &events, &count) == SPECRT_OK, "step");
                for (size_t i = 0; i < count; ++i) {
                    strncat(seen, events[i].text, sizeof seen - strlen(seen) - 1);
                    if (events[i].finish_reason) reason = events[i].finish_reason;
                }
            }
            CHECK(reason && strcmp(reason, "stop") == 0, "it finished for its stop string");
            CHECK(strstr(seen, piece) == NULL && strncmp(seen, text, strlen(seen)) == 0,
                  "its text is the unstopped text cut before the stop string");
            printf("c_api_test: stop string checked (token %zu's text)\n", k);
        }
    } else {
        stops[0] = "x";
        CHECK(specrt_add_request(engine, prompt, 8, &params, &id) == SPECRT_ERROR_REQUEST &&
                  strstr(specrt_last_error(), "tokenizer") != NULL,
              "without a tokenizer, stop strings are refused");
        printf("c_api_test: no tokenizer: stop strings refused\n");
    }
    params.stop_strings = NULL;
    params.n_stop_strings = 0;
    stops[0] = NULL;
    params.stop_strings = stops;
    params.n_stop_strings = 1;
    CHECK(specrt_add_request(engine, prompt, 8, &params, &id) == SPECRT_ERROR_REQUEST, "a NULL stop string");
    params.stop_strings = NULL;
    CHECK(specrt_add_request(engine, prompt, 8, &params, &id) == SPECRT_ERROR_REQUEST, "n_stop_strings without them");
    params.n_stop_strings = 0;
    CHECK(!specrt_has_unfinished(engine), "refused requests leave nothing queued");
    specrt_engine_close(engine);
    specrt_engine_close(NULL); /* closing NULL is a no-op */
    if (failures) fprintf(stderr, "%d checks failed\n", failures);
    else printf("c_api_test: all checks passed\n");
    return failures ? 1 : 0;
}
