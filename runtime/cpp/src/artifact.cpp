#include "artifact.h"
#include "io_names.h"
#include "rules.h"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <fstream>

namespace specrt {

using json = nlohmann::json;

namespace {

constexpr int kProfileVersion = 2;  // runtime/profile.py VERSION
const std::set<std::string> kGreedyDrops(std::begin(rules::kGreedyDrops), std::end(rules::kGreedyDrops));

std::string clip(std::string s, size_t n = 160) {  // a message quotes at most n characters of what it was given
    s = s.substr(0, s.find('\n'));
    return s.size() > n ? s.substr(0, n) + "...(" + std::to_string(s.size()) + " characters)" : s;
}

// A JSON library error in specrt's words: nlohmann's "[json.exception.type_error.302] " prefix dropped, clipped.
std::string json_error(const json::exception& e) {
    std::string s = e.what();
    if (s.rfind("[json.exception.", 0) == 0 && s.find("] ") != std::string::npos) s = s.substr(s.find("] ") + 2);
    return clip(s);
}

std::string size_text(uintmax_t n) {
    const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
    double x = static_cast<double>(n);
    int u = 0;
    while (x >= 1024 && u < 4) x /= 1024, ++u;
    char buf[32];
    std::snprintf(buf, sizeof buf, u ? "%.1f %s" : "%.0f %s", x, units[u]);
    return buf;
}

// `path`, refused unless it is a regular file (a FIFO or a device would block or flood its reader) and, for the JSON
// files the runtime reads, at most rules::kMaxJsonBytes (specrt/artifact.py regular_file)
const fs::path& regular_file(const fs::path& path, const std::string& what) {
    std::error_code ec;
    if (!fs::is_regular_file(path, ec))
        throw Error(SPECRT_ERROR_ARTIFACT, path.string() + ": the " + what + " is not a regular file; refusing it");
    const uintmax_t size = fs::file_size(path, ec);
    if (path.extension() == ".json" && !ec && size > static_cast<uintmax_t>(rules::kMaxJsonBytes))
        throw Error(SPECRT_ERROR_ARTIFACT, path.string() + ": the " + what + " is " + size_text(size) + ", more than the " +
                                               size_text(rules::kMaxJsonBytes) +
                                               " a specrt artifact's JSON files may be; refusing it");
    return path;
}

json read_json(const fs::path& path, const std::string& what) {
    std::ifstream f(regular_file(path, what));
    if (!f) throw Error(SPECRT_ERROR_ARTIFACT, "cannot read " + path.string());
    try {
        return json::parse(f);
    } catch (const json::exception& e) {
        throw Error(SPECRT_ERROR_ARTIFACT, path.string() + " is malformed: not valid JSON (" + json_error(e) + ")");
    }
}

// Each integer of rules::kIntLimits present in the manifest is an integer within its bounds (artifact.py check_limits).
void check_limits(const json& j) {
    for (const rules::IntLimit& limit : rules::kIntLimits) {
        std::vector<std::pair<std::string, const json*>> found{{"", &j}};
        const std::string path = limit.path;
        for (size_t start = 0; start <= path.size();) {
            const size_t dot = std::min(path.find('.', start), path.size());
            const std::string key = path.substr(start, dot - start);
            std::vector<std::pair<std::string, const json*>> next;
            for (const auto& [where, obj] : found) {
                if (!obj->is_object()) continue;
                for (auto it = obj->begin(); it != obj->end(); ++it)
                    if (key == "*" || it.key() == key) next.emplace_back(where.empty() ? it.key() : where + "." + it.key(), &*it);
            }
            found = std::move(next);
            start = dot + 1;
        }
        for (const auto& [where, v] : found) {
            bool ok = false;
            if (v->is_number_unsigned()) {
                const uint64_t x = v->get<uint64_t>();
                ok = x <= static_cast<uint64_t>(limit.hi) && static_cast<int64_t>(x) >= limit.lo;
            } else if (v->is_number_integer()) {
                const int64_t x = v->get<int64_t>();
                ok = x >= limit.lo && x <= limit.hi;
            }
            if (!ok)
                throw Error(SPECRT_ERROR_ARTIFACT, where + " must be an integer in " + std::to_string(limit.lo) + ".." +
                                                       std::to_string(limit.hi) + ", got " + clip(v->dump(), 40));
        }
    }
}

// Slot-count buckets, verify budgets, each family's buckets: what the export settings give (specrt/artifact.py
// batch_sizes, token_budgets, target_buckets, head_buckets), which the manifest's must be.
std::vector<int64_t> batch_sizes(int64_t batch) {
    std::vector<int64_t> out;
    for (int64_t b = 1; b < batch; b *= 2) out.push_back(b);
    out.push_back(batch);
    return out;
}

std::vector<int64_t> token_budgets(int64_t slots, int64_t tokens) {
    const int64_t grid = slots * tokens;
    if (slots == 1) return {grid};
    std::set<int64_t> out{grid};
    for (int64_t p = 1; p < grid; p *= 2)
        if (p >= slots) out.insert(p);
    return {out.begin(), out.end()};
}

std::map<std::string, std::vector<Bucket>> export_buckets(const std::string& family, int64_t batch, int64_t chunk,
                                                          int64_t verify_len) {
    std::map<std::string, std::vector<Bucket>> out;
    if (family != "target") {
        out["prefill"] = {{{"B", 1}, {"C", chunk}}};
        for (int64_t b : batch_sizes(batch))
            for (int64_t c = 1; c <= verify_len; ++c) out["propose"].push_back({{"B", b}, {"C", c}});
        return out;
    }
    out["prefill"] = {{{"B", 1}, {"T", chunk}, {"P", chunk}, {"R", 1}}};
    for (int64_t b : batch_sizes(batch)) out["decode"].push_back({{"B", b}, {"T", 1}, {"P", b}, {"R", b}});
    for (int64_t b : batch_sizes(batch))
        for (int64_t t = 2; t <= verify_len; ++t)
            for (int64_t p : token_budgets(b, t)) out["verify"].push_back({{"B", b}, {"T", t}, {"P", p}, {"R", p}});
    return out;
}

TensorSpec tensor_spec(const json& j) {
    TensorSpec t{j.at("name").get<std::string>(), j.at("dtype").get<std::string>(), {}};
    for (const json& d : j.at("shape")) {
        if (d.is_string()) t.shape.emplace_back(d.get<std::string>());
        else t.shape.emplace_back(d.get<int64_t>());
    }
    return t;
}

GraphSpec graph_spec(const std::string& name, const json& g) {
    GraphSpec s;
    s.name = name;
    s.file = g.at("file").get<std::string>();
    s.greedy_file = g.value("greedy_file", "");
    s.max_seq = g.at("max_seq").get<int64_t>();
    for (const json& x : g.at("inputs")) s.inputs.push_back(tensor_spec(x));
    for (const json& x : g.at("outputs")) s.outputs.push_back(tensor_spec(x));
    for (const auto& [use, list] : g.at("buckets").items())
        for (const json& b : list) s.buckets[use].push_back(b.get<Bucket>());
    return s;
}

}  // namespace

fs::path inside(const fs::path& dir, const std::string& name, const std::string& what) {
    const fs::path rel(name);
    if (name.empty() || rel.is_absolute())
        throw Error(SPECRT_ERROR_ARTIFACT, dir.string() + ": the " + what + " '" + clip(name, 80) +
                                               "' is not a path inside the artifact; refusing it");
    std::error_code ec;
    const fs::path root = fs::weakly_canonical(dir, ec), full = fs::weakly_canonical(dir / rel, ec);
    auto [r, f] = std::mismatch(root.begin(), root.end(), full.begin(), full.end());
    if (ec || (r != root.end() && !r->empty()))
        throw Error(SPECRT_ERROR_ARTIFACT, dir.string() + ": the " + what + " '" + clip(name, 80) +
                                               "' leads outside the artifact (to " + full.string() + "); refusing it");
    return dir / rel;
}

namespace {

std::vector<int64_t> order(const Bucket& b) {  // the manifest's key order: B, T, P, R (C)
    std::vector<int64_t> v;
    for (const char* k : {"B", "T", "P", "R", "C"}) {
        auto it = b.find(k);
        if (it != b.end()) v.push_back(it->second);
    }
    return v;
}

}  // namespace

std::vector<int64_t> TensorSpec::resolve(const Bucket& sizes) const {
    std::vector<int64_t> out;
    for (const Dim& d : shape) {
        if (std::holds_alternative<int64_t>(d)) {
            out.push_back(std::get<int64_t>(d));
        } else {
            auto it = sizes.find(std::get<std::string>(d));
            if (it == sizes.end())
                throw Error(SPECRT_ERROR_ARTIFACT, name + ": axis " + std::get<std::string>(d) + " has no size");
            out.push_back(it->second);
        }
    }
    return out;
}

bool TensorSpec::named(const std::string& axis) const {
    return std::any_of(shape.begin(), shape.end(), [&](const Dim& d) {
        return std::holds_alternative<std::string>(d) && std::get<std::string>(d) == axis;
    });
}

const Bucket& GraphSpec::bucket(const std::string& use, const Bucket& need) const {
    auto known = chosen.find({use, need});
    if (known != chosen.end()) return known->second;
    auto it = buckets.find(use);
    const Bucket* best = nullptr;
    if (it != buckets.end()) {
        for (const Bucket& b : it->second) {
            bool fits = std::all_of(need.begin(), need.end(), [&](const auto& kv) {
                auto f = b.find(kv.first);
                return f != b.end() && f->second >= kv.second;
            });
            if (fits && (!best || order(b) < order(*best))) best = &b;
        }
    }
    if (!best) throw Error(SPECRT_ERROR_REQUEST, "graph " + name + ": no " + use + " bucket holds the request");
    return chosen.emplace(std::make_pair(use, need), *best).first->second;
}

bool GraphSpec::sized_cache() const {
    return std::any_of(inputs.begin(), inputs.end(),
                       [](const TensorSpec& t) { return t.name.rfind(io::kPastPrefix, 0) == 0 && t.named(io::kCacheLen); });
}

std::optional<GraphSpec> GraphSpec::greedy() const {
    if (greedy_file.empty()) return std::nullopt;
    GraphSpec g = *this;
    g.file = greedy_file;
    g.greedy_file.clear();
    g.outputs.erase(std::remove_if(g.outputs.begin(), g.outputs.end(),
                                   [](const TensorSpec& t) { return kGreedyDrops.count(t.name) > 0; }),
                    g.outputs.end());
    return g;
}

namespace {

// The numbers buffers are sized by agree with each other and with what the export settings give (artifact.py
// _check_sizes): each family's max_seq and buckets, the vocabulary and the target's logits, a head's vocab_ids.
void check_sizes(const Manifest& m) {
    for (const auto& [name, g] : m.graphs) {
        if (g.max_seq != m.export_max_seq)
            throw Error(SPECRT_ERROR_ARTIFACT, "graph " + name + ": max_seq " + std::to_string(g.max_seq) +
                                                   " differs from export.max_seq " + std::to_string(m.export_max_seq));
        if (g.buckets != export_buckets(name, m.batch, m.prefill_chunk, m.gamma + 1))
            throw Error(SPECRT_ERROR_ARTIFACT, "graph " + name + ": its buckets are not those of the export settings (batch " +
                                                   std::to_string(m.batch) + ", prefill chunk " +
                                                   std::to_string(m.prefill_chunk) + ", verify length " +
                                                   std::to_string(m.gamma + 1) + ")");
    }
    const auto& outs = m.graphs.at("target").outputs;
    auto logits = std::find_if(outs.begin(), outs.end(), [](const TensorSpec& t) { return t.name == io::kLogits; });
    std::string got = "no logits";
    if (logits != outs.end() && !logits->shape.empty()) {
        const Dim& width = logits->shape.back();
        if (std::holds_alternative<int64_t>(width) && std::get<int64_t>(width) == m.vocab_size) got.clear();
        else got = std::holds_alternative<int64_t>(width) ? std::to_string(std::get<int64_t>(width))
                                                          : std::get<std::string>(width);
    }
    if (!got.empty())
        throw Error(SPECRT_ERROR_ARTIFACT, "model.vocab_size " + std::to_string(m.vocab_size) +
                                               " differs from the target graph's logits (" + got + ")");
    for (const auto& [name, h] : m.heads)
        for (int64_t t : h.vocab_ids)
            if (t < 0 || t >= m.vocab_size)
                throw Error(SPECRT_ERROR_ARTIFACT, "head " + name + ": its vocab_ids leave the vocabulary (0.." +
                                                       std::to_string(m.vocab_size - 1) + ")");
}

// Every file the manifest names, and the fixed ones the runtime reads, stay inside the artifact (artifact.py
// _check_paths); the JSON ones are regular files.
void check_paths(const fs::path& dir, const Manifest& m) {
    for (const auto& [name, g] : m.graphs) {
        inside(dir, g.file, name + " graph file");
        if (!g.greedy_file.empty()) inside(dir, g.greedy_file, name + " graph file");
    }
    inside(dir, m.weights_file, "weights file");
    std::error_code ec;
    for (const char* name : rules::kArtifactDirs)
        if (fs::exists(dir / name, ec) || fs::is_symlink(dir / name, ec)) inside(dir, name, "file");
    for (const char* name : rules::kArtifactFiles)
        if (fs::exists(dir / name, ec) || fs::is_symlink(dir / name, ec)) regular_file(inside(dir, name, "file"), "file");
}

}  // namespace

Manifest load_manifest(const fs::path& dir) {
    const fs::path path = dir / "manifest.json";
    std::error_code ec;
    if (!fs::exists(path, ec) && !fs::is_symlink(path, ec))
        throw Error(SPECRT_ERROR_ARTIFACT, dir.string() + " is not a specrt artifact (no manifest.json)");
    inside(dir, "manifest.json", "manifest");
    const json j = read_json(path, "manifest");
    if (!j.is_object()) throw Error(SPECRT_ERROR_ARTIFACT, path.string() + " is malformed: expected a JSON object");
    {
        const json* v = j.contains("format_version") ? &j["format_version"] : nullptr;
        const auto& reads = rules::kReadsVersions;
        const bool known = v && v->is_number_integer() &&
                           std::find(std::begin(reads), std::end(reads), v->get<int64_t>()) != std::end(reads);
        if (!known)
            throw Error(SPECRT_ERROR_ARTIFACT, dir.string() + " has artifact format version " +
                                                   (v ? clip(v->dump(), 40) : "none") + ", this runtime reads versions " +
                                                   std::to_string(reads[0]) + " to " +
                                                   std::to_string(rules::kFormatVersion) +
                                                   "; re-export it with this version of specrt");
    }
    try {
        check_limits(j);
    } catch (const Error& e) {
        throw Error(SPECRT_ERROR_ARTIFACT, path.string() + " is malformed: " + e.what());
    }
    Manifest m;
    try {
        const json& exp = j.at("export");
        m.gamma = exp.at("verify_len").get<int64_t>() - 1;
        m.batch = exp.at("batch").get<int64_t>();
        const json& model = j.at("model");
        m.vocab_size = model.at("vocab_size").get<int64_t>();
        for (const json& e : model.at("eos_token_ids")) m.eos.insert(e.get<int64_t>());
        if (j.contains("tokenizer") && j["tokenizer"].is_object() && j["tokenizer"].contains("eos_token_ids") &&
            j["tokenizer"]["eos_token_ids"].is_array())
            for (const json& e : j["tokenizer"]["eos_token_ids"]) m.eos.insert(e.get<int64_t>());
        if (j.contains("tokenizer") && j["tokenizer"].is_object()) {
            const json& tok = j["tokenizer"];
            m.tokenizer = true;
            const bool templated = tok.contains("chat_template") && tok["chat_template"].is_string();
            const json chat = tok.value("chat", json());
            if (chat.is_object() && chat.contains("prefix")) {
                ChatText t;
                t.prefix = chat.at("prefix").get<std::string>();
                t.suffix = chat.at("suffix").get<std::string>();
                t.trim = chat.value("trim", false);
                const json roles = chat.value("roles", json());
                if (roles.is_object() && roles.contains("start")) {
                    t.start = roles.at("start").get<std::map<std::string, std::string>>();
                    t.between = roles.at("between").get<std::map<std::string, std::string>>();
                    t.end = roles.at("end").get<std::map<std::string, std::string>>();
                    t.generation = roles.at("generation").get<std::string>();
                } else {
                    t.roles_problem = roles.is_object() && roles.contains("unsupported")
                                          ? "conversations cannot go through the chat template here (" +
                                                roles["unsupported"].get<std::string>() + "): pass one user message"
                                          : "this artifact's manifest has no chat text for conversations (exported by "
                                            "an older specrt): re-export it";
                }
                m.chat = std::move(t);
            } else if (chat.is_object() && chat.contains("unsupported")) {
                m.chat_problem = "the chat template cannot run here (" + chat["unsupported"].get<std::string>() +
                                 "): pass raw text or token ids";
            } else if (templated) {
                m.chat_problem = "this artifact's manifest does not carry its chat template's text around a message "
                                 "(exported by an older specrt): re-export it, or pass raw text or token ids";
            }
        }
        const bool kernels = exp.value("kernels", std::string("stock")) == "specrt";
        for (const auto& [name, g] : j.at("graphs").items()) {
            m.graphs[name] = graph_spec(name, g);
            m.graphs[name].kernels = kernels;
        }
        if (!m.graphs.count("target")) throw Error(SPECRT_ERROR_ARTIFACT, path.string() + ": no target graph");
        m.max_seq = m.graphs["target"].max_seq;
        if (j.contains("heads") && j["heads"].is_object()) {
            for (const auto& [name, h] : j["heads"].items()) {
                HeadSpec s;
                s.name = name;
                s.kind = h.at("kind").get<std::string>();
                s.steps = h.at("steps").get<int64_t>();
                s.feature_offset = h.at("feature_offset").get<int64_t>();
                s.feature_dim = h.at("feature_dim").get<int64_t>();
                s.confidence = h.value("confidence", false);
                if (h.contains("temperatures") && h["temperatures"].is_array())
                    for (const json& t : h["temperatures"]) s.temperatures.push_back(t.get<float>());
                if (h.contains("vocab_ids") && h["vocab_ids"].is_array())
                    for (const json& t : h["vocab_ids"]) s.vocab_ids.push_back(t.get<int64_t>());
                if (!m.graphs.count(name)) throw Error(SPECRT_ERROR_ARTIFACT, path.string() + ": head " + name + " has no graph");
                m.heads[name] = s;
            }
        }
        m.export_max_seq = exp.at("max_seq").get<int64_t>();
        m.prefill_chunk = exp.at("prefill_chunk").get<int64_t>();
        m.weights_file = j.at("weights").at("file").get<std::string>();
    } catch (const json::exception& e) {
        throw Error(SPECRT_ERROR_ARTIFACT, path.string() + " is malformed: " + json_error(e));
    }
    try {
        check_sizes(m);
    } catch (const Error& e) {
        throw Error(SPECRT_ERROR_ARTIFACT, path.string() + " is inconsistent: " + e.what());
    }
    check_paths(dir, m);
    return m;
}

std::optional<Profile> load_profile(const fs::path& dir, int threads) {
    fs::path path = dir / "profile.json";
    std::error_code ec;
    if (!fs::exists(path, ec)) return std::nullopt;
    const std::string redo = "; delete it and run `specrt profile` again";
    json entries;
    try {
        json j = read_json(inside(dir, "profile.json", "file"), "file");
        if (j.value("version", 0) != kProfileVersion) return std::nullopt;
        entries = j.at("profiles");
    } catch (const std::exception&) {
        throw Error(SPECRT_ERROR_ARTIFACT, path.string() + " is not a specrt profile" + redo);
    }
    std::string key = "ort/" + std::to_string(threads);
    if (!entries.contains(key)) {
        key.clear();
        for (const auto& [k, v] : entries.items())
            if (k.rfind("ort/", 0) == 0) {
                key = k;
                break;
            }
        if (key.empty()) return std::nullopt;
    }
    Profile p;
    p.source = "artifact profile " + key;
    try {
        auto positive = [&](double ms) {
            if (!(std::isfinite(ms) && ms > 0)) throw Error(SPECRT_ERROR_ARTIFACT, "non-positive costs");
            return ms;
        };
        const json& e = entries.at(key);
        for (const auto& [b, row] : e.at("verify").items())
            for (const auto& [t, ms] : row.items()) p.verify[std::stoll(b)][std::stoll(t)] = positive(ms.get<double>());
        if (e.contains("draft"))
            for (const auto& [head, row] : e.at("draft").items())
                for (const auto& [b, ms] : row.items()) p.draft[head][std::stoll(b)] = positive(ms.get<double>());
        if (p.verify.empty() || std::any_of(p.verify.begin(), p.verify.end(), [](auto& r) { return r.second.empty(); }))
            throw Error(SPECRT_ERROR_ARTIFACT, "empty verify costs");
    } catch (const std::exception& ex) {
        throw Error(SPECRT_ERROR_ARTIFACT, path.string() + ": entry " + key + " is malformed (" + ex.what() +
                                               "); run `specrt profile` again");
    }
    return p;
}

std::string dims_text(const std::vector<Dim>& shape) {
    std::string s = "[";
    for (size_t i = 0; i < shape.size(); ++i) {
        if (i) s += ", ";
        s += std::holds_alternative<int64_t>(shape[i]) ? std::to_string(std::get<int64_t>(shape[i]))
                                                       : std::get<std::string>(shape[i]);
    }
    return s + "]";
}

}  // namespace specrt
