#include "round.h"
#include "io_names.h"
#include "tree.h"

#include <algorithm>
#include <cmath>
#include <numeric>

namespace specrt {

namespace {

constexpr int LOOKUP = 0, HEAD = 1;  // runtime/hybrid.py
constexpr double kLookupLater = 0.8, kDecay = 0.95, kPriorRounds = 4.0, kPriorTokens = 1.5;
constexpr int64_t kExplore = 32, kExploreMax = 256;

// [n, g]: the first g columns of rows of width w.
std::vector<float> columns(const std::vector<float>& x, int64_t n, int64_t w, int64_t g) {
    std::vector<float> out(n * g);
    for (int64_t i = 0; i < n; ++i) std::copy_n(x.begin() + i * w, g, out.begin() + i * g);
    return out;
}

std::vector<float> broadcast(const std::vector<float>& row, int64_t n, int64_t g) {
    std::vector<float> out(n * g);
    for (int64_t i = 0; i < n; ++i) std::copy_n(row.begin(), g, out.begin() + i * g);
    return out;
}

// Prefix survival of a proposal's drafts [n, g]: the graph's own, else its confidence logits calibrated by
// `temperatures` (float32, as specrt::ConfidenceTruncate), else the run's per-position acceptance.
std::vector<float> prefix_survival(const Proposal& p, const std::vector<float>& temperatures,
                                   const AcceptanceHistory& history, int64_t g) {
    if (!p.survival.empty()) return columns(p.survival, p.n, p.width, g);
    if (!p.confidence.empty() && static_cast<int64_t>(temperatures.size()) >= g) {
        std::vector<float> out(p.n * g);
        for (int64_t i = 0; i < p.n; ++i) {
            float prod = 1.0f;
            for (int64_t k = 0; k < g; ++k) {
                const float z = p.confidence[i * p.width + k] / temperatures[k];
                out[i * g + k] = prod *= 1.0f / (1.0f + std::exp(-z));
            }
        }
        return out;
    }
    return broadcast(history.survival(), p.n, g);
}

std::optional<Context> merge(std::optional<Context> first, const Context* then) {
    if (!then) return first;
    if (!first) return *then;
    first->features.insert(first->features.end(), then->features.begin(), then->features.end());
    first->next_tokens.insert(first->next_tokens.end(), then->next_tokens.begin(), then->next_tokens.end());
    return first;
}

}  // namespace

// -- acceptance history ---------------------------------------------------------------------------------------------

AcceptanceHistory::AcceptanceHistory(int64_t gamma, double later) : hits_(gamma, 2.0 * later), tries_(gamma, 2.0) {
    if (gamma > 0) hits_[0] = 1.0;
}

void AcceptanceHistory::observe(int64_t verified, int64_t accepted) {
    const int64_t reached = std::min({verified, accepted + 1, static_cast<int64_t>(tries_.size())});
    for (int64_t k = 0; k < reached; ++k) {  // positions tried with all earlier ones accepted
        tries_[k] += 1;
        if (k < accepted) hits_[k] += 1;
    }
}

std::vector<float> AcceptanceHistory::survival() const {
    const std::vector<double> a = survival64();
    return std::vector<float>(a.begin(), a.end());
}

std::vector<double> AcceptanceHistory::survival64() const {
    std::vector<double> out(hits_.size());
    double prod = 1.0;
    for (size_t k = 0; k < hits_.size(); ++k) out[k] = prod *= hits_[k] / tries_[k];
    return out;
}

// -- n-gram lookups -------------------------------------------------------------------------------------------------

std::vector<int64_t> lookup(const std::vector<int64_t>& history, size_t max_n, size_t steps, size_t* matched) {
    const size_t size = history.size();
    if (matched) *matched = 0;
    for (size_t n = std::min(max_n, size - 1); n >= 1; --n) {
        // windows start at 0..size-1-n: strictly before the suffix itself, each followed by >= 1 token
        for (size_t start = size - n; start-- > 0;) {
            if (std::equal(history.end() - n, history.end(), history.begin() + start)) {
                size_t from = start + n, to = std::min(size, from + steps);
                if (matched) *matched = n;
                return std::vector<int64_t>(history.begin() + from, history.begin() + to);
            }
        }
    }
    return {};
}

NGramDrafter::NGramDrafter(int64_t steps, int64_t max_n, double later, int64_t width, int64_t branch)
    : max_n_(max_n), width_(width), branch_(std::min(branch, steps)) {
    if (steps < 1 || max_n < 1 || width < 1 || branch < 1)
        throw Error(SPECRT_ERROR_REQUEST, "n-gram drafting needs gamma >= 1, n >= 1 and a tree width >= 1");
    this->steps = steps;
    nodes_ = steps + (width - 1) * branch_;
    histories_.assign(max_n + 1, AcceptanceHistory(steps, later));
    branches_.assign(width - 1, AcceptanceHistory(branch_, later));
}

// A proposal of n rows without drafts (a gated head not called, lookups that found nothing).
static Proposal nothing(int64_t n, int64_t width) {
    Proposal p;
    p.n = n;
    p.width = width;
    p.tokens.assign(n * width, 0);
    p.counts.assign(n, 0);
    return p;
}

Proposal NGramDrafter::propose(const Views& views) {
    if (width_ > 1) return propose_trees(views);
    Proposal p = nothing(static_cast<int64_t>(views.slots.size()), steps);
    p.survival.assign(p.n * steps, 0.0f);
    if (static_cast<int64_t>(match_.size()) < p.n) match_.resize(p.n, 0);
    for (int64_t i = 0; i < p.n; ++i) {
        match_[i] = 0;
        if (!views.slots[i]) continue;
        size_t matched = 0;
        std::vector<int64_t> follow =
            lookup(views.slots[i]->history, static_cast<size_t>(max_n_), static_cast<size_t>(steps), &matched);
        match_[i] = static_cast<int64_t>(matched);
        p.counts[i] = static_cast<int64_t>(follow.size());
        std::copy(follow.begin(), follow.end(), p.tokens.begin() + i * steps);
        if (!follow.empty()) {
            const std::vector<float> a = histories_[matched].survival();
            std::copy(a.begin(), a.end(), p.survival.begin() + i * steps);
        }
    }
    return p;
}

Proposal NGramDrafter::propose_trees(const Views& views) {
    const int64_t n = static_cast<int64_t>(views.slots.size()), w = nodes_;
    Proposal p = nothing(n, w);
    p.survival.assign(n * w, 0.0f);
    p.parents.resize(n * w);
    for (int64_t i = 0; i < n; ++i)
        for (int64_t j = 0; j < w; ++j) p.parents[i * w + j] = j - 1;
    if (static_cast<int64_t>(match_.size()) < n) allocate(n);
    for (int64_t i = 0; i < n; ++i) {
        match_[i] = 0;
        if (!views.slots[i]) continue;
        int64_t matched = 0;
        const auto follows = lookup_tree(views.slots[i]->history, max_n_, steps, width_, branch_, &matched);
        match_[i] = matched;
        if (follows.empty()) continue;
        const std::vector<double> best = histories_[matched].survival64();
        std::vector<double> survival;  // per node, continuations in rank order, each in depth order
        std::vector<int64_t> rank, parent, token;
        for (size_t r = 0; r < follows.size(); ++r) {
            const std::vector<double> other = r ? branches_[r - 1].survival64() : std::vector<double>{};
            const int64_t first = static_cast<int64_t>(token.size());
            for (size_t d = 0; d < follows[r].size(); ++d) {
                survival.push_back(r ? (1.0 - best[0]) * other[d] : best[d]);
                rank.push_back(static_cast<int64_t>(r));
                parent.push_back(d ? first + static_cast<int64_t>(d) - 1 : -1);
                token.push_back(follows[r][d]);
            }
        }
        const auto [order, up] = by_survival(survival, parent);
        const int64_t k = static_cast<int64_t>(order.size());
        for (int64_t j = 0; j < k; ++j) {
            p.tokens[i * w + j] = token[order[j]];
            p.survival[i * w + j] = static_cast<float>(survival[order[j]]);
            branch_of_[i * w + j] = rank[order[j]];
            p.parents[i * w + j] = up[j];
        }
        p.counts[i] = k;
    }
    return p;
}

// A round's outcome for `slot`: the acceptance of lookups of its match length (a tree's: of each continuation it
// verified; `path`, the accepted cells, says which one they followed).
void NGramDrafter::observe(int64_t slot, int64_t verified, int64_t accepted, const std::vector<int64_t>* path) {
    if (width_ == 1 || verified == 0) {
        histories_[match_[slot]].observe(verified, accepted);
        return;
    }
    const int64_t* admitted = branch_of_.data() + slot * nodes_;
    const int64_t first = path && path->size() > 1 ? (*path)[1] - 1 : 0;
    const int64_t taken = accepted ? admitted[first] : -1;
    auto tried = [&](int64_t r) { return static_cast<int64_t>(std::count(admitted, admitted + verified, r)); };
    histories_[match_[slot]].observe(tried(0), taken == 0 ? accepted : 0);
    if (taken != 0)  // the best continuation's first draft was rejected: the others were tried
        for (int64_t r = 1; r < width_; ++r) branches_[r - 1].observe(tried(r), taken == r ? accepted : 0);
}

// -- a draft head's graph -------------------------------------------------------------------------------------------

GraphDrafter::GraphDrafter(const fs::path& dir, const Manifest& m, const HeadSpec& head, int threads, bool top)
    : head_(head), runner_(ort_env(threads), dir, m.graphs.at(head.name), threads, /*spin=*/false), top_(top) {
    steps = head.steps;
    if (head.kind != "dspark" && head.kind != "mtp")
        throw Error(SPECRT_ERROR_ARTIFACT, "head " + head.name + " is of kind " + head.kind + " (this runtime runs dspark and mtp)");
    for (const Bucket& b : runner_.spec().buckets.count("propose") ? runner_.spec().buckets.at("propose") : std::vector<Bucket>{})
        max_rows_ = std::max(max_rows_, b.at("C"));
    if (!head.vocab_ids.empty()) {
        column_.assign(m.vocab_size, -1);
        for (size_t j = 0; j < head.vocab_ids.size(); ++j) {
            const int64_t t = head.vocab_ids[j];
            if (t < 0 || t >= m.vocab_size) throw Error(SPECRT_ERROR_ARTIFACT, "head " + head.name + ": draft vocabulary id out of range");
            column_[t] = static_cast<int32_t>(j);
        }
    }
}

// A propose (or prefill) call over b slots: context rows `ctx` (nullptr: none), anchors (runtime/calls/dspark.py,
// runtime/calls/mtp.py); the sampling inputs and ConfidenceTruncate's settings are the caller's.
void GraphDrafter::fill(Tensors& feeds, const std::vector<const Context*>& ctx, const std::vector<int64_t>& anchors,
                        int64_t b) {
    const bool dspark = head_.kind == "dspark";
    Tensor& features = feeds.at(dspark ? io::kCtxFeatures : io::kMtpHidden);
    const int64_t c = features.shape[1], w = head_.feature_dim;
    std::fill(features.f.begin(), features.f.end(), 0.0f);
    int64_t* positions = feeds.at(dspark ? io::kCtxPositions : io::kMtpPositions).i64();
    int64_t* tokens = dspark ? nullptr : feeds.at(io::kMtpTokens).i64();
    if (tokens) std::fill_n(tokens, b * c, 0);
    for (int64_t i = 0; i < b; ++i) {
        const Context* x = i < static_cast<int64_t>(ctx.size()) ? ctx[i] : nullptr;
        const int64_t start = x ? x->pos : 0, rows = x ? x->rows() : 0;
        if (rows > c) throw Error(SPECRT_ERROR_RUNTIME, head_.name + ": " + std::to_string(rows) + " context rows in a call of " + std::to_string(c));
        if (x) std::copy(x->features.begin(), x->features.end(), features.f.begin() + i * c * w);
        for (int64_t k = 0; k < c; ++k) positions[i * c + k] = start + k;
        if (dspark) {
            feeds.at(io::kCtxWriteIndex).i[i] = start;
            feeds.at(io::kCtxLen).i[i] = start + rows;
            feeds.at(io::kAnchorIds).i[i] = anchors[i];
        } else {
            if (x) std::copy(x->next_tokens.begin(), x->next_tokens.end(), tokens + i * c);
            feeds.at(io::kMtpLastRow).i[i] = std::max<int64_t>(rows - 1, 0);
        }
    }
}

namespace {
// Sampling inputs (temperature 0: argmax drafts) and ConfidenceTruncate's threshold 0 and budget -1 (report survival,
// cut nothing: the host's scheduler cuts).
void settings(Tensors& feeds) {
    std::fill(feeds.at(io::kTemperature).f.begin(), feeds.at(io::kTemperature).f.end(), 0.0f);
    std::fill(feeds.at(io::kNoise).f.begin(), feeds.at(io::kNoise).f.end(), 0.0f);
    auto budget = feeds.find(io::kTruncateBudget);
    if (budget != feeds.end()) {
        feeds.at(io::kTruncateThreshold).f[0] = 0.0f;
        budget->second.i[0] = -1;
    }
}
}  // namespace

std::optional<Context> GraphDrafter::prefill(int64_t slot, Context ctx) {
    const int64_t r = ctx.rows(), w = head_.feature_dim;
    const Bucket& bucket = runner_.spec().bucket("prefill");
    const int64_t c = bucket.at("C");
    for (int64_t start = 0; start < r - 1; start += c) {
        const int64_t stop = std::min(start + c, r - 1);
        Context piece{ctx.pos + start, std::vector<float>(ctx.features.begin() + start * w, ctx.features.begin() + stop * w),
                      std::vector<int64_t>(ctx.next_tokens.begin() + start, ctx.next_tokens.begin() + stop)};
        Tensors& feeds = runner_.inputs(slot, bucket, true);  // only the cache writes matter
        settings(feeds);
        fill(feeds, {&piece}, {0}, 1);
        runner_.run(slot, bucket, true);
    }
    return Context{ctx.pos + r - 1, std::vector<float>(ctx.features.end() - w, ctx.features.end()),
                   std::vector<int64_t>(ctx.next_tokens.end() - 1, ctx.next_tokens.end())};
}

Proposal GraphDrafter::propose(const Views& views) {
    const int64_t n = static_cast<int64_t>(views.slots.size());
    int64_t rows = 1;
    bool greedy = true;
    for (int64_t i = 0; i < n; ++i) {
        if (!views.slots[i]) continue;
        if (views.ctx[i]) rows = std::max(rows, views.ctx[i]->rows());
        greedy = greedy && views.slots[i]->params.greedy();
    }
    const Bucket& bucket = runner_.spec().bucket("propose", {{"B", n}, {"C", rows}});
    const int64_t b = bucket.at("B");
    Tensors& feeds = runner_.inputs(0, bucket, greedy);
    settings(feeds);
    std::vector<int64_t> anchors(b, 0);
    for (int64_t i = 0; i < n; ++i) {
        Slot* s = views.slots[i];
        if (!s) continue;
        anchors[i] = s->pending;
        if (!s->params.greedy()) {
            feeds.at(io::kTemperature).f[i] = static_cast<float>(s->params.temperature);
            for (int64_t k = 0; k < steps; ++k) feeds.at(io::kNoise).f[i * steps + k] = static_cast<float>(s->rng.uniform());
        }
    }
    fill(feeds, views.ctx, anchors, b);  // bucket padding past views: no rows
    Tensors& out = runner_.run(0, bucket, greedy);
    Proposal p;
    p.n = n;
    p.width = steps;
    p.head = head_.name;
    const auto& drafts = out.at(io::kDraftTokens).i;
    p.tokens.assign(drafts.begin(), drafts.begin() + n * steps);
    p.counts.assign(n, 0);
    for (int64_t i = 0; i < n; ++i) p.counts[i] = views.slots[i] ? steps : 0;
    if (auto s = out.find(io::kSurvival); s != out.end()) p.survival.assign(s->second.f.begin(), s->second.f.begin() + n * steps);
    if (auto c = out.find(io::kConfidenceLogits); c != out.end())
        p.confidence.assign(c->second.f.begin(), c->second.f.begin() + n * steps);
    if (auto t = out.find(io::kDraftFirstTop); top_ && t != out.end()) {
        p.top = t->second.shape[1];
        p.first_top.assign(t->second.i.begin(), t->second.i.begin() + n * p.top);
        const auto& probs = out.at(io::kDraftFirstProbs).f;
        p.first_probs.assign(probs.begin(), probs.begin() + n * p.top);
    }
    if (auto q = out.find(io::kDraftProbs); q != out.end() && !greedy) {
        p.q.probs = q->second.f.data();
        p.q.width = q->second.shape[2];
        p.q.vocab_ids = &head_.vocab_ids;
        p.q.column = &column_;
    }
    return p;
}

// -- a head with lookups --------------------------------------------------------------------------------------------

HybridDrafter::HybridDrafter(std::unique_ptr<GraphDrafter> head, CostTable& costs, int64_t max_n, bool lookups)
    : head_(std::move(head)), costs_(costs), lookup_(head_->steps, max_n, kLookupLater), head_history_(head_->steps),
      explore_every_(kExplore), record_{kPriorRounds, kPriorRounds * kPriorTokens, kPriorRounds * 2},
      lookups_(lookups) {
    steps = head_->steps;
}

void HybridDrafter::allocate(int64_t slots) {
    head_->allocate(slots);
    lookup_.allocate(slots);
    backlog_.assign(slots, std::nullopt);
    source_.assign(slots, LOOKUP);
    held_.assign(slots, 0);
    records_.assign(slots, record_.prior());
}

std::optional<Context> HybridDrafter::prefill(int64_t slot, Context ctx) {
    records_[slot] = record_.prior();  // a new request: priced on its own rounds from here on
    backlog_[slot].reset();
    return head_->prefill(slot, std::move(ctx));
}

void HybridDrafter::observe(int64_t slot, int64_t verified, int64_t accepted, const std::vector<int64_t>*) {
    if (source_[slot] == LOOKUP)
        lookup_.observe(slot, verified, accepted);  // into its match length's history
    else
        head_history_.observe(verified, accepted);
    if (source_[slot] == HEAD) last_.push_back({slot, verified, accepted});  // the rows it drafted are its record
}

void HybridDrafter::Record::add(int64_t verified_tokens, int64_t committed_tokens, int64_t slot_rounds) {
    rounds = kDecay * rounds + static_cast<double>(slot_rounds);
    committed = kDecay * committed + static_cast<double>(committed_tokens);
    verified = kDecay * verified + static_cast<double>(verified_tokens);
}

HybridDrafter::Record HybridDrafter::Record::prior() const {
    return {kPriorRounds, kPriorRounds * committed / rounds, kPriorRounds * verified / rounds};
}

// Committed tokens per ms a head round for n slots promises to the requests in the active slots: the tokens each
// committed and verified per head round lately (its record: runtime/hybrid.py), at this round's costs.
double HybridDrafter::head_rate(int64_t n, const std::vector<char>& active) const {
    double committed = 0.0, verified = 0.0;
    bool any = false;
    for (int64_t i = 0; i < n; ++i) {
        if (!active[i]) continue;
        any = true;
        committed += records_[i].committed / records_[i].rounds;
        verified += records_[i].verified / records_[i].rounds;
    }
    if (!any) return 0.0;
    const int64_t lo = static_cast<int64_t>(verified);  // the verify cost between its whole token counts
    double verify = lo > 0 ? costs_.verify_ms(n, lo) : 0.0;
    if (verified > lo) verify += (verified - lo) * (costs_.verify_ms(n, lo + 1) - verify);
    return committed / (costs_.draft_ms(head_->head().name, n) + verify);
}

// The last round, if it called the head, added to the records of the requests it drafted for and of all.
void HybridDrafter::fold() {
    if (last_head_ && !last_.empty()) {
        int64_t verified = 0, committed = 0;
        for (const Row& r : last_) {
            records_[r.slot].add(r.verified + 1, r.accepted + 1, 1);
            verified += r.verified + 1;
            committed += r.accepted + 1;
        }
        record_.add(verified, committed, static_cast<int64_t>(last_.size()));
    }
    last_.clear();
}

// The slots an exploration leaves out: all active slots but the one with the fewest pending rows (runtime/hybrid.py
// `_held`), or but those with none.
std::vector<char> HybridDrafter::held(const Views& views) const {
    const int64_t n = static_cast<int64_t>(views.slots.size());
    std::vector<char> out(n, 0);
    int64_t fewest = -1, fewest_rows = 0;
    bool none_pending = false;
    for (int64_t i = 0; i < n; ++i) {
        if (!views.slots[i]) continue;
        const int64_t rows = (backlog_[i] ? backlog_[i]->rows() : 0) + (views.ctx[i] ? views.ctx[i]->rows() : 0);
        out[i] = rows > 0;
        none_pending = none_pending || rows == 0;
        if (rows > 0 && (fewest < 0 || rows < fewest_rows)) fewest = i, fewest_rows = rows;
    }
    if (!none_pending && fewest >= 0) out[fewest] = 0;
    return out;
}

Proposal HybridDrafter::propose(const Views& views) {
    fold();
    const int64_t n = static_cast<int64_t>(views.slots.size());
    std::fill_n(held_.begin(), n, 0);
    std::vector<char> active(n);
    for (int64_t i = 0; i < n; ++i) active[i] = views.slots[i] != nullptr;
    Proposal found = lookups_ ? lookup_.propose(views) : nothing(n, steps);
    std::vector<float> a_lookup = lookups_ ? std::move(found.survival) : std::vector<float>(n * steps, 0.0f);
    survive(a_lookup, steps, found.counts);
    const double without = admission(a_lookup, n, steps, active, 0.0, costs_, false).rate;
    const bool wins = without < head_rate(n, active);
    if (wins)  // back off while explorations do not win the head back
        explore_every_ = kExplore;
    else if (explored_)
        explore_every_ = std::min(2 * explore_every_, kExploreMax);
    const bool head = wins || since_head_ >= explore_every_;
    explored_ = head && !wins;
    last_head_ = head;
    ++rounds_[head ? HEAD : LOOKUP];
    since_head_ = head ? 0 : since_head_ + 1;
    if (!head) {
        for (int64_t i = 0; i < n; ++i)
            if (views.slots[i]) backlog_[i] = merge(std::move(backlog_[i]), views.ctx[i]);
        std::fill_n(source_.begin(), n, LOOKUP);
        found.survival = std::move(a_lookup);
        return found;
    }
    if (explored_) {
        const std::vector<char> h = held(views);
        std::copy(h.begin(), h.end(), held_.begin());
    }
    std::vector<std::optional<Context>> caught(n);  // each slot's backlog and this round's rows as one context
    Views with{views.slots, std::vector<const Context*>(n, nullptr)};
    for (int64_t i = 0; i < n; ++i) {
        if (!views.slots[i]) continue;
        if (held_[i]) {  // its rows wait in the backlog; the call writes only past what the head reads for it
            backlog_[i] = merge(std::move(backlog_[i]), views.ctx[i]);
            caught[i] = Context{backlog_[i]->pos, {}, {}};
            with.slots[i] = nullptr;  // no drafts, no rng drawn: an idle row at the backlog's first position
            with.ctx[i] = &*caught[i];
            continue;
        }
        caught[i] = merge(std::move(backlog_[i]), views.ctx[i]);
        backlog_[i].reset();
        if (caught[i] && caught[i]->rows() > head_->max_rows()) caught[i] = head_->prefill(i, std::move(*caught[i]));
        with.ctx[i] = caught[i] ? &*caught[i] : nullptr;
    }
    Proposal p = head_->propose(with);
    std::vector<float> a_head = prefix_survival(p, head_->head().temperatures, head_history_, steps);
    p.onehot.assign(n, 0);
    std::vector<float> survival(n * steps);
    for (int64_t i = 0; i < n; ++i) {
        float sum_lookup = 0.0f, sum_head = 0.0f;  // per slot: whichever block's survivals sum higher
        for (int64_t k = 0; k < steps; ++k) {
            sum_lookup += a_lookup[i * steps + k];
            sum_head += a_head[i * steps + k];
        }
        const bool use = (sum_lookup > sum_head && found.counts[i] > 0) || held_[i];  // held: its lookup or nothing
        source_[i] = use ? LOOKUP : HEAD;
        p.onehot[i] = use;
        const auto& from = use ? a_lookup : a_head;
        std::copy_n(from.begin() + i * steps, steps, survival.begin() + i * steps);
        if (use) {
            std::copy_n(found.tokens.begin() + i * steps, steps, p.tokens.begin() + i * steps);
            p.counts[i] = found.counts[i];
            if (p.top) std::fill_n(p.first_top.begin() + i * p.top, p.top, -1);  // a lookup row: no alternatives
        }
    }
    p.survival = std::move(survival);
    return p;
}

// -- schedulers -----------------------------------------------------------------------------------------------------

std::vector<float> Scheduler::survival(const Proposal& p, int64_t g) const {
    if (g < 0) g = gamma;
    std::vector<float> a = prefix_survival(p, temperatures_, history_, g);
    survive(a, g, p.counts);
    return a;
}

void graft(Proposal& p, const std::vector<float>& survival, int64_t g, int64_t width) {
    const int64_t n = p.n, k = p.width, m = k + width - 1, top = p.top;
    std::vector<int64_t> tokens(n * m, 0), parents(n * m), chain(n * m, -1);
    std::vector<float> surv(n * m, 0.0f);
    for (int64_t i = 0; i < n; ++i)
        for (int64_t j = 0; j < m; ++j) parents[i * m + j] = j - 1;
    for (int64_t i = 0; i < n; ++i) {
        const int64_t c = p.counts[i];
        if (c == 0) continue;
        std::vector<double> s(k, 0.0);
        for (int64_t j = 0; j < std::min(c, g); ++j) s[j] = survival[i * g + j];
        std::vector<double> node_s;  // per node: survival, chain position (-1: an alternative), token
        std::vector<int64_t> node_c, node_t, parent;
        for (int64_t j = 0; j < c; ++j) {
            node_s.push_back(s[j]);
            node_c.push_back(j);
            node_t.push_back(p.tokens[i * k + j]);
            parent.push_back(j - 1);
        }
        const int64_t first = p.tokens[i * k];
        const int64_t* ids = p.first_top.data() + i * top;
        const float* probs = p.first_probs.data() + i * top;
        double p_first = 0.0;
        for (int64_t a = 0; a < top; ++a)
            if (ids[a] == first) {
                p_first = probs[a];
                break;
            }
        int64_t alts = 0;
        for (int64_t a = 0; a < top && alts < width - 1; ++a) {
            if (ids[a] < 0 || ids[a] == first) continue;
            node_s.push_back((1.0 - s[0]) * static_cast<double>(probs[a]) / std::max(1.0 - p_first, 1e-9));
            node_c.push_back(-1);
            node_t.push_back(ids[a]);
            parent.push_back(-1);
            ++alts;
        }
        const auto [order, up] = by_survival(node_s, parent);
        const int64_t mi = static_cast<int64_t>(order.size());
        for (int64_t j = 0; j < mi; ++j) {
            tokens[i * m + j] = node_t[order[j]];
            chain[i * m + j] = node_c[order[j]];
            surv[i * m + j] = static_cast<float>(node_s[order[j]]);
            parents[i * m + j] = up[j];
        }
        p.counts[i] = mi;
    }
    p.width = m;
    p.tokens = std::move(tokens);
    p.parents = std::move(parents);
    p.chain = std::move(chain);
    p.survival = std::move(surv);
    p.confidence.clear();
}

Admission admission(const std::vector<float>& a, int64_t n, int64_t g, const std::vector<char>& active, double fixed_ms,
                    CostTable& costs, bool explore) {
    const int64_t tokens = n * (g + 1);
    std::vector<char> cells = explore ? costs.exploring(n, tokens) : std::vector<char>{};
    Admission out = admission(a, n, g, active, fixed_ms, costs.verify_curve(n, tokens), cells);
    if (out.explored) costs.explored();
    return out;
}

namespace {

class Fixed : public Scheduler {
public:
    using Scheduler::Scheduler;
    std::vector<int64_t> schedule(const Views&, const Proposal& p) override {
        std::vector<int64_t> out(p.n);
        for (int64_t i = 0; i < p.n; ++i) out[i] = std::min(p.counts[i], gamma);
        return out;
    }
};

class Threshold : public Scheduler {
public:
    Threshold(int64_t gamma, std::vector<float> t, double cut) : Scheduler(gamma, std::move(t)), cut_(static_cast<float>(cut)) {}
    std::vector<int64_t> schedule(const Views&, const Proposal& p) override {
        return threshold(survival(p), p.n, gamma, cut_);
    }

private:
    float cut_;
};

class SPS : public Scheduler {
public:
    SPS(int64_t gamma, std::vector<float> t, CostTable& costs) : Scheduler(gamma, std::move(t)), costs_(costs) {}
    std::vector<int64_t> schedule(const Views& views, const Proposal& p) override {
        return admission(survival(p), p.n, gamma, active(views), costs_.draft_ms(p.head, p.n), costs_, true).lengths;
    }

protected:
    static std::vector<char> active(const Views& views) {
        std::vector<char> out(views.slots.size());
        for (size_t i = 0; i < out.size(); ++i) out[i] = views.slots[i] != nullptr;
        return out;
    }
    CostTable& costs_;
};

// §5.2: this round admits as many drafts as Algorithm 1 chose on the previous round's survivals; the current
// survivals choose which (the best pairs over the batch, ties by the lower flat index).
class AsyncSPS : public SPS {
public:
    using SPS::SPS;
    std::vector<int64_t> schedule(const Views& views, const Proposal& p) override {
        std::vector<char> on = active(views);
        std::vector<float> a = survival(p);
        std::vector<int64_t> plan = admission(a, p.n, gamma, on, costs_.draft_ms(p.head, p.n), costs_, true).lengths;
        const int64_t planned = std::accumulate(plan.begin(), plan.end(), int64_t{0});
        const int64_t budget = planned_ >= 0 ? planned_ : planned;
        planned_ = planned;  // the next round's capacity
        return admit(a, p.n, gamma, on, budget);
    }

private:
    int64_t planned_ = -1;
};

}  // namespace

std::unique_ptr<Scheduler> make_scheduler(const std::string& name, int64_t gamma, std::vector<float> temperatures,
                                          double threshold, CostTable* costs) {
    if (name == "fixed") return std::make_unique<Fixed>(gamma, std::move(temperatures));
    if (name == "threshold") {
        if (!(threshold >= 0.0 && threshold <= 1.0))
            throw Error(SPECRT_ERROR_REQUEST, "threshold must be a probability in [0, 1], got " + std::to_string(threshold));
        return std::make_unique<Threshold>(gamma, std::move(temperatures), threshold);
    }
    if (name == "sps" || name == "sps-async") {
        if (!costs) throw Error(SPECRT_ERROR_REQUEST, "scheduler " + name + " needs a cost profile (run `specrt profile ART`)");
        if (name == "sps") return std::make_unique<SPS>(gamma, std::move(temperatures), *costs);
        return std::make_unique<AsyncSPS>(gamma, std::move(temperatures), *costs);
    }
    throw Error(SPECRT_ERROR_REQUEST, "unknown scheduler '" + name + "'; choose one of fixed, threshold, sps, sps-async");
}

}  // namespace specrt
