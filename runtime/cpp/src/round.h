// The round's parts: proposals, drafters (n-gram lookups, a draft head's graph, a head with lookups) and schedulers
// (fixed, threshold, sps, sps-async), as runtime/drafters.py, runtime/hybrid.py, runtime/schedulers.py and
// runtime/steps.py define them.
#pragma once

#include "costs.h"
#include "engine.h"
#include "steps.h"

namespace specrt {

// Drafts for slots [0, n): row i holds slot i's first counts[i] drafts (idle slots: 0).
struct Proposal {
    int64_t n = 0, width = 0;  // width: drafts per row at most
    std::vector<int64_t> tokens, counts;
    std::vector<float> survival;  // [n, width] the drafts' prefix survival where the drafter reports it
    std::vector<float> confidence;  // [n, width] confidence logits (a DSpark head)
    DraftDist q;  // the distributions sampled drafts were drawn from (none: one-hot drafts)
    std::vector<char> onehot;  // rows drafted deterministically beside q (lookups in a hybrid)
    std::string head;  // the head whose graph drafted this round ("": lookups only)
    // a draft tree's parents [n, width] (tree.h: -1 the anchor, each node after its parent, a prefix a subtree; empty:
    // each row is a chain) and, for a grafted DSpark tree, each node's chain position [n, width] (-1: an alternative)
    std::vector<int64_t> parents, chain;
    // a DSpark head's likeliest first tokens [n, top] (-1: none) and their probabilities (empty: not drafted)
    std::vector<int64_t> first_top;
    std::vector<float> first_probs;
    int64_t top = 0;
};

// The slots a drafter sees this round (nullptr: idle) and, per slot, the pending context rows to write first
// (nullptr: none, always for an idle slot).
struct Views {
    std::vector<Slot*> slots;
    std::vector<const Context*> ctx;
};

class Drafter {
public:
    virtual ~Drafter() = default;
    int64_t steps = 0;
    virtual void allocate(int64_t slots) = 0;
    // A fresh slot's prompt context; returns the rows still pending for its first proposal.
    virtual std::optional<Context> prefill(int64_t slot, Context ctx) = 0;
    virtual Proposal propose(const Views& views) = 0;
    // How a slot's drafts of the last proposal fared; `path`: a tree's accepted cells (nullptr: a chain's).
    virtual void observe(int64_t /*slot*/, int64_t /*verified*/, int64_t /*accepted*/,
                         const std::vector<int64_t>* /*path*/ = nullptr) {}
};

// Per draft position, the conditional acceptance measured so far (a prior worth two tries).
class AcceptanceHistory {
public:
    explicit AcceptanceHistory(int64_t gamma, double later = 0.5);
    void observe(int64_t verified, int64_t accepted);
    std::vector<float> survival() const;  // [gamma]: P(the first k + 1 drafts are all accepted)
    std::vector<double> survival64() const;  // the same, unrounded

private:
    std::vector<double> hits_, tries_;
};

// Up to `steps` tokens after the latest earlier occurrence of the longest suffix (n <= max_n); `matched`: that n
// (0: none).
std::vector<int64_t> lookup(const std::vector<int64_t>& history, size_t max_n, size_t steps, size_t* matched = nullptr);

// Prompt lookup (runtime/drafters.py NGramDrafter): its drafts' survivals come from the acceptance measured so far
// for lookups of the same match length. With `width` > 1 a proposal is a tree: the best continuation and up to
// width - 1 others (`lookup_tree`) of up to `branch` tokens, its nodes by survival (another continuation's: its
// rank's acceptance times the chance the best one's first draft is rejected).
class NGramDrafter : public Drafter {
public:
    // `later`: the prior acceptance of the drafts after a lookup's first
    NGramDrafter(int64_t steps, int64_t max_n, double later = 0.5, int64_t width = 1, int64_t branch = 2);
    void allocate(int64_t slots) override {
        match_.assign(slots, 0);
        branch_of_.assign(slots * nodes_, 0);
    }
    std::optional<Context> prefill(int64_t, Context) override { return std::nullopt; }
    Proposal propose(const Views& views) override;
    void observe(int64_t slot, int64_t verified, int64_t accepted, const std::vector<int64_t>* path = nullptr) override;

private:
    Proposal propose_trees(const Views& views);

