// The cost table the sps schedulers and the hybrids plan on (runtime/costs.py): the artifact's stored profile,
// refined online from the rounds the engine times (lower medians of each cell's last WINDOW observations and PRIOR
// copies of the profile's value; unseen cells scaled like the nearest observed one below, or by the overall drift;
// each cell at least the one before it in its row; observations older than FORGET dropped),
// and exploration: one pair past Algorithm 1's stopping point every EXPLORE_EVERY rounds, until a cell is seen SEEN
// times. Verify lengths never change which tokens are committed, so none of this affects exactness.
#pragma once

#include "artifact.h"

#include <deque>

namespace specrt {

class CostTable {
public:
    explicit CostTable(Profile profile) : profile_(std::move(profile)) {}

    double verify_ms(int64_t batch, int64_t tokens) const;
    double draft_ms(const std::string& head, int64_t batch) const;
    // verify_ms(batch, p) for p = 0..tokens, kept until the next observation.
    const std::vector<double>& verify_curve(int64_t batch, int64_t tokens);
    // The calls of p tokens whose cost a round may verify to learn it; empty between explorations.
    std::vector<char> exploring(int64_t batch, int64_t tokens) const;
    void explored() { since_explore_ = 0; }

    void observe_verify(int64_t batch, int64_t tokens, double ms);
    void observe_draft(const std::string& head, int64_t batch, double ms);

private:
    using Cell = std::tuple<std::string, std::string, int64_t, int64_t>;  // ("verify", "", b, p) or ("draft", head, b, 0)
    void observe(const Cell& cell, double ms);
    double profiled(const Cell& cell) const;
    void forget();
    double cell_ms(int64_t b, int64_t p) const;  // one cell of batch b's row, before the row is made monotone

    Profile profile_;
    std::map<Cell, std::deque<std::pair<int64_t, double>>> seen_;  // (observation number, ms)
    std::map<Cell, double> estimate_;
    double log_drift_ = 0.0;
    int64_t observations_ = 0, since_explore_ = 0;
    std::map<std::pair<int64_t, int64_t>, std::vector<double>> curves_;
};

}  // namespace specrt
