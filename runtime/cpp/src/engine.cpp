#include "engine.h"
#include "io_names.h"

#include "round.h"
#include "tree.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <numeric>

namespace specrt {

namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

const std::vector<std::string> kMethods{"ar", "ngram", "mtp", "dspark", "dspark+ngram", "mtp+ngram"};

// Slot-count buckets: powers of two below `batch`, and `batch` (specrt/artifact.py batch_sizes).
int64_t slot_bucket(int64_t n, int64_t batch) {
    for (int64_t b = 1; b < batch; b *= 2)
        if (b >= n) return b;
    return batch;
}

}  // namespace

Engine::Engine(const fs::path& dir, const Options& options) : options_(options) {
    if (std::find(kMethods.begin(), kMethods.end(), options.method) == kMethods.end())
        throw Error(SPECRT_ERROR_REQUEST, "unknown method '" + options.method +
                                              "'; choose one of ar, ngram, mtp, dspark, dspark+ngram, mtp+ngram");
    if (options.gamma < 0 || options.slots < 0 || options.ngram < 1 || options.threads < 0)
        throw Error(SPECRT_ERROR_REQUEST, "gamma, slots and threads must be >= 0 and ngram >= 1");
    if (options.tree < 1 || options.tree > 8)
        throw Error(SPECRT_ERROR_REQUEST, "tree must be between 1 and 8, got " + std::to_string(options.tree));
    const std::string& method = options.method;
    if (options.tree > 1 && method != "ngram" && method != "dspark" && method != "dspark+ngram")
        throw Error(SPECRT_ERROR_REQUEST, "tree drafts trees of n-gram lookups or of a DSpark head's first drafts: use "
                                          "it with ngram, dspark or dspark+ngram, not " + method);
    // more threads than the cores this process may run on only contend (and 100,000 would take minutes to start)
    if (options.threads > default_threads()) options_.threads = default_threads();
    manifest_ = load_manifest(dir);
    target_ = std::make_unique<Runner>(ort_env(options_.threads), dir, manifest_.graphs.at("target"), options_.threads, /*spin=*/true);
    auto has = [](const std::vector<TensorSpec>& list, const char* name) {
        return std::any_of(list.begin(), list.end(), [&](const TensorSpec& t) { return t.name == name; });
    };
    tree_mask_ = has(target_->spec().inputs, io::kTreeMask);
    if (options.tree > 1 && !tree_mask_)
        throw Error(SPECRT_ERROR_ARTIFACT, "tree needs a target graph with a tree_mask input, which this artifact "
                                           "(exported by an older specrt) lacks: re-export it");
    speculative_ = method != "ar";
    if (speculative_) {
        const int64_t exported = manifest_.gamma;
        if (options.gamma && (options.gamma < 1 || options.gamma > exported))
            throw Error(SPECRT_ERROR_REQUEST, "gamma must be between 1 and " + std::to_string(exported) +
                                                  " (the artifact's verify length - 1), got " + std::to_string(options.gamma));
        const int64_t gamma = options.gamma ? options.gamma : exported;
        const bool hybrid = method.find('+') != std::string::npos;
        const std::string head = method == "ngram" ? "" : method.substr(0, method.find('+'));
        if (hybrid || options.scheduler.rfind("sps", 0) == 0) {
            std::optional<Profile> profile = load_profile(dir, options_.threads > 0 ? options_.threads : default_threads());
            if (!profile)
                throw Error(SPECRT_ERROR_ARTIFACT, "scheduler " + options.scheduler + " / method " + method +
                                                       " plan on a cost profile and " + dir.string() +
                                                       " has none for ort: run `specrt profile " + dir.string() + "` once");
            costs_ = std::make_unique<CostTable>(std::move(*profile));
        }
        std::vector<float> temperatures;
        int64_t grafted = 0;  // a DSpark tree: the block and its alternatives
        if (head.empty()) {
            drafter_ = std::make_unique<NGramDrafter>(gamma, options.ngram, 0.5, options.tree);
        } else {
            auto h = manifest_.heads.find(head);
            if (h == manifest_.heads.end()) {
                std::string have;
                for (const auto& [name, _] : manifest_.heads) have += (have.empty() ? "" : ", ") + name;
                throw Error(SPECRT_ERROR_REQUEST, "method " + method + " needs an artifact exported with a " + head +
                                                      " head (this one has: " + (have.empty() ? "none" : have) + ")");
            }
            head_ = head;
            feature_offset_ = h->second.feature_offset;
            feature_dim_ = h->second.feature_dim;
            temperatures = h->second.temperatures;
            if (options.tree > 1) {
                if (!has(manifest_.graphs.at(head).outputs, io::kDraftFirstTop))
                    throw Error(SPECRT_ERROR_ARTIFACT, "tree needs a DSpark graph that outputs its likeliest first tokens, "
                                                       "which this artifact (exported by an older specrt) lacks: re-export it");
                grafted = options.tree - 1;
            }
            auto graph = std::make_unique<GraphDrafter>(dir, manifest_, h->second, options_.threads, options.tree > 1);
            // under sps / sps-async a head alone is gated: called only when it promises more than decoding
            if (hybrid || costs_)
                drafter_ = std::make_unique<HybridDrafter>(std::move(graph), *costs_, options.ngram, /*lookups=*/hybrid);
            else
                drafter_ = std::move(graph);
        }
        gamma_ = std::min(gamma, drafter_->steps + grafted);
        scheduler_ = make_scheduler(options.scheduler, gamma_, temperatures, options.threshold, costs_.get());
    }
    if (!manifest_.tokenizer) {
        tokenizer_problem_ = "this artifact has no tokenizer (its model had none): pass token ids";
    } else {
        try {
            tokenizer_ = std::make_unique<Tokenizer>(dir / "tokenizer" / "tokenizer.json", manifest_.chat, manifest_.chat_problem);
        } catch (const Error& e) {  // ids still work; text says why not
            tokenizer_problem_ = e.what();
        }
    }
    fixed_slots_ = options.slots > 0;
    if (fixed_slots_) allocate(std::min(options.slots, manifest_.batch));
}

