// BPE from a tokenizer.json, as the `tokenizers` library runs it: byte-level for GPT-2-style vocabularies (SmolLM2,
// Llama 3, Qwen: added tokens matched first (leftmost, longest), the pre-tokenizer's regex splitting the rest (PCRE2
// with Unicode properties), each piece's bytes mapped to the byte-level alphabet and merged by rank), or
// SentencePiece-style with byte fallback (Llama 2, Mistral, TinyLlama: spaces as U+2581, a character without a token
// as its bytes' <0xXX> tokens); merges by rank with a heap (n log n in a word's length); decoding maps back to bytes,
// and a stream decoder releases only whole UTF-8 characters. The chat template is not run here: the
// exporter renders it once around a user message and stores the text before and after it in the manifest.
#pragma once

#include "artifact.h"

#include <cstdint>
#include <filesystem>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

namespace specrt {

class Tokenizer {
public:
    // Loads tokenizer.json; throws Error (artifact) on a file it cannot read, or on a tokenizer it does not
    // implement (the message says which part).
    Tokenizer(const std::filesystem::path& file, std::optional<ChatText> chat, std::string chat_problem);
    ~Tokenizer();

    // Token ids of `text`; `add_special`: the post-processor's special tokens (a BOS), as tokenizers' encode does.
    std::vector<int64_t> encode(const std::string& text, bool add_special) const;
    // A user message as the engine's prompt: through the chat template (its stored prefix and suffix) unless `raw`,
    // as runtime/prompts.py encode_prompt does.
    std::vector<int64_t> encode_prompt(const std::string& text, bool raw) const;
    // A conversation ((role, content) pairs: system, user, assistant) through the chat template's stored text,
    // with the generation prompt, as the server renders messages.
    std::vector<int64_t> encode_chat(const std::vector<std::pair<std::string, std::string>>& messages) const;
    // The text of `ids` (invalid UTF-8 replaced by U+FFFD).
    std::string decode(const std::vector<int64_t>& ids, bool skip_special) const;
    // The bytes `ids` stand for.
    std::string bytes(const int64_t* ids, size_t n, bool skip_special) const;
    // Whether decoding drops the text's first space (SentencePiece's decoder: the space its encoding prepended).
    bool strips_first_space() const;
    // The most bytes of text one token stands for, at most (its string's UTF-8 bytes bound them).
    size_t longest_token() const;

private:
    struct Impl;
    std::unique_ptr<Impl> impl_;
    std::optional<ChatText> chat_;
    std::string chat_problem_;
};

// Text deltas of a growing id sequence: bytes are released up to the last complete UTF-8 character.
class StreamDecoder {
public:
    StreamDecoder(const Tokenizer& tokenizer, bool skip_special) : tok_(tokenizer), skip_(skip_special) {}
    std::string push(const int64_t* ids, size_t n);
    std::string flush();

private:
    const Tokenizer& tok_;
    bool skip_;
    bool started_ = false;  // some text has been taken (the first space dropped where the tokenizer does)
    std::string pending_;
};

// `bytes` as UTF-8, each maximal invalid subsequence replaced by U+FFFD (Rust's String::from_utf8_lossy).
std::string utf8_lossy(const std::string& bytes);

}  // namespace specrt
