/* specrt's C API: load an artifact that `specrt export` wrote and generate from it on ONNX Runtime, with the same
 * lossless draft/verify loop as the Python engine (token-identical greedy output; sampled output with exactly the
 * target's distribution).
 *
 * Methods: "ar" (plain decoding), "ngram", "dspark", "mtp", "dspark+ngram", "mtp+ngram". Schedulers: "fixed",
 * "threshold", "sps", "sps-async" (sps and the hybrids read the artifact's profile.json, written by `specrt profile`).
 * Requests are token ids, or text: the artifact's tokenizer (byte-level BPE: SmolLM2, Llama 3, Qwen) encodes it, through
 * the chat template unless raw (the exporter stores the template's text around a user message in the manifest), and
 * each step's events carry the new text. Several requests may be in flight over the artifact's slots: add them, step
 * the engine, read each step's events.
 *
 * Ownership: a handle a function returns is the caller's and is freed with its close function; pointers the engine
 * returns (events, token arrays) stay valid until the next call on that engine.
 * Errors: functions return SPECRT_OK or an error code; specrt_last_error() describes the calling thread's last error
 * (valid until its next specrt call).
 * Threads: one engine is driven by one thread at a time (as in Python); different engines may run on different
 * threads at once.
 * Versions: specrt_options and specrt_params begin with their struct_size, which their _init function sets; the library
 * reads the fields that size covers and gives later ones their defaults, so a program built against this header
 * keeps working when a later one adds fields. A struct_size of 0 (a struct never initialized) is an error.
 */
#ifndef SPECRT_H
#define SPECRT_H

#include <stddef.h>
#include <stdint.h>

#if defined(__GNUC__)
#define SPECRT_API __attribute__((visibility("default"))) /* the library exports these functions only */
#else
#define SPECRT_API
#endif

