// An artifact as the C++ runtime reads it: the manifest (format version, model facts, each graph family's I/O and
// buckets, the draft heads) and profile.json (the cost table the sps schedulers and the hybrids plan on), checked as
// specrt/artifact.py and runtime/profile.py check them. Every problem is an Error with a one-line message.
#pragma once

#include "specrt.h"

#include <cstdint>
#include <filesystem>
#include <map>
#include <optional>
#include <set>
#include <stdexcept>
#include <string>
#include <variant>
#include <vector>

namespace specrt {

namespace fs = std::filesystem;

struct Error : std::runtime_error {
    specrt_status status;
    Error(specrt_status s, const std::string& message) : std::runtime_error(message), status(s) {}
};

using Dim = std::variant<int64_t, std::string>;
using Bucket = std::map<std::string, int64_t>;  // axis name -> size (B, T, P, R, C)

struct TensorSpec {
    std::string name, dtype;
    std::vector<Dim> shape;

    std::vector<int64_t> resolve(const Bucket& sizes) const;
    bool named(const std::string& axis) const;
};

struct GraphSpec {
    std::string name, file, greedy_file;
    int64_t max_seq = 0;
    std::vector<TensorSpec> inputs, outputs;
    std::map<std::string, std::vector<Bucket>> buckets;
    bool kernels = false;  // exported with --kernels specrt: its sessions load libspecrt_ops
    mutable std::map<std::pair<std::string, Bucket>, Bucket> chosen;  // bucket()'s answers so far

    // The smallest bucket of `use` whose sizes are all >= need (fewest slots, then tokens, then budget); chosen once
    // per (use, need) and kept, as rounds ask for the same few.
    const Bucket& bucket(const std::string& use, const Bucket& need = {}) const;
    // Whether the KV cache's length is the named axis S (the cpu lowering: it grows with the sequences).
    bool sized_cache() const;
    // The greedy variant (its own file; the outputs without the vocabulary-wide ones), if exported.
    std::optional<GraphSpec> greedy() const;
};

struct HeadSpec {
    std::string name, kind;  // kind: "dspark" | "mtp"
    int64_t steps = 0, feature_offset = 0, feature_dim = 0;
    bool confidence = false;
    std::vector<float> temperatures;  // the confidence head's calibration, per draft position
    std::vector<int64_t> vocab_ids;   // a reduced draft vocabulary (empty: the whole vocabulary)
};

// The chat template's text around messages, rendered by the exporter (specrt/tokenizer_info.py chat_affixes).
struct ChatText {
    std::string prefix, suffix;  // around one user message, with the generation prompt
    bool trim = false;           // the template strips a content's surrounding whitespace
    std::map<std::string, std::string> start, between, end;  // conversations: by first role, "a>b", last role
    std::string generation;
    std::string roles_problem;  // why conversations cannot be rendered ("" when they can)
};

struct Manifest {
    int64_t vocab_size = 0, max_seq = 0, gamma = 0, batch = 1;  // gamma: verify_len - 1
    int64_t export_max_seq = 0, prefill_chunk = 0;
    std::string weights_file;
    std::set<int64_t> eos;
    std::map<std::string, GraphSpec> graphs;  // "target" and one per head
    std::map<std::string, HeadSpec> heads;
    bool tokenizer = false;  // the artifact carries tokenizer/tokenizer.json
    std::optional<ChatText> chat;  // the chat template's text around messages
    std::string chat_problem;  // why text cannot go through the chat template here ("" when it can)
};

// Read and check an artifact's manifest against the rules of specrt/artifact.py (rules.h): a one-line Error otherwise.
Manifest load_manifest(const fs::path& dir);

// `dir / name` for a path an artifact names, refused unless it is relative and resolves (links followed) inside `dir`.
fs::path inside(const fs::path& dir, const std::string& name, const std::string& what);

// A stored cost profile (runtime/profile.py): verify[batch][tokens] and draft[head][batch], in ms.
struct Profile {
    std::string source;
    std::map<int64_t, std::map<int64_t, double>> verify;
    std::map<std::string, std::map<int64_t, double>> draft;
};

// The artifact's profile for ONNX Runtime at `threads` (else any ONNX Runtime entry); nullopt when it has none.
std::optional<Profile> load_profile(const fs::path& dir, int threads);

// The smallest key >= n, else the largest (runtime/profile.py ceil_key).
template <typename T>
int64_t ceil_key(const std::map<int64_t, T>& table, int64_t n) {
    auto it = table.lower_bound(n);
    return it != table.end() ? it->first : table.rbegin()->first;
}

std::string dims_text(const std::vector<Dim>& shape);

}  // namespace specrt
