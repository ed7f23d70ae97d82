#include "tokenizer.h"

#include "artifact.h"

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cstring>
#include <fstream>
#include <mutex>
#include <queue>

namespace specrt {

using json = nlohmann::json;

namespace {

// SentencePiece's space, U+2581 (LOWER ONE EIGHTH BLOCK), in UTF-8.
const std::string kSpace = "\xE2\x96\x81";

// The GPT-2 pre-tokenizer regex (tokenizers' ByteLevel with use_regex).
const char* const kGpt2Pattern = R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";

std::string utf8(uint32_t cp) {
    std::string s;
    if (cp < 0x80) {
        s += static_cast<char>(cp);
    } else if (cp < 0x800) {
        s += static_cast<char>(0xC0 | (cp >> 6));
        s += static_cast<char>(0x80 | (cp & 0x3F));
    } else if (cp < 0x10000) {
        s += static_cast<char>(0xE0 | (cp >> 12));
        s += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
        s += static_cast<char>(0x80 | (cp & 0x3F));
    } else {
        s += static_cast<char>(0xF0 | (cp >> 18));
        s += static_cast<char>(0x80 | ((cp >> 12) & 0x3F));
        s += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
        s += static_cast<char>(0x80 | (cp & 0x3F));
    }
    return s;
}

// The length of the valid UTF-8 character at s[i], 0 if none starts there (checked as the Unicode standard's
// well-formed byte sequences: no overlongs, surrogates or code points past U+10FFFF).
size_t valid_char(const std::string& s, size_t i) {
    auto b = [&](size_t k) { return static_cast<unsigned char>(s[k]); };
    const unsigned char c = b(i);
    const size_t left = s.size() - i;
    if (c < 0x80) return 1;
    auto cont = [&](size_t k, unsigned lo = 0x80, unsigned hi = 0xBF) { return k < s.size() && b(k) >= lo && b(k) <= hi; };
    if (c >= 0xC2 && c <= 0xDF) return left >= 2 && cont(i + 1) ? 2 : 0;
    if (c >= 0xE0 && c <= 0xEF) {
        unsigned lo = c == 0xE0 ? 0xA0 : 0x80, hi = c == 0xED ? 0x9F : 0xBF;
        return left >= 3 && cont(i + 1, lo, hi) && cont(i + 2) ? 3 : 0;
    }
    if (c >= 0xF0 && c <= 0xF4) {
        unsigned lo = c == 0xF0 ? 0x90 : 0x80, hi = c == 0xF4 ? 0x8F : 0xBF;
        return left >= 4 && cont(i + 1, lo, hi) && cont(i + 2) && cont(i + 3) ? 4 : 0;
    }
    return 0;
}

// How many bytes of the invalid sequence at s[i] one U+FFFD stands for (the maximal subpart of a well-formed
// sequence, at least one byte).
size_t invalid_span(const std::string& s, size_t i) {
    auto b = [&](size_t k) { return static_cast<unsigned char>(s[k]); };
    const unsigned char c = b(i);
    size_t need = c >= 0xC2 && c <= 0xDF ? 2 : c >= 0xE0 && c <= 0xEF ? 3 : c >= 0xF0 && c <= 0xF4 ? 4 : 1;
    size_t k = 1;
    for (; k < need && i + k < s.size(); ++k) {
        unsigned lo = 0x80, hi = 0xBF;
        if (k == 1 && c == 0xE0) lo = 0xA0;
        if (k == 1 && c == 0xED) hi = 0x9F;
        if (k == 1 && c == 0xF0) lo = 0x90;
        if (k == 1 && c == 0xF4) hi = 0x8F;
        if (b(i + k) < lo || b(i + k) > hi) break;
    }
    return k;
}

}  // namespace

std::string utf8_lossy(const std::string& bytes) {
    std::string out;
    out.reserve(bytes.size());
    for (size_t i = 0; i < bytes.size();) {
        size_t n = valid_char(bytes, i);
        if (n) {
            out.append(bytes, i, n);
            i += n;
        } else {
            out += "\xEF\xBF\xBD";
            i += invalid_span(bytes, i);
        }
    }
    return out;
}

struct Tokenizer::Impl {
    std::unordered_map<std::string, int64_t> vocab;
    std::vector<std::string> tokens;  // id -> its vocabulary string (byte-level alphabet) or added content
    std::vector<char> special, added;
    std::unordered_map<uint64_t, std::pair<int64_t, int64_t>> merges;  // (left id, right id) -> (rank, merged id)
    std::vector<std::pair<std::string, int64_t>> added_tokens;  // longest first
    std::string byte_char[256];  // byte -> its character in the byte-level alphabet
    std::unordered_map<uint32_t, unsigned char> char_byte;  // that character's code point -> the byte
    pcre2_code* regex = nullptr;
    bool prefix_space = false, ignore_merges = false, nfc = false;
    int64_t unk = -1;
    // SentencePiece-style BPE (Llama 2, Mistral, TinyLlama: byte fallback, spaces as U+2581): `spm` set, the text's
    // spaces replaced and a U+2581 prepended (`prepend`: to no segment, the one at the text's start, or every one;
    // `prepend_always`: even where one is there already), split before each U+2581 (`split_words`) or not, each
    // character its token or its UTF-8 bytes' <0xXX> tokens (`byte_ids`); decoding strips the text's first space.
    bool spm = false, prepend_always = false, split_words = false, strip_first = false;
    enum { kNever, kFirst, kAlways } prepend = kNever;
    int64_t byte_ids[256];
    std::vector<int16_t> byte_of;  // id -> the byte a <0xXX> token stands for, -1 for other tokens
    std::vector<int64_t> bos_ids, eos_ids;  // the post-processor's special tokens around a sequence
    std::string post_problem;  // why add_special cannot be honoured ("" when it can)
    size_t longest = 0;  // the longest token's bytes (its vocabulary string or added content, as UTF-8)
    mutable std::mutex cache_lock;
    mutable std::unordered_map<std::string, std::vector<int64_t>> cache;