Engine::~Engine() = default;

void Engine::allocate(int64_t n) {
    n = slot_bucket(n, manifest_.batch);
    target_->allocate(n);
    if (drafter_) drafter_->allocate(n);
    slots_.assign(n, std::nullopt);
}

int64_t Engine::add(const std::vector<int64_t>& prompt, Params params, std::optional<int64_t> id) {
    const int64_t vocab = manifest_.vocab_size, capacity = manifest_.max_seq - 1;  // the last position absorbs padding writes
    if (prompt.empty()) throw Error(SPECRT_ERROR_REQUEST, "empty prompt");
    for (int64_t t : prompt)
        if (t < 0 || t >= vocab)
            throw Error(SPECRT_ERROR_REQUEST, "token id " + std::to_string(t) + " is outside the vocabulary (0.." +
                                                  std::to_string(vocab - 1) + ")");
    check_params(params, vocab);
    if (!params.stop_strings.empty() && !tokenizer_)
        throw Error(SPECRT_ERROR_REQUEST, "stop strings need the artifact's tokenizer: " + tokenizer_problem_);
    for (const std::string& stop : params.stop_strings)
        if (stop.empty()) throw Error(SPECRT_ERROR_REQUEST, "a stop string is empty");
    if (static_cast<int64_t>(prompt.size()) + params.max_new_tokens + gamma_ > capacity)
        throw Error(SPECRT_ERROR_REQUEST, "prompt of " + std::to_string(prompt.size()) + " tokens + max_new_tokens " +
                                              std::to_string(params.max_new_tokens) + " exceeds the artifact's " +
                                              std::to_string(capacity) + " cache positions");
    const int64_t rid = id.value_or(next_id_);
    if (rid < 0) throw Error(SPECRT_ERROR_REQUEST, "request ids must be >= 0");
    bool used = std::any_of(waiting_.begin(), waiting_.end(), [&](const Request& r) { return r.id == rid; }) ||
                std::any_of(slots_.begin(), slots_.end(), [&](const auto& s) { return s && s->id == rid; });
    if (used) throw Error(SPECRT_ERROR_REQUEST, "request id " + std::to_string(rid) + " is already in use");
    next_id_ = std::max(next_id_, rid + 1);
    waiting_.push_back(Request{rid, prompt, params});
    return rid;
}

bool Engine::unfinished() const {
    return !waiting_.empty() || std::any_of(slots_.begin(), slots_.end(), [](const auto& s) { return s.has_value(); });
}

bool Engine::abort(int64_t id) {
    for (auto it = waiting_.begin(); it != waiting_.end(); ++it)
        if (it->id == id) {
            waiting_.erase(it);
            return true;
        }
    for (auto& s : slots_)
        if (s && s->id == id) {
            s.reset();
            return true;
        }
    return false;
}