    int64_t max_n_, width_, branch_, nodes_;  // nodes_: drafts a proposal may hold
    std::vector<AcceptanceHistory> histories_;  // per match length (0: none)
    std::vector<AcceptanceHistory> branches_;  // a tree's other continuations, by rank
    std::vector<int64_t> match_;  // each slot's last lookup's match length
    std::vector<int64_t> branch_of_;  // [slots, nodes_]: each node's continuation (0: the best one)
};

class GraphDrafter : public Drafter {
public:
    // `top`: also report the head's likeliest first tokens (a DSpark graph's draft_first_top; for draft trees)
    GraphDrafter(const fs::path& dir, const Manifest& m, const HeadSpec& head, int threads, bool top = false);
    void allocate(int64_t slots) override { runner_.allocate(slots); }
    std::optional<Context> prefill(int64_t slot, Context ctx) override;
    Proposal propose(const Views& views) override;

    const HeadSpec& head() const { return head_; }
    int64_t max_rows() const { return max_rows_; }

private:
    void fill(Tensors& feeds, const std::vector<const Context*>& ctx, const std::vector<int64_t>& anchors,
              int64_t b);

    HeadSpec head_;
    Runner runner_;
    std::vector<int32_t> column_;  // token -> draft-vocabulary column
    int64_t max_rows_ = 1;
    bool top_ = false;
};

// Lookups and a head, per round whichever promises more (runtime/hybrid.py). Without lookups (`lookups` false) the
// same choice gates a head alone under sps / sps-async: the head is called only on rounds where its realized rate
// beats a plain decoding step's, and on explorations.
class HybridDrafter : public Drafter {
public:
    HybridDrafter(std::unique_ptr<GraphDrafter> head, CostTable& costs, int64_t max_n, bool lookups = true);
    void allocate(int64_t slots) override;
    std::optional<Context> prefill(int64_t slot, Context ctx) override;
    Proposal propose(const Views& views) override;
    void observe(int64_t slot, int64_t verified, int64_t accepted, const std::vector<int64_t>* path = nullptr) override;
    int64_t head_rounds() const { return rounds_[1]; }

private:
    // decayed sums of the head's slot rounds and the tokens they committed and verified (runtime/hybrid.py `Record`)
    struct Record {
        double rounds, committed, verified;
        void add(int64_t verified_tokens, int64_t committed_tokens, int64_t slot_rounds);
        Record prior() const;  // its means at the weight of the prior's rounds: where a new request's record starts
    };

    double head_rate(int64_t n, const std::vector<char>& active) const;
    void fold();
    std::vector<char> held(const Views& views) const;

    std::unique_ptr<GraphDrafter> head_;
    CostTable& costs_;
    NGramDrafter lookup_;  // its drafts survive as lookups of the same match length have been accepted
    AcceptanceHistory head_history_;
    std::vector<std::optional<Context>> backlog_;
    std::vector<int64_t> source_;
    std::vector<char> held_;  // per slot: left out of the last proposal's head call (an exploration's)
    int64_t rounds_[2] = {0, 0}, since_head_ = 0;
    int64_t explore_every_;  // rounds without the head before it is explored (doubles while explorations lose)
    // the head's rounds: every request's (a new request's prior) and, per slot, its request's own
    Record record_;
    std::vector<Record> records_;
    bool lookups_, last_head_ = false, explored_ = false;
    struct Row {
        int64_t slot, verified, accepted;
    };
    std::vector<Row> last_;  // the last round's rows the head drafted
};

class Scheduler {
public:
    Scheduler(int64_t gamma, std::vector<float> temperatures) : gamma(gamma), temperatures_(std::move(temperatures)), history_(gamma) {}
    virtual ~Scheduler() = default;
    const int64_t gamma;
    // Verify lengths [n] (0: a plain decode step), before the loop's cap.
    virtual std::vector<int64_t> schedule(const Views& views, const Proposal& p) = 0;
    void observe(int64_t verified, int64_t accepted) { history_.observe(verified, accepted); }
    // [n, g] (g: gamma, or fewer), zero past each row's drafts
    std::vector<float> survival(const Proposal& p, int64_t g = -1) const;

private:
    std::vector<float> temperatures_;
    AcceptanceHistory history_;
};

std::unique_ptr<Scheduler> make_scheduler(const std::string& name, int64_t gamma, std::vector<float> temperatures,
                                          double threshold, CostTable* costs);

// A head's chains with up to width - 1 of its likeliest other first tokens grafted beside each first draft
// (runtime/tree.py graft): the proposal's tokens, counts, survival (from `survival` [n, g], the chains'), parents and
// chain become the tree's, over the nodes in order of survival. An alternative's survival is the chance the first
// draft is rejected times its share of the head's probability without the first draft's.
void graft(Proposal& p, const std::vector<float>& survival, int64_t g, int64_t width);

// Algorithm 1 (steps.h) on a cost table (runtime/schedulers.py admission).
Admission admission(const std::vector<float>& a, int64_t n, int64_t g, const std::vector<char>& active, double fixed_ms,
                    CostTable& costs, bool explore);

}  // namespace specrt