    ~Impl() {
        if (regex) pcre2_code_free(regex);
    }
    // tokenizer.json's normalizer, pre-tokenizer and decoder, for each kind of vocabulary
    void read_byte_level(const std::filesystem::path& file, const json& j);
    void read_spm(const std::filesystem::path& file, const json& j);

    // Merge adjacent symbols by rank until no pair has a merge: the lowest rank first, the leftmost on ties (as
    // tokenizers' BPE does), with a heap of candidate pairs over a linked list: n log n, not n^2, for long words.
    void merge(std::vector<int64_t>& syms) const {
        const size_t n = syms.size();
        if (n < 2) return;
        std::vector<int64_t> next(n), prev(n);
        for (size_t i = 0; i < n; ++i) {
            next[i] = i + 1 < n ? static_cast<int64_t>(i + 1) : -1;
            prev[i] = static_cast<int64_t>(i) - 1;
        }
        struct Pair {
            int64_t rank, pos, left, right;
            bool operator>(const Pair& o) const { return rank != o.rank ? rank > o.rank : pos > o.pos; }
        };
        std::priority_queue<Pair, std::vector<Pair>, std::greater<Pair>> heap;
        auto offer = [&](int64_t i) {
            if (i < 0 || next[i] < 0) return;
            auto m = merges.find(static_cast<uint64_t>(syms[i]) << 32 | static_cast<uint64_t>(syms[next[i]]));
            if (m != merges.end()) heap.push({m->second.first, i, syms[i], syms[next[i]]});
        };
        for (size_t i = 0; i + 1 < n; ++i) offer(static_cast<int64_t>(i));
        std::vector<char> gone(n, 0);
        while (!heap.empty()) {
            const Pair p = heap.top();
            heap.pop();
            const int64_t j = next[p.pos];
            if (gone[p.pos] || j < 0 || syms[p.pos] != p.left || syms[j] != p.right) continue;  // stale
            syms[p.pos] = merges.at(static_cast<uint64_t>(p.left) << 32 | static_cast<uint64_t>(p.right)).second;
            gone[j] = 1;
            next[p.pos] = next[j];
            if (next[j] >= 0) prev[next[j]] = p.pos;
            offer(prev[p.pos]);
            offer(p.pos);
        }
        size_t k = 0;
        for (size_t i = 0; i < n; ++i)
            if (!gone[i]) syms[k++] = syms[i];
        syms.resize(k);
    }