namespace {
constexpr size_t kCharsSlack = 4;  // serve/protocol.py CHARS_SLACK: room for normalizers that compose characters
}

void Engine::check_text(size_t bytes) const {
    const size_t room = static_cast<size_t>(manifest_.max_seq - 1), limit = room * tokenizer().longest_token() * kCharsSlack;
    if (bytes > limit)
        throw Error(SPECRT_ERROR_REQUEST, "the text is " + std::to_string(bytes) + " bytes, more than the artifact's " +
                                              std::to_string(room) + " positions could hold (" + std::to_string(limit) +
                                              " bytes at most); shorten it");
}

std::vector<int64_t> Engine::encode_text(const std::string& text, bool raw) const {
    check_text(text.size());
    return tokenizer().encode_prompt(text, raw);
}

std::vector<int64_t> Engine::encode_chat(const std::vector<std::pair<std::string, std::string>>& messages) const {
    size_t bytes = 0;
    for (const auto& [role, content] : messages) bytes += role.size() + content.size();
    check_text(bytes);
    return tokenizer().encode_chat(messages);
}

const Tokenizer& Engine::tokenizer() const {
    if (!tokenizer_) throw Error(SPECRT_ERROR_REQUEST, tokenizer_problem_);
    return *tokenizer_;
}

void Engine::abort_all() {
    waiting_.clear();
    for (auto& s : slots_) s.reset();
}

std::vector<Event> Engine::step() {
    std::map<int64_t, Event> events;
    admit(events);
    if (std::any_of(slots_.begin(), slots_.end(), [](const auto& s) { return s.has_value(); })) {
        auto t0 = Clock::now();
        if (speculative_) round(events);
        else decode(events);
        stats_.decode_s += seconds_since(t0);
        for (int64_t i = 0; i < static_cast<int64_t>(slots_.size()); ++i) retire(i, events);
    }
    std::vector<Event> out;
    for (auto& [_, e] : events) out.push_back(std::move(e));
    return out;
}

void Engine::admit(std::map<int64_t, Event>& events) {
    if (waiting_.empty()) return;
    const bool idle = std::none_of(slots_.begin(), slots_.end(), [](const auto& s) { return s.has_value(); });
    const int64_t want = std::min<int64_t>(static_cast<int64_t>(waiting_.size()), manifest_.batch);
    if (!fixed_slots_ && idle && static_cast<int64_t>(slots_.size()) < want) allocate(want);  // size the cache to the queue
    for (int64_t i = 0; i < static_cast<int64_t>(slots_.size()) && !waiting_.empty(); ++i) {
        if (slots_[i]) continue;
        Request r = std::move(waiting_.front());
        waiting_.pop_front();
        prefill(i, std::move(r), events);
        retire(i, events);
    }
}

// Prefill a request into slot `index`, chunk by chunk (runtime/calls/target.py), and draw its first token.
void Engine::prefill(int64_t index, Request request, std::map<int64_t, Event>& events) {
    auto t0 = Clock::now();
    Slot s;
    s.id = request.id;
    s.params = request.params;
    // seed + id in unsigned arithmetic: a seed near 2^63 wraps instead of overflowing
    s.rng = Rng(request.params.seed >= 0 ? static_cast<uint64_t>(request.params.seed) + static_cast<uint64_t>(request.id)
                                        : std::random_device{}());
    s.history = request.prompt;
    if (tokenizer_) s.stream = std::make_shared<StreamDecoder>(*tokenizer_, true);
    s.prompt_tokens = static_cast<int64_t>(request.prompt.size());
    const GraphSpec& spec = target_->spec();
    const Bucket& pb = spec.bucket("prefill");
    const int64_t t = pb.at("T"), n = s.prompt_tokens, vocab = manifest_.vocab_size;
    const bool keep = !head_.empty();
    Context ctx;
    Tensors& in = target_->inputs(index, pb);
    const Tensors* out = nullptr;
    for (int64_t start = 0; start < n; start += t) {
        const int64_t len = std::min(t, n - start);
        int64_t* ids = in.at(io::kInputIds).i64();
        std::fill_n(ids, t, 0);
        std::copy_n(request.prompt.begin() + start, len, ids);
        for (int64_t k = 0; k < t; ++k) in.at(io::kPositionIds).i[k] = start + k;
        in.at(io::kWriteIndex).i[0] = start;
        std::iota(in.at(io::kTokenRows).i.begin(), in.at(io::kTokenRows).i.end(), 0);
        in.at(io::kLogitRows).i[0] = len - 1;
        out = &target_->run(index, pb);
        if (keep) {  // the head's feature columns of the chunk's rows
            const Tensor& f = out->at(io::kFeatures);
            const int64_t all = f.shape[2];
            for (int64_t k = 0; k < len; ++k) {
                const float* row = f.f.data() + k * all + feature_offset_;
                ctx.features.insert(ctx.features.end(), row, row + feature_dim_);
            }
        }
    }
    s.length = n;
    const float* logits = out->at(io::kLogits).f.data();
    slots_[index] = std::move(s);
    Slot& slot = *slots_[index];
    emit(slot, {next_token(logits, vocab, slot.params, slot.rng)}, events);
    if (drafter_ && slot.finish.empty()) {
        ctx.pos = 0;
        ctx.next_tokens.assign(request.prompt.begin() + 1, request.prompt.end());
        ctx.next_tokens.push_back(slot.pending);
        if (keep) slot.ctx = drafter_->prefill(index, std::move(ctx));
    }
    stats_.prefill_s += seconds_since(t0);
    stats_.generated += 1;
}

