// The C++ engine: the Python engine's loop (runtime/engine.py, runtime/host_round.py) over an artifact's slots:
// requests are added, each step admits waiting ones into free slots (chunked prefill, first token) and runs one
// decode step (ar) or one draft/verify round over the active slots, and finished requests leave their slot.
//
//   propose   a drafter: n-gram lookups, a draft head's graph (dspark, mtp), or a head with lookups (the hybrids)
//   schedule  fixed, threshold, sps (Algorithm 1 on the cost table), sps-async; capped by drafts, gamma, budget
//   verify    one packed target call over every active slot's anchor and drafts
//   accept    greedy prefix match, or rejection sampling (exact in distribution)
//   commit    length += a + 1; the verified positions become the head's next context rows
#pragma once

#include "artifact.h"
#include "runner.h"
#include "sampling.h"
#include "tokenizer.h"

#include <deque>
#include <memory>
#include <optional>

namespace specrt {

struct Options {
    int threads = 0;
    std::string method = "ar", scheduler = "fixed";
    int64_t gamma = 0;  // 0: the artifact's
    int64_t slots = 0;  // 0: sized to the queue whenever the engine is idle
    int64_t ngram = 3;
    double threshold = 0.3;
    int64_t tree = 1;  // > 1: drafts are trees of this width (n-gram continuations; a DSpark head's first tokens)
};

// Target positions the draft head has not seen yet: rows pos, pos + 1, ... (its feature columns, and the token
// after each position).
struct Context {
    int64_t pos = 0;
    std::vector<float> features;  // rows x width
    std::vector<int64_t> next_tokens;

    int64_t rows() const { return static_cast<int64_t>(next_tokens.size()); }
};

struct Slot {
    int64_t id = 0, prompt_tokens = 0, length = 0, pending = -1;
    Params params;
    Rng rng{0};
    std::vector<int64_t> history, output;  // prompt + output; output
    std::optional<Context> ctx;
    std::string finish;  // "" while running: "eos", "stop", "length"
    std::shared_ptr<StreamDecoder> stream;  // the text of its tokens, where the artifact has a tokenizer
    std::string text;  // its text so far, where it has stop strings to find in it

    int64_t budget() const { return params.max_new_tokens - static_cast<int64_t>(output.size()); }
};

struct Event {
    int64_t id = 0;
    std::vector<int64_t> tokens;
    std::string text;    // the text of those tokens (special tokens skipped; whole UTF-8 characters)
    std::string finish;  // "" while running: "eos", "stop", "length", "abort"
};

struct Stats {
    int64_t rounds = 0, accepted = 0, head_calls = 0, generated = 0;
    double prefill_s = 0.0, decode_s = 0.0;
};

class Drafter;
class Scheduler;
struct Proposal;
class CostTable;

class Engine {
public:
    Engine(const fs::path& dir, const Options& options);
    ~Engine();

    const Manifest& manifest() const { return manifest_; }
    int64_t gamma() const { return gamma_; }
    const Stats& stats() const { return stats_; }
    void reset_stats() { stats_ = Stats{}; }

    // Queue a request (checked now: one-line errors); returns its id.
    int64_t add(const std::vector<int64_t>& prompt, Params params, std::optional<int64_t> id = std::nullopt);
    // The artifact's tokenizer (throws the reason where there is none this runtime can run).
    const Tokenizer& tokenizer() const;
    // A text (one user message through the chat template unless `raw`) or a conversation as prompt ids, refused
    // before tokenizing when it is longer than the artifact's positions could hold whatever it tokenizes to
    // (serve/protocol.py CHARS_SLACK): a caller's text is bounded by what it could become, not tokenized whole.
    std::vector<int64_t> encode_text(const std::string& text, bool raw) const;
    std::vector<int64_t> encode_chat(const std::vector<std::pair<std::string, std::string>>& messages) const;
    // Admit waiting requests, then one decode step or round over the active slots.
    std::vector<Event> step();
    // Drop a queued or running request; false if it is not unfinished.
    bool abort(int64_t id);
    void abort_all();
    bool unfinished() const;

private:
    void check_text(size_t bytes) const;
    struct Request {
        int64_t id;
        std::vector<int64_t> prompt;
        Params params;
    };

    void allocate(int64_t n);
    void admit(std::map<int64_t, Event>& events);
    void prefill(int64_t index, Request request, std::map<int64_t, Event>& events);
    std::vector<Slot*> live();
    Tensors& grid(const Bucket& bucket, const std::vector<Slot*>& slots, const std::vector<int64_t>& lengths,
                  const Proposal* p, bool dense);
    void decode(std::map<int64_t, Event>& events);
    void round(std::map<int64_t, Event>& events);
    int64_t emit(Slot& s, const std::vector<int64_t>& tokens, std::map<int64_t, Event>& events);
    void retire(int64_t index, std::map<int64_t, Event>& events);

    Manifest manifest_;
    Options options_;
    std::unique_ptr<Runner> target_;
    std::unique_ptr<CostTable> costs_;
    std::unique_ptr<Drafter> drafter_;
    std::unique_ptr<Scheduler> scheduler_;
    std::string head_;  // the head whose features slots carry ("": none)
    int64_t feature_offset_ = 0, feature_dim_ = 0, gamma_ = 0, next_id_ = 0;
    bool speculative_ = false, fixed_slots_ = false, tree_mask_ = false;
    std::unique_ptr<Tokenizer> tokenizer_;
    std::string tokenizer_problem_;
    std::vector<std::optional<Slot>> slots_;
    std::deque<Request> waiting_;
    Stats stats_;
};

}  // namespace specrt