    void bpe(const std::string& piece, std::vector<int64_t>& out) const {
        std::string word;
        if (spm) {
            word = piece;
        } else {
            for (unsigned char c : piece) word += byte_char[c];
        }
        const bool cached = word.size() <= 256;  // a long word (SentencePiece's whole segment) is not kept
        if (cached) {
            std::lock_guard<std::mutex> g(cache_lock);
            auto hit = cache.find(word);
            if (hit != cache.end()) {
                out.insert(out.end(), hit->second.begin(), hit->second.end());
                return;
            }
        }
        std::vector<int64_t> syms;
        auto whole = vocab.find(word);
        if (ignore_merges && whole != vocab.end()) {
            syms.push_back(whole->second);
        } else {
            for (size_t i = 0; i < word.size();) {  // one symbol per character
                size_t n = 1;
                while (i + n < word.size() && (static_cast<unsigned char>(word[i + n]) & 0xC0) == 0x80) ++n;
                auto it = vocab.find(word.substr(i, n));
                if (it != vocab.end()) {
                    syms.push_back(it->second);
                } else if (spm) {  // byte fallback: the character's UTF-8 bytes as <0xXX> tokens
                    for (size_t b = i; b < i + n; ++b) {
                        const int64_t id = byte_ids[static_cast<unsigned char>(word[b])];
                        if (id < 0 && unk < 0)
                            throw Error(SPECRT_ERROR_REQUEST, "the tokenizer has no token for a byte of the text");
                        syms.push_back(id >= 0 ? id : unk);
                    }
                } else if (unk >= 0) {
                    syms.push_back(unk);
                } else {
                    throw Error(SPECRT_ERROR_REQUEST, "the tokenizer has no token for a character of the text");
                }
                i += n;
            }
            merge(syms);
        }
        out.insert(out.end(), syms.begin(), syms.end());
        if (!cached) return;
        std::lock_guard<std::mutex> g(cache_lock);
        if (cache.size() > (1u << 16)) cache.clear();
        cache.emplace(std::move(word), std::move(syms));
    }

    // SentencePiece-style text without added tokens (`first`: it starts the whole text): spaces as U+2581, the
    // prepended U+2581, the words (or the whole segment), BPE with byte fallback.
    void segment_spm(const std::string& text, bool first, std::vector<int64_t>& out) const {
        if (text.empty()) return;
        std::string s;
        for (char c : text) {
            if (c == ' ') s += kSpace;
            else s += c;
        }
        if ((prepend == kAlways || (prepend == kFirst && first)) && (prepend_always || s.compare(0, 3, kSpace) != 0))
            s = kSpace + s;
        if (!split_words) return bpe(s, out);
        size_t start = 0;  // each word begins at a U+2581 (tokenizers' MergedWithNext)
        for (size_t i = 3; i + 3 <= s.size(); ++i)
            if (s.compare(i, 3, kSpace) == 0) {
                bpe(s.substr(start, i - start), out);
                start = i;
            }
        bpe(s.substr(start), out);
    }