// The active slots' span: slots [0, n), nullptr where idle.
std::vector<Slot*> Engine::live() {
    int64_t n = 0;
    for (int64_t i = 0; i < static_cast<int64_t>(slots_.size()); ++i)
        if (slots_[i]) n = i + 1;
    std::vector<Slot*> out(n, nullptr);
    for (int64_t i = 0; i < n; ++i)
        if (slots_[i]) out[i] = &*slots_[i];
    return out;
}

// Fill and run a decode or verify call over `slots` (runtime/calls/target.py grid): each active slot's anchor and its
// first lengths[i] drafts of `p` at positions L, L + 1, ...; idle slots and bucket padding write a dummy row at
// position 0 of their own cache row. `dense`: every cell computed, in grid order; else (packed) each active slot's
// cells in slot order, then cells no token uses.
Tensors& Engine::grid(const Bucket& bucket, const std::vector<Slot*>& slots, const std::vector<int64_t>& lengths,
                      const Proposal* p, bool dense) {
    const int64_t n = static_cast<int64_t>(slots.size()), b = bucket.at("B"), T = bucket.at("T"), P = bucket.at("P");
    Tensors& in = target_->inputs(0, bucket);
    int64_t* ids = in.at(io::kInputIds).i64();
    int64_t* pos = in.at(io::kPositionIds).i64();
    int64_t* write = in.at(io::kWriteIndex).i64();
    auto verified = [&](int64_t i, int64_t k) { return i < n && slots[i] && k <= lengths[i]; };
    const bool tree = p && !p->parents.empty();
    int64_t* mask = tree_mask_ ? in.at(io::kTreeMask).i64() : nullptr;  // [B, T, T]; all 0: chains
    if (mask) std::fill_n(mask, b * T * T, 0);
    std::fill_n(ids, b * T, 0);
    for (int64_t i = 0; i < b; ++i) {
        const Slot* s = i < n ? slots[i] : nullptr;
        const int64_t start = s ? s->length : 0;
        if (s) {
            ids[i * T] = s->pending;
            if (p) std::copy_n(p->tokens.begin() + i * p->width, lengths[i], ids + i * T + 1);
        }
        for (int64_t k = 0; k < T; ++k) pos[i * T + k] = start + k;
        if (s && tree && lengths[i]) {  // node j at its depth's position, seeing only its ancestors
            const int64_t* parents = p->parents.data() + i * p->width;
            const std::vector<int64_t> d = depths(parents, lengths[i]);
            for (int64_t j = 0; j < lengths[i]; ++j) pos[i * T + 1 + j] = start + d[j];
            fill_mask(parents, lengths[i], T, mask + i * T * T);
        }
        write[i] = start;
    }
    int64_t* rows = in.at(io::kTokenRows).i64();
    if (dense) {
        std::iota(rows, rows + P, 0);
    } else {
        int64_t r = 0;
        for (int64_t c = 0; c < b * T; ++c)
            if (verified(c / T, c % T)) rows[r++] = c;
        for (int64_t c = 0; c < b * T && r < P; ++c)
            if (!verified(c / T, c % T)) rows[r++] = c;
    }
    std::iota(in.at(io::kLogitRows).i.begin(), in.at(io::kLogitRows).i.end(), 0);
    return target_->run(0, bucket);
}

