#include "artifact.h"
#include "io_names.h"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>
#include <fstream>

namespace specrt {

using json = nlohmann::json;

namespace {

constexpr int kFormatVersion = 5;  // specrt/artifact.py FORMAT_VERSION
constexpr int kOldestFormat = 4;   // READS_VERSIONS: 4 is 5 without the target's tree_mask input
constexpr int kProfileVersion = 2;  // runtime/profile.py VERSION
const std::set<std::string> kGreedyDrops{io::kDraftLogits, io::kDraftProbs};  // specrt/artifact.py GREEDY_DROPS

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

void inside(const fs::path& manifest, const std::string& file) {
    fs::path rel(file);
    if (file.empty() || rel.is_absolute() || rel.lexically_normal().string().rfind("..", 0) == 0)
        throw Error(SPECRT_ERROR_ARTIFACT, manifest.string() + ": graph file '" + file + "' leaves the artifact");
}

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

Manifest load_manifest(const fs::path& dir) {
    fs::path path = dir / "manifest.json";
    std::ifstream f(path);
    if (!f) throw Error(SPECRT_ERROR_ARTIFACT, dir.string() + " is not a specrt artifact (no manifest.json)");
    Manifest m;
    try {
        json j = json::parse(f);
        int version = j.at("format_version").get<int>();
        if (version < kOldestFormat || version > kFormatVersion)
            throw Error(SPECRT_ERROR_ARTIFACT, dir.string() + ": artifact format " + std::to_string(version) +
                                                   ", this runtime reads formats " + std::to_string(kOldestFormat) +
                                                   " to " + std::to_string(kFormatVersion) +
                                                   " (re-export it with this version of specrt)");
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
    } catch (const json::exception& e) {
        throw Error(SPECRT_ERROR_ARTIFACT, path.string() + ": not a valid manifest (" + e.what() + ")");
    }
    for (const auto& [name, g] : m.graphs) {
        inside(path, g.file);
        if (!g.greedy_file.empty()) inside(path, g.greedy_file);
    }
    return m;
}

std::optional<Profile> load_profile(const fs::path& dir, int threads) {
    fs::path path = dir / "profile.json";
    std::ifstream f(path);
    if (!f) return std::nullopt;
    const std::string redo = "; delete it and run `specrt profile` again";
    json entries;
    try {
        json j = json::parse(f);
        if (j.value("version", 0) != kProfileVersion) return std::nullopt;
        entries = j.at("profiles");
    } catch (const json::exception&) {
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