    // Text without added tokens: prefix space, the regex's pieces (and the gaps between them), BPE.
    void segment(std::string text, bool first, std::vector<int64_t>& out) const {
        if (spm) return segment_spm(text, first, out);
        if (text.empty()) return;
        if (prefix_space && text[0] != ' ') text = " " + text;
        pcre2_match_data* md = pcre2_match_data_create_from_pattern(regex, nullptr);
        size_t at = 0, last = 0;
        const auto* subject = reinterpret_cast<PCRE2_SPTR>(text.data());
        while (at < text.size()) {
            int rc = pcre2_match(regex, subject, text.size(), at, 0, md, nullptr);
            if (rc < 0) break;
            PCRE2_SIZE* ov = pcre2_get_ovector_pointer(md);
            size_t s = ov[0], e = ov[1];
            if (s > last) bpe(text.substr(last, s - last), out);
            if (e > s) bpe(text.substr(s, e - s), out);
            last = e;
            at = e > s ? e : e + 1;
            while (at < text.size() && (static_cast<unsigned char>(text[at]) & 0xC0) == 0x80) ++at;
        }
        pcre2_match_data_free(md);
        if (last < text.size()) bpe(text.substr(last), out);
    }
};

namespace {

[[noreturn]] void unsupported(const std::filesystem::path& file, const std::string& what) {
    throw Error(SPECRT_ERROR_ARTIFACT, file.string() + ": " + what +
                                           " (the C++ tokenizer reads byte-level BPE: GPT-2, SmolLM2, Llama 3, Qwen; "
                                           "and SentencePiece-style BPE with byte fallback: Llama 2, Mistral, "
                                           "TinyLlama); pass token ids");
}

}  // namespace

// The byte-level tokenizer's normalizer (none, or NFC: text that is ASCII is its own NFC form), pre-tokenizer
// (ByteLevel with its regex, or a Split regex followed by ByteLevel without one) and decoder (ByteLevel).
void Tokenizer::Impl::read_byte_level(const std::filesystem::path& file, const json& j) {
    Impl& t = *this;
    const json& norm = j.value("normalizer", json());
    if (!norm.is_null()) {
        const std::string type = norm.value("type", "");
        if (type == "NFC") t.nfc = true;
        else if (!(type == "Sequence" && norm.value("normalizers", json::array()).empty()))
            unsupported(file, "a " + type + " normalizer");
    }
    const json& pre = j.at("pre_tokenizer");
    std::string pattern;
    auto byte_level = [&](const json& p, bool regex) {
        if (p.value("type", "") != "ByteLevel") return false;
        t.prefix_space = p.value("add_prefix_space", false);
        if (p.value("use_regex", true) != regex) return false;
        if (regex) pattern = kGpt2Pattern;
        return true;
    };
    bool ok = byte_level(pre, true);
    if (!ok && pre.value("type", "") == "Sequence") {
        const json& seq = pre.at("pretokenizers");
        if (seq.size() == 2 && seq[0].value("type", "") == "Split" && seq[0].value("behavior", "") == "Isolated" &&
            !seq[0].value("invert", false) && seq[0].at("pattern").contains("Regex") && byte_level(seq[1], false)) {
            pattern = seq[0]["pattern"]["Regex"].get<std::string>();
            ok = true;
        } else if (seq.size() == 1 && byte_level(seq[0], true)) {
            ok = true;
        }
    }
    if (!ok) unsupported(file, "a " + pre.value("type", "?") + " pre-tokenizer");
    const json& dec = j.value("decoder", json());
    if (dec.is_null() || dec.value("type", "") != "ByteLevel") unsupported(file, "a decoder other than ByteLevel");
    int err = 0;
    PCRE2_SIZE offset = 0;
    t.regex = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(pattern.c_str()), PCRE2_ZERO_TERMINATED, PCRE2_UTF | PCRE2_UCP,
                            &err, &offset, nullptr);
    if (!t.regex) unsupported(file, "a pre-tokenizer regex PCRE2 cannot compile");
    pcre2_jit_compile(t.regex, PCRE2_JIT_COMPLETE);  // faster where the JIT is available; the interpreter otherwise
}