#ifdef __cplusplus
extern "C" {
#endif

typedef enum specrt_status {
    SPECRT_OK = 0,
    SPECRT_ERROR_ARTIFACT = 1, /* a missing, corrupt or unsupported artifact (or its profile) */
    SPECRT_ERROR_REQUEST = 2,  /* a bad argument or request (empty prompt, token out of range, too long, bad option) */
    SPECRT_ERROR_RUNTIME = 3   /* ONNX Runtime failed */
} specrt_status;

typedef struct specrt_engine specrt_engine;

typedef struct specrt_options {
    size_t struct_size;    /* sizeof(specrt_options), set by specrt_options_init */
    int threads;           /* intra-op threads per session; 0: all cores */
    const char* method;    /* NULL: "ar" */
    const char* scheduler; /* NULL: "fixed" */
    int gamma;             /* drafts verified per round at most; 0: the artifact's */
    int slots;             /* request slots allocated up front; 0: sized to the queue whenever the engine is idle */
    int ngram;             /* the longest suffix n-gram lookups match (3) */
    double threshold;      /* the threshold scheduler's survival cut (0.3) */
    int tree;              /* 1: chains; 2..8: drafts are trees of this width, verified in one call (methods ngram:
                            * n-gram continuations; dspark, dspark+ngram: the head's likeliest other first tokens) */
} specrt_options;

typedef struct specrt_params {
    size_t struct_size;            /* sizeof(specrt_params), set by specrt_params_init */
    double temperature;            /* 0: greedy */
    int top_k;                     /* 0: off */
    double top_p;                  /* 1: off */
    int64_t seed;                  /* -1: unseeded; a seeded request draws with seed + its id */
    size_t max_new_tokens;         /* >= 1 */
    const int64_t* stop_token_ids; /* end the request like EOS (kept in the output) */
    size_t n_stop_token_ids;
    int ignore_eos;
    const char* const* stop_strings; /* end the request where its text first holds one (cut before it; needs the
                                      * artifact's tokenizer); NULL-free, non-empty UTF-8 */
    size_t n_stop_strings;
} specrt_params;

typedef struct specrt_event {
    int64_t request_id;
    const int64_t* token_ids; /* the tokens this step committed for the request */
    size_t n_tokens;
    const char* text; /* their text (NUL-terminated, whole UTF-8 characters, special tokens skipped; "" without a
                       * tokenizer) */
    size_t n_text;
    const char* finish_reason; /* NULL while it runs; "eos", "stop" or "length" when it has finished */
} specrt_event;

SPECRT_API void specrt_options_init(specrt_options* options); /* the defaults above */
SPECRT_API void specrt_params_init(specrt_params* params);    /* greedy, 128 tokens, no seed */

/* Open the artifact in `artifact_dir` (its format version and graphs' I/O are checked against the manifest). */
SPECRT_API specrt_status specrt_engine_open(const char* artifact_dir, const specrt_options* options, specrt_engine** engine);
SPECRT_API void specrt_engine_close(specrt_engine* engine);

/* Queue a request (checked now); its id into *request_id (NULL: not wanted). */
SPECRT_API specrt_status specrt_add_request(specrt_engine* engine, const int64_t* prompt, size_t n_prompt,
                                 const specrt_params* params, int64_t* request_id);
/* Queue a text request: a user message through the chat template, or `raw` text as it is (with the tokenizer's
 * special tokens, such as a BOS). */
SPECRT_API specrt_status specrt_add_text(specrt_engine* engine, const char* text, int raw, const specrt_params* params,
                              int64_t* request_id);
/* A conversation through the chat template, with the generation prompt (as the server renders chat messages):
 * messages[i].role is "system", "user" or "assistant"; where the template's text between two roles is not known (the
 * manifest says why), SPECRT_ERROR_REQUEST. */
typedef struct specrt_message {
    const char* role;
    const char* content;
} specrt_message;
SPECRT_API specrt_status specrt_add_chat(specrt_engine* engine, const specrt_message* messages, size_t n_messages,
                                         const specrt_params* params, int64_t* request_id);
/* The token ids of `text` (as specrt_add_text would queue them) into ids (room for `capacity`); *n_ids: how many
 * there are (also when `capacity` is too small: then SPECRT_ERROR_REQUEST and nothing written). */
SPECRT_API specrt_status specrt_tokenize(specrt_engine* engine, const char* text, int raw, int64_t* ids, size_t capacity,
                              size_t* n_ids);
/* The text of `ids`, NUL-terminated, into `text` (room for `capacity` bytes); *n_text: its length without the NUL
 * (also when `capacity` is too small: then SPECRT_ERROR_REQUEST). */
SPECRT_API specrt_status specrt_detokenize(specrt_engine* engine, const int64_t* ids, size_t n_ids, int skip_special, char* text,
                                size_t capacity, size_t* n_text);

/* Admit waiting requests into free slots, then one decode step or draft/verify round over the active ones; what
 * happened to each request touched into *events / *n_events (valid until the next call on the engine). */
SPECRT_API specrt_status specrt_step(specrt_engine* engine, const specrt_event** events, size_t* n_events);
/* Drop a queued or running request; SPECRT_ERROR_REQUEST if it is not unfinished. */
SPECRT_API specrt_status specrt_abort(specrt_engine* engine, int64_t request_id);
SPECRT_API int specrt_has_unfinished(const specrt_engine* engine);

/* One request start to finish on an idle engine: up to params->max_new_tokens ids into `out` (room for that many),
 * their count into *n_out. */
SPECRT_API specrt_status specrt_generate(specrt_engine* engine, const int64_t* prompt, size_t n_prompt,
                              const specrt_params* params, int64_t* out, size_t* n_out);

/* The vocabulary size; gamma (drafts verified per round at most; 0 for ar). */
SPECRT_API int64_t specrt_vocab_size(const specrt_engine* engine);
SPECRT_API int specrt_gamma(const specrt_engine* engine);
/* Counters since open (or the last specrt_generate, which resets them): slot rounds (decode steps for ar), drafts
 * accepted, seconds in decode steps and rounds (prefill excluded), tokens generated, rounds that called a draft head
 * (under sps / sps-async a head is called only on rounds where it promises more than decoding, and to explore). */
typedef struct specrt_stats {
    size_t rounds, accepted, generated;
    double decode_seconds, prefill_seconds;
    size_t head_calls;
} specrt_stats;
SPECRT_API specrt_stats specrt_get_stats(const specrt_engine* engine);

SPECRT_API const char* specrt_last_error(void);

#ifdef __cplusplus
}
#endif
#endif /* SPECRT_H */
