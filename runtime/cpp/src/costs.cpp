#include "costs.h"

#include <algorithm>
#include <cmath>

namespace specrt {

namespace {
constexpr int kPrior = 2, kWindow = 16, kSeen = 6, kExploreEvery = 8, kForget = 1024;  // runtime/costs.py

// The lower median of a cell's observations and kPrior copies of the profile's value.
double lower_median(double profiled, const std::deque<std::pair<int64_t, double>>& seen) {
    std::vector<double> values(kPrior, profiled);
    for (const auto& [_, ms] : seen) values.push_back(ms);
    std::sort(values.begin(), values.end());
    return values[(values.size() - 1) / 2];
}
}

// Each cell at least the one before it in its row: a verify of more tokens never costs less (runtime/costs.py `_row`).
double CostTable::verify_ms(int64_t batch, int64_t tokens) const {
    const int64_t b = ceil_key(profile_.verify, batch);
    const int64_t p = ceil_key(profile_.verify.at(b), tokens);
    double ms = 0.0;
    for (const auto& [q, _] : profile_.verify.at(b)) {
        if (q > p) break;
        ms = std::max(ms, cell_ms(b, q));
    }
    return ms;
}

// Cell p of batch b's row: its estimate if observed, else the profile's value scaled like the nearest observed cell
// below it, else by the drift.
double CostTable::cell_ms(int64_t b, int64_t p) const {
    const auto& row = profile_.verify.at(b);
    auto hit = estimate_.find({"verify", "", b, p});
    if (hit != estimate_.end()) return hit->second;
    for (auto it = std::make_reverse_iterator(row.find(p)); it != row.rend(); ++it) {  // nearest observed cell below
        auto below = estimate_.find({"verify", "", b, it->first});
        if (below != estimate_.end()) return row.at(p) * below->second / it->second;
    }
    return row.at(p) * std::exp(log_drift_);
}

double CostTable::draft_ms(const std::string& head, int64_t batch) const {
    auto h = profile_.draft.find(head);
    if (h == profile_.draft.end()) return 0.0;  // n-gram lookups: no graph call
    const int64_t b = ceil_key(h->second, batch);
    auto e = estimate_.find({"draft", head, b, 0});
    return e != estimate_.end() ? e->second : h->second.at(b) * std::exp(log_drift_);
}

const std::vector<double>& CostTable::verify_curve(int64_t batch, int64_t tokens) {
    auto key = std::make_pair(batch, tokens);
    auto it = curves_.find(key);
    if (it != curves_.end()) return it->second;
    const int64_t b = ceil_key(profile_.verify, batch);
    std::vector<int64_t> cells;
    std::vector<double> ms;
    for (const auto& [p, _] : profile_.verify.at(b)) {
        cells.push_back(p);
        ms.push_back(verify_ms(b, p));
    }
    std::vector<double> curve(tokens + 1);
    for (int64_t p = 0; p <= tokens; ++p) {
        size_t at = std::lower_bound(cells.begin(), cells.end(), p) - cells.begin();
        curve[p] = ms[std::min(at, cells.size() - 1)];
    }
    return curves_[key] = std::move(curve);
}

std::vector<char> CostTable::exploring(int64_t batch, int64_t tokens) const {
    if (since_explore_ < kExploreEvery) return {};
    const int64_t b = ceil_key(profile_.verify, batch);
    const auto& row = profile_.verify.at(b);
    std::vector<char> out(tokens + 1);
    for (int64_t p = 0; p <= tokens; ++p) {
        auto s = seen_.find({"verify", "", b, ceil_key(row, p)});
        out[p] = p <= row.rbegin()->first && (s == seen_.end() || static_cast<int>(s->second.size()) < kSeen);
    }
    return out;
}

void CostTable::observe_verify(int64_t batch, int64_t tokens, double ms) {
    const int64_t b = ceil_key(profile_.verify, batch);
    const int64_t p = ceil_key(profile_.verify.at(b), tokens);
    observe({"verify", "", b, p}, ms);
    ++since_explore_;
}

void CostTable::observe_draft(const std::string& head, int64_t batch, double ms) {
    auto h = profile_.draft.find(head);
    if (h == profile_.draft.end()) return;
    const int64_t b = ceil_key(h->second, batch);
    observe({"draft", head, b, 0}, ms);
}

// The stored profile's value of a cell.
double CostTable::profiled(const Cell& cell) const {
    const auto& [kind, head, b, p] = cell;
    return kind == "verify" ? profile_.verify.at(b).at(p) : profile_.draft.at(head).at(b);
}

void CostTable::observe(const Cell& cell, double ms) {
    if (!(ms > 0 && std::isfinite(ms))) return;
    const double prior = profiled(cell);
    curves_.clear();
    auto& seen = seen_[cell];
    ++observations_;
    seen.emplace_back(observations_, ms);
    if (static_cast<int>(seen.size()) > kWindow) seen.pop_front();
    estimate_[cell] = lower_median(prior, seen);
    if (prior > 0) {  // clipped: one stall moves the drift by at most log(4) / its weight
        const double ratio = std::clamp(std::log(ms / prior), -std::log(4.0), std::log(4.0));
        log_drift_ += (ratio - log_drift_) / static_cast<double>(std::min<int64_t>(observations_, 4 * kWindow));
    }
    if (observations_ % (kForget / 4) == 0) forget();
}

// Drop the observations older than kForget; a cell left with none reads as unseen (and is explored) again.
void CostTable::forget() {
    const int64_t old = observations_ - kForget;
    for (auto it = seen_.begin(); it != seen_.end();) {
        auto& [cell, seen] = *it;
        if (seen.front().first > old) {  // nothing to drop: its estimate stands
            ++it;
            continue;
        }
        while (!seen.empty() && seen.front().first <= old) seen.pop_front();
        if (seen.empty()) {
            estimate_.erase(cell);
            it = seen_.erase(it);
            continue;
        }
        estimate_[cell] = lower_median(profiled(cell), seen);
        ++it;
    }
    curves_.clear();
}

}  // namespace specrt