// SentencePiece-style BPE with byte fallback as tokenizers writes it, in either of its two forms: a Metaspace
// pre-tokenizer (replacement U+2581, prepend_scheme first / always / never, split or not; what a GGUF's llama
// vocabulary becomes) or the legacy normalizer Prepend(U+2581) + Replace(" ", U+2581) with no pre-tokenizer (Llama
// 2's tokenizer.json); the decoder Replace(U+2581, " "), ByteFallback, Fuse and Strip(" ", 1, 0).
void Tokenizer::Impl::read_spm(const std::filesystem::path& file, const json& j) {
    Impl& t = *this;
    const json& norm = j.value("normalizer", json());
    const json& pre = j.value("pre_tokenizer", json());
    auto is_replace = [](const json& x, const std::string& from, const std::string& to) {
        return x.value("type", "") == "Replace" && x.contains("pattern") && x["pattern"].value("String", "") == from &&
               x.value("content", "") == to;
    };
    if (!norm.is_null()) {
        const json& seq = norm.value("normalizers", json::array());
        const bool legacy = norm.value("type", "") == "Sequence" && seq.size() == 2 &&
                            seq[0].value("type", "") == "Prepend" && seq[0].value("prepend", "") == kSpace &&
                            is_replace(seq[1], " ", kSpace);
        if (!legacy) unsupported(file, "a " + norm.value("type", "?") + " normalizer with byte fallback");
        if (!pre.is_null()) unsupported(file, "a pre-tokenizer after the Prepend normalizer");
        t.prepend = kAlways;
        t.prepend_always = true;
    } else {
        if (pre.value("type", "") != "Metaspace" || pre.value("replacement", "") != kSpace)
            unsupported(file, "a " + pre.value("type", "?") + " pre-tokenizer with byte fallback");
        const std::string scheme = pre.contains("prepend_scheme") ? pre.value("prepend_scheme", "")
                                   : pre.value("add_prefix_space", true) ? "always" : "never";
        if (scheme == "first") t.prepend = kFirst;
        else if (scheme == "always") t.prepend = kAlways;
        else if (scheme != "never") unsupported(file, "a Metaspace prepend scheme " + scheme);
        t.split_words = pre.value("split", true);
    }
    const json& dec = j.value("decoder", json());
    const json& steps = dec.value("decoders", json::array());
    bool ok = dec.value("type", "") == "Sequence" && (steps.size() == 3 || steps.size() == 4) &&
              is_replace(steps[0], kSpace, " ") && steps[1].value("type", "") == "ByteFallback" &&
              steps[2].value("type", "") == "Fuse";
    if (ok && steps.size() == 4)
        ok = steps[3].value("type", "") == "Strip" && steps[3].value("content", "") == " " &&
             steps[3].value("start", 0) == 1 && steps[3].value("stop", 0) == 0;
    if (!ok) unsupported(file, "a decoder other than SentencePiece's (Replace, ByteFallback, Fuse, Strip)");
    t.strip_first = steps.size() == 4;
}