// One decode step over slots [0, n): write each pending token, draw the next.
void Engine::decode(std::map<int64_t, Event>& events) {
    const std::vector<Slot*> slots = live();
    const int64_t n = static_cast<int64_t>(slots.size()), vocab = manifest_.vocab_size;
    const Bucket& bucket = target_->spec().bucket("decode", {{"B", n}});
    const float* logits = grid(bucket, slots, std::vector<int64_t>(n, 0), nullptr, true).at(io::kLogits).f.data();
    ++stats_.rounds;
    for (int64_t i = 0; i < n; ++i) {
        if (!slots[i]) continue;
        Slot& s = *slots[i];
        s.length += 1;
        stats_.generated += emit(s, {next_token(logits + i * vocab, vocab, s.params, s.rng)}, events);
    }
}

// One draft/verify round over slots [0, n) (runtime/host_round.py): propose, schedule, verify (packed), accept,
// commit.
void Engine::round(std::map<int64_t, Event>& events) {
    Views views{live(), {}};
    const int64_t n = static_cast<int64_t>(views.slots.size());
    for (Slot* s : views.slots) views.ctx.push_back(s && s->ctx ? &*s->ctx : nullptr);
    auto t0 = Clock::now();
    Proposal p = drafter_->propose(views);
    const double draft_ms = seconds_since(t0) * 1e3;
    if (options_.tree > 1 && p.top && p.parents.empty()) {  // the head's alternatives beside its first drafts
        const int64_t g = p.survival.empty() ? gamma_ : std::min(gamma_, p.width);
        graft(p, scheduler_->survival(p, g), g, options_.tree);
    }
    // schedule, capped by the drafts proposed, gamma and each request's budget (the bonus is always committed)
    std::vector<int64_t> lengths = scheduler_->schedule(views, p);
    int64_t t = 1, count = 0;
    for (int64_t i = 0; i < n; ++i) {
        if (!views.slots[i]) {
            lengths[i] = 0;
            continue;
        }
        lengths[i] = cap(lengths[i], p.counts[i], views.slots[i]->budget(), gamma_);
        t = std::max(t, lengths[i] + 1);
        count += lengths[i] + 1;
    }
    // verify: [anchor, d_1..d_l] of every active slot at positions L..L+l, packed into the smallest token budget
    auto ts = Clock::now();
    const GraphSpec& spec = target_->spec();
    const Bucket& bucket = t > 1 ? spec.bucket("verify", {{"B", n}, {"T", t}, {"P", count}}) : spec.bucket("decode", {{"B", n}});
    const int64_t T = bucket.at("T"), vocab = manifest_.vocab_size;
    Tensors& out = grid(bucket, views.slots, lengths, &p, false);
    const float* logits = out.at(io::kLogits).f.data();
    auto features = out.find(io::kFeatures);
    const double call_ms = seconds_since(ts) * 1e3;
    if (costs_) {
        costs_->observe_verify(n, count, call_ms);
        if (!p.head.empty()) costs_->observe_draft(p.head, n, draft_ms);
    }
    if (!p.head.empty()) ++stats_.head_calls;
    // accept and commit, slot by slot (the logits of slot i's cells start at row `first`)
    int64_t first = 0;
    for (int64_t i = 0; i < n; ++i) {
        Slot* s = views.slots[i];
        if (!s) continue;
        const int64_t ell = lengths[i];
        const int64_t* drafts = p.tokens.data() + i * p.width;
        const float* l = logits + first * vocab;
        Path path;
        if (p.parents.empty()) {  // a chain: the prefix of drafts accepted, then the bonus
            std::vector<int64_t> chain(drafts, drafts + ell);
            int64_t bonus = 0;
            if (s->params.greedy()) {
                std::tie(path.accepted, bonus) = accept(chain, l, vocab);
            } else {
                DraftDist q = p.q;
                if (q.probs && !p.onehot.empty() && p.onehot[i]) q = DraftDist{};
                if (q.probs) q.probs += i * p.width * q.width;
                std::tie(path.accepted, bonus) = accept_sampled(chain, q, l, vocab, s->params, s->rng, gamma_);
            }
            path.tokens.assign(drafts, drafts + path.accepted);
            path.tokens.push_back(bonus);
        } else {  // a tree: the walk from the anchor (tree.h)
            const int64_t* parents = p.parents.data() + i * p.width;
            if (s->params.greedy()) {
                path = accept_tree(drafts, parents, ell, l, vocab);
            } else {
                DraftDist q = p.q;  // a grafted tree's chain nodes were drawn from q, each at its chain position
                if (q.probs && (p.chain.empty() || (!p.onehot.empty() && p.onehot[i]))) q = DraftDist{};
                if (q.probs) q.probs += i * drafter_->steps * q.width;  // q: the head's rows [n, steps, width]
                const int64_t* row = p.chain.empty() ? nullptr : p.chain.data() + i * p.width;
                path = accept_tree_sampled(drafts, parents, row, ell, q, l, vocab, s->params, s->rng, gamma_);
            }
            std::vector<int64_t> from, to;  // the accepted path's cache rows, after the anchor
            for (int64_t k = 1; k <= path.accepted; ++k) {
                from.push_back(s->length + path.cells[k]);
                to.push_back(s->length + k);
            }
            if (from != to) target_->move_rows(i, from, to);
        }
        const int64_t a = path.accepted;
        first += ell + 1;
        scheduler_->observe(ell, a);
        drafter_->observe(i, ell, a, p.parents.empty() ? nullptr : &path.cells);
        ++stats_.rounds;
        stats_.accepted += a;
        const std::vector<int64_t>& tokens = path.tokens;
        const int64_t position = s->length;
        const int64_t committed = emit(*s, tokens, events);
        stats_.generated += committed;
        if (!s->finish.empty()) {
            s->length += committed;
            continue;
        }
        s->length += a + 1;
        s->ctx.reset();
        if (!head_.empty() && features != out.end()) {  // the verified rows become the head's next context rows
            Context c{position, {}, tokens};
            const Tensor& f = features->second;
            const int64_t all = f.shape[2];
            for (int64_t k = 0; k <= a; ++k) {
                const int64_t cell = p.parents.empty() ? k : path.cells[k];
                const float* row = f.f.data() + (i * T + cell) * all + feature_offset_;
                c.features.insert(c.features.end(), row, row + feature_dim_);
            }
            s->ctx = std::move(c);
        }
    }
}

