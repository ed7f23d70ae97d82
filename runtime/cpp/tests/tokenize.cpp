// The C++ tokenizer on its own: reads JSON lines on stdin and writes one JSON line per input, for tests/test_cpp.py to
// compare with the tokenizers library and the Python chat template:
//   {"text": T, "add_special": bool}  ->  {"ids": [...], "decoded": ..., "streamed": ...}  (decoded: the ids decoded
//                                          back, special tokens kept; streamed: the same through the stream decoder)
//   {"prompt": T}                      ->  {"ids": [...]}  one user message through the artifact's chat text
//   {"messages": [[role, content]...]} ->  {"ids": [...]}  a conversation through it (or {"error": message})
//   tokenize TOKENIZER_JSON [ARTIFACT_DIR]   (the artifact's manifest gives the chat text)
#include "artifact.h"
#include "tokenizer.h"

#include <nlohmann/json.hpp>

#include <iostream>

int main(int argc, char** argv) {
    if (argc != 2 && argc != 3) {
        std::cerr << "usage: tokenize TOKENIZER_JSON [ARTIFACT_DIR] < lines\n";
        return 2;
    }
    try {
        std::optional<specrt::ChatText> chat;
        std::string problem;
        if (argc == 3) {
            specrt::Manifest m = specrt::load_manifest(argv[2]);
            chat = m.chat;
            problem = m.chat_problem;
        }
        specrt::Tokenizer tok(argv[1], chat, problem);
        std::string line;
        while (std::getline(std::cin, line)) {
            auto j = nlohmann::json::parse(line);
            nlohmann::json out;
            try {
                if (j.contains("messages")) {
                    std::vector<std::pair<std::string, std::string>> messages;
                    for (const auto& m : j["messages"]) messages.emplace_back(m.at(0), m.at(1));
                    out["ids"] = tok.encode_chat(messages);
                } else if (j.contains("prompt")) {
                    out["ids"] = tok.encode_prompt(j["prompt"].get<std::string>(), false);
                } else {
                    std::vector<int64_t> ids = tok.encode(j.at("text").get<std::string>(), j.value("add_special", false));
                    specrt::StreamDecoder stream(tok, false);
                    std::string streamed;
                    for (size_t i = 0; i < ids.size(); ++i) streamed += stream.push(&ids[i], 1);
                    streamed += stream.flush();
                    out = {{"ids", ids}, {"decoded", tok.decode(ids, false)}, {"streamed", streamed}};
                }
            } catch (const specrt::Error& e) {
                out = {{"error", e.what()}};
            }
            std::cout << out.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace) << "\n";
        }
    } catch (const std::exception& e) {
        std::cerr << "tokenize: " << e.what() << "\n";
        return 1;
    }
    return 0;
}