Tokenizer::Tokenizer(const std::filesystem::path& file, std::optional<ChatText> chat, std::string chat_problem)
    : impl_(std::make_unique<Impl>()), chat_(std::move(chat)), chat_problem_(std::move(chat_problem)) {
    Impl& t = *impl_;
    std::ifstream f(file);
    if (!f) throw Error(SPECRT_ERROR_ARTIFACT, file.string() + " is missing");
    json j;
    try {
        j = json::parse(f);
    } catch (const json::exception& e) {
        throw Error(SPECRT_ERROR_ARTIFACT, file.string() + ": not valid JSON (" + e.what() + ")");
    }
    try {
        const json& model = j.at("model");
        if (model.value("type", "") != "BPE") unsupported(file, "a " + model.value("type", "?") + " model");
        t.spm = model.value("byte_fallback", false);
        t.ignore_merges = model.value("ignore_merges", false);
        for (const auto& [tok, id] : model.at("vocab").items()) t.vocab[tok] = id.get<int64_t>();
        int64_t size = 0;
        for (const auto& [tok, id] : t.vocab) size = std::max(size, id + 1);
        for (const json& a : j.value("added_tokens", json::array())) size = std::max(size, a.at("id").get<int64_t>() + 1);
        t.tokens.assign(size, "");
        t.special.assign(size, 0);
        t.added.assign(size, 0);
        for (const auto& [tok, id] : t.vocab) t.tokens[id] = tok;
        t.byte_of.assign(size, -1);
        for (int b = 0; b < 256; ++b) {  // byte fallback's tokens, <0x00> .. <0xFF>
            char name[8];
            std::snprintf(name, sizeof name, "<0x%02X>", b);
            auto it = t.vocab.find(name);
            t.byte_ids[b] = it == t.vocab.end() ? -1 : it->second;
            if (it != t.vocab.end()) t.byte_of[it->second] = static_cast<int16_t>(b);
        }
        int64_t rank = 0;
        for (const json& m : model.at("merges")) {
            std::string a, b;
            if (m.is_array()) {
                a = m.at(0).get<std::string>();
                b = m.at(1).get<std::string>();
            } else {
                std::string s = m.get<std::string>();
                size_t sp = s.find(' ');
                a = s.substr(0, sp);
                b = s.substr(sp + 1);
            }
            auto ia = t.vocab.find(a), ib = t.vocab.find(b), ic = t.vocab.find(a + b);
            if (ia != t.vocab.end() && ib != t.vocab.end() && ic != t.vocab.end()) {
                uint64_t key = static_cast<uint64_t>(ia->second) << 32 | static_cast<uint64_t>(ib->second);
                t.merges.emplace(key, std::make_pair(rank, ic->second));
            }
            ++rank;
        }
        if (model.contains("unk_token") && model["unk_token"].is_string()) {
            auto u = t.vocab.find(model["unk_token"].get<std::string>());
            if (u != t.vocab.end()) t.unk = u->second;
        }
        for (const json& a : j.value("added_tokens", json::array())) {
            const int64_t id = a.at("id").get<int64_t>();
            const std::string content = a.at("content").get<std::string>();
            if (a.value("lstrip", false) || a.value("rstrip", false) || a.value("single_word", false))
                unsupported(file, "added token " + content + " strips spaces or matches single words");
            t.tokens[id] = content;
            t.added[id] = 1;
            t.special[id] = a.value("special", false);
            t.added_tokens.emplace_back(content, id);
        }
        std::stable_sort(t.added_tokens.begin(), t.added_tokens.end(),
                         [](const auto& x, const auto& y) { return x.first.size() > y.first.size(); });
        // the byte-level alphabet (GPT-2's bytes_to_unicode)
        int n = 0;
        for (int b = 0; b < 256; ++b) {
            bool printable = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF);
            uint32_t cp = printable ? static_cast<uint32_t>(b) : static_cast<uint32_t>(256 + n++);
            t.byte_char[b] = utf8(cp);
            t.char_byte[cp] = static_cast<unsigned char>(b);
        }
        if (t.spm) {
            t.read_spm(file, j);
        } else {
            t.read_byte_level(file, j);
        }
        // post-processor: nothing, ByteLevel (offsets only), TemplateProcessing's special tokens, or a sequence of those
        std::vector<json> posts;
        const json& post = j.value("post_processor", json());
        if (!post.is_null()) {
            if (post.value("type", "") == "Sequence") posts.assign(post.at("processors").begin(), post.at("processors").end());
            else posts.push_back(post);
        }
        for (const json& p : posts) {
            const std::string type = p.value("type", "");
            if (type == "ByteLevel") continue;
            if (type != "TemplateProcessing") {
                t.post_problem = "a " + type + " post-processor";
                continue;
            }
            bool seen = false;
            for (const json& piece : p.at("single")) {
                if (piece.contains("Sequence")) {
                    seen = true;
                    continue;
                }
                const std::string name = piece.at("SpecialToken").at("id").get<std::string>();
                for (const json& id : p.at("special_tokens").at(name).at("ids"))
                    (seen ? t.eos_ids : t.bos_ids).push_back(id.get<int64_t>());
            }
        }
    } catch (const json::exception& e) {
        throw Error(SPECRT_ERROR_ARTIFACT, file.string() + ": not a tokenizer.json this runtime reads (" + e.what() + ")");
    }
    for (const std::string& token : t.tokens) t.longest = std::max(t.longest, token.size());
}

Tokenizer::~Tokenizer() = default;

size_t Tokenizer::longest_token() const { return std::max<size_t>(impl_->longest, 1); }