// Append tokens until the request finishes (EOS, a stop token or string, or its length); returns how many. With stop
// strings the text grows token by token and is searched where a stop string may end in the new text (the Python
// runtime's Sequence.append: the text is cut before the first one found).
int64_t Engine::emit(Slot& s, const std::vector<int64_t>& tokens, std::map<int64_t, Event>& events) {
    Event& e = events[s.id];
    e.id = s.id;
    int64_t emitted = 0;
    const bool stops = !s.params.stop_strings.empty();
    for (int64_t token : tokens) {
        s.output.push_back(token);
        s.history.push_back(token);
        s.pending = token;
        e.tokens.push_back(token);
        ++emitted;
        if (stops) {
            const std::string piece = s.stream->push(&token, 1);
            if (!piece.empty()) {
                const size_t before = s.text.size();
                s.text += piece;
                for (const std::string& stop : s.params.stop_strings) {
                    const size_t from = before + 1 > stop.size() ? before + 1 - stop.size() : 0;
                    const size_t cut = s.text.find(stop, from);
                    if (cut != std::string::npos) {
                        s.text.resize(cut);
                        s.finish = "stop";
                        break;
                    }
                }
                if (s.text.size() > before) e.text += s.text.substr(before);
            }
            if (!s.finish.empty()) break;
        }
        const auto& stop = s.params.stop_token_ids;
        if ((manifest_.eos.count(token) && !s.params.ignore_eos) || std::find(stop.begin(), stop.end(), token) != stop.end())
            s.finish = "eos";
        else if (static_cast<int64_t>(s.output.size()) >= s.params.max_new_tokens)
            s.finish = "length";
        if (!s.finish.empty()) break;
    }
    if (s.stream && !stops) e.text += s.stream->push(e.tokens.data() + e.tokens.size() - emitted, emitted);
    return emitted;
}

void Engine::retire(int64_t index, std::map<int64_t, Event>& events) {
    auto& s = slots_[index];
    if (!s || s->finish.empty()) return;
    Event& e = events[s->id];
    e.id = s->id;
    e.finish = s->finish;
    if (s->stream && s->finish != "stop") e.text += s->stream->flush();  // a stop string's tail is not text
    s.reset();
}

}  // namespace specrt
