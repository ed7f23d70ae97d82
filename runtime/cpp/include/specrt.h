/* specrt's C API: load an artifact that `specrt export` wrote and generate from it on ONNX Runtime.
 *
 * Status: this first slice of the C++ runtime runs greedy decoding over the artifact's target graph, one request at
 * a time, token ids in and out: plain decoding ("ar") and the lossless draft/verify loop with n-gram lookups
 * ("ngram", fixed lengths, packed verification); it is token-identical to the Python engine (tests/test_cpp.py).
 * The draft heads (MTP, DSpark), sampling, tokenizers and several requests in flight are not here yet.
 *
 * Ownership: every handle a function returns is the caller's and is freed with its *_free/close function.
 * Errors: functions return SPECRT_OK or an error code; specrt_last_error() describes the last error of the calling
 * thread (valid until its next specrt call). Threads: one engine is driven by one thread at a time, as in Python;
 * different engines may run on different threads.
 */
#ifndef SPECRT_H
#define SPECRT_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef enum specrt_status {
    SPECRT_OK = 0,
    SPECRT_ERROR_ARTIFACT = 1, /* a missing, corrupt or unsupported artifact */
    SPECRT_ERROR_REQUEST = 2,  /* a bad argument or request (empty prompt, token out of range, too long) */
    SPECRT_ERROR_RUNTIME = 3   /* ONNX Runtime failed */
} specrt_status;

typedef struct specrt_engine specrt_engine;

typedef struct specrt_options {
    int threads;        /* intra-op threads per session; 0: all cores */
    const char* method; /* "ar" (NULL: ar) or "ngram" */
} specrt_options;

/* Open the artifact in `artifact_dir` (checks its format version and the target graph's I/O against the manifest). */
specrt_status specrt_engine_open(const char* artifact_dir, const specrt_options* options, specrt_engine** engine);
void specrt_engine_close(specrt_engine* engine);

/* Greedy decoding of `prompt` (n_prompt token ids): up to `max_new_tokens` ids into `out` (room for max_new_tokens),
 * their count into *n_out; stops after an end-of-sequence id of the artifact unless `ignore_eos`. */
specrt_status specrt_generate(specrt_engine* engine, const int64_t* prompt, size_t n_prompt, size_t max_new_tokens,
                              int ignore_eos, int64_t* out, size_t* n_out);

/* The vocabulary size; the decode seconds of the last specrt_generate (excluding prefill); its rounds (target calls
 * after prefill) and, into *accepted, the drafts accepted in them. */
int64_t specrt_vocab_size(const specrt_engine* engine);
double specrt_last_decode_seconds(const specrt_engine* engine);
size_t specrt_last_rounds(const specrt_engine* engine, size_t* accepted);

const char* specrt_last_error(void);

#ifdef __cplusplus
}
#endif
#endif /* SPECRT_H */