std::vector<int64_t> Tokenizer::encode(const std::string& text, bool add_special) const {
    const Impl& t = *impl_;
    for (size_t i = 0, n; i < text.size(); i += n)
        if (!(n = valid_char(text, i))) throw Error(SPECRT_ERROR_REQUEST, "the text is not valid UTF-8");
    if (t.nfc && std::any_of(text.begin(), text.end(), [](char c) { return static_cast<unsigned char>(c) >= 0x80; }))
        throw Error(SPECRT_ERROR_REQUEST, "this tokenizer normalizes text to NFC, which the C++ tokenizer does only "
                                          "for ASCII text: pass token ids");
    if (add_special && !t.post_problem.empty())
        throw Error(SPECRT_ERROR_REQUEST, "the tokenizer's " + t.post_problem + " is not implemented in C++: pass token ids");
    std::vector<int64_t> out;
    if (add_special) out = t.bos_ids;
    size_t start = 0;
    for (size_t i = 0; i < text.size();) {  // added tokens first: the leftmost match, the longest there
        const std::pair<std::string, int64_t>* hit = nullptr;
        for (const auto& a : t.added_tokens)
            if (!a.first.empty() && text.compare(i, a.first.size(), a.first) == 0) {
                hit = &a;
                break;
            }
        if (!hit) {
            ++i;
            continue;
        }
        t.segment(text.substr(start, i - start), start == 0, out);
        out.push_back(hit->second);
        i += hit->first.size();
        start = i;
    }
    t.segment(text.substr(start), start == 0, out);
    if (add_special) out.insert(out.end(), t.eos_ids.begin(), t.eos_ids.end());
    return out;
}

namespace {

// Python's str.strip(): the whitespace str.isspace() names, at both ends (the template's `trim`).
std::string strip(const std::string& s) {
    auto space_at = [&](size_t i) -> size_t {  // the length of a whitespace character at s[i], else 0
        const unsigned char c = static_cast<unsigned char>(s[i]);
        if (c == ' ' || (c >= 0x09 && c <= 0x0D) || (c >= 0x1C && c <= 0x1F)) return 1;
        static const char* const wide[] = {"\xC2\x85", "\xC2\xA0", "\xE1\x9A\x80", "\xE2\x80\xA8", "\xE2\x80\xA9",
                                           "\xE2\x80\xAF", "\xE2\x81\x9F", "\xE3\x80\x80"};
        for (const char* w : wide)
            if (s.compare(i, std::strlen(w), w) == 0) return std::strlen(w);
        if (s.compare(i, 2, "\xE2\x80") == 0 && i + 2 < s.size() && static_cast<unsigned char>(s[i + 2]) >= 0x80 &&
            static_cast<unsigned char>(s[i + 2]) <= 0x8A)
            return 3;  // U+2000..U+200A
        return 0;
    };
    size_t begin = 0, end = s.size();
    while (begin < end) {
        size_t n = space_at(begin);
        if (!n) break;
        begin += n;
    }
    while (end > begin) {  // step back over one character at a time
        size_t k = end - 1;
        while (k > begin && (static_cast<unsigned char>(s[k]) & 0xC0) == 0x80) --k;
        if (space_at(k) != end - k) break;
        end = k;
    }
    return s.substr(begin, end - begin);
}

}  // namespace

std::vector<int64_t> Tokenizer::encode_prompt(const std::string& text, bool raw) const {
    if (raw) return encode(text, true);
    if (!chat_problem_.empty()) throw Error(SPECRT_ERROR_REQUEST, chat_problem_);
    if (!chat_) return encode(text, false);
    return encode(chat_->prefix + (chat_->trim ? strip(text) : text) + chat_->suffix, false);
}

std::vector<int64_t> Tokenizer::encode_chat(const std::vector<std::pair<std::string, std::string>>& messages) const {
    if (messages.empty()) throw Error(SPECRT_ERROR_REQUEST, "a conversation needs at least one message");
    if (!chat_problem_.empty()) throw Error(SPECRT_ERROR_REQUEST, chat_problem_);
    if (!chat_) throw Error(SPECRT_ERROR_REQUEST, "this model has no chat template; pass a raw prompt instead");
    const ChatText& c = *chat_;
    if (!c.roles_problem.empty()) throw Error(SPECRT_ERROR_REQUEST, c.roles_problem);
    auto show = [&](const std::string& x) { return c.trim ? strip(x) : x; };
    auto first = c.start.find(messages[0].first);
    if (first == c.start.end())
        throw Error(SPECRT_ERROR_REQUEST, "the chat template's text for a conversation that starts with a " +
                                              messages[0].first + " message is not known");
    std::string text = first->second + show(messages[0].second);
    for (size_t i = 1; i < messages.size(); ++i) {
        auto b = c.between.find(messages[i - 1].first + ">" + messages[i].first);
        if (b == c.between.end())
            throw Error(SPECRT_ERROR_REQUEST, "the chat template's text for a " + messages[i].first +
                                                  " message after a " + messages[i - 1].first + " message is not known");
        text += b->second + show(messages[i].second);
    }
    auto e = c.end.find(messages.back().first);
    if (e == c.end.end())
        throw Error(SPECRT_ERROR_REQUEST, "the chat template's text after a " + messages.back().first + " message is not known");
    return encode(text + e->second + c.generation, false);
}

std::string Tokenizer::bytes(const int64_t* ids, size_t n, bool skip_special) const {
    const Impl& t = *impl_;
    std::string out;
    for (size_t k = 0; k < n; ++k) {
        const int64_t id = ids[k];
        if (id < 0 || id >= static_cast<int64_t>(t.tokens.size()))
            throw Error(SPECRT_ERROR_REQUEST, "token id " + std::to_string(id) + " is outside the tokenizer's vocabulary");
        if (skip_special && t.special[id]) continue;
        const std::string& s = t.tokens[id];
        if (t.spm && !t.added[id]) {  // a <0xXX> token is its byte; U+2581 is a space
            if (t.byte_of[id] >= 0) {
                out += static_cast<char>(t.byte_of[id]);
                continue;
            }
            for (size_t i = 0; i < s.size(); ++i) {
                if (s.compare(i, 3, kSpace) == 0) {
                    out += ' ';
                    i += 2;
                } else {
                    out += s[i];
                }
            }
            continue;
        }
        for (size_t i = 0; i < s.size();) {  // each character of the byte-level alphabet is one byte; others stay
            size_t len = 1;
            while (i + len < s.size() && (static_cast<unsigned char>(s[i + len]) & 0xC0) == 0x80) ++len;
            uint32_t cp = static_cast<unsigned char>(s[i]);
            if (len > 1) {
                cp &= 0xFF >> (len + 1);
                for (size_t k2 = 1; k2 < len; ++k2) cp = cp << 6 | (static_cast<unsigned char>(s[i + k2]) & 0x3F);
            }
            auto b = t.char_byte.find(cp);
            if (b != t.char_byte.end()) out += static_cast<char>(b->second);
            else out.append(s, i, len);
            i += len;
        }
    }
    return out;
}

bool Tokenizer::strips_first_space() const { return impl_->strip_first; }

std::string Tokenizer::decode(const std::vector<int64_t>& ids, bool skip_special) const {
    std::string b = bytes(ids.data(), ids.size(), skip_special);
    if (strips_first_space() && !b.empty() && b[0] == ' ') b.erase(0, 1);
    return utf8_lossy(b);
}

std::string StreamDecoder::push(const int64_t* ids, size_t n) {
    pending_ += tok_.bytes(ids, n, skip_);
    if (!started_ && !pending_.empty()) {  // decode's strip of the text's first space, once per stream
        if (tok_.strips_first_space() && pending_[0] == ' ') pending_.erase(0, 1);
        started_ = true;
    }
    // release up to the last complete character; an incomplete one at the end waits for its next bytes
    size_t cut = pending_.size();
    for (size_t back = 1; back <= std::min<size_t>(3, pending_.size()); ++back) {
        const unsigned char c = static_cast<unsigned char>(pending_[pending_.size() - back]);
        if ((c & 0xC0) == 0x80) continue;  // a continuation byte: look further back
        const size_t need = c >= 0xF0 ? 4 : c >= 0xE0 ? 3 : c >= 0xC0 ? 2 : 1;
        if (need > back) cut = pending_.size() - back;
        break;
    }
    std::string out = utf8_lossy(pending_.substr(0, cut));
    pending_.erase(0, cut);
    return out;
}

std::string StreamDecoder::flush() {
    std::string out = utf8_lossy(pending_);
    pending_.clear();
    return out;
}

}  // namespace specrt
