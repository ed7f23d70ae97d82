// The C++ tokenizer on its own: reads JSON lines {"text": ...} on stdin and writes {"ids": [...], "decoded": ...} per
// line (decoded: the ids decoded back, special tokens kept; streamed: the same through the stream decoder), for
// tests/test_cpp.py to compare with the tokenizers library.
//   tokenize TOKENIZER_JSON
#include "artifact.h"
#include "tokenizer.h"

#include <nlohmann/json.hpp>

#include <iostream>

int main(int argc, char** argv) {
    if (argc != 2) {
        std::cerr << "usage: tokenize TOKENIZER_JSON < lines\n";
        return 2;
    }
    try {
        specrt::Tokenizer tok(argv[1], std::nullopt, "");
        std::string line;
        while (std::getline(std::cin, line)) {
            auto j = nlohmann::json::parse(line);
            std::vector<int64_t> ids = tok.encode(j.at("text").get<std::string>(), j.value("add_special", false));
            specrt::StreamDecoder stream(tok, false);
            std::string streamed;
            for (size_t i = 0; i < ids.size(); ++i) streamed += stream.push(&ids[i], 1);
            streamed += stream.flush();
            nlohmann::json out{{"ids", ids}, {"decoded", tok.decode(ids, false)}, {"streamed", streamed}};
            std::cout << out.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace) << "\n";
        }
    } catch (const std::exception& e) {
        std::cerr << "tokenize: " << e.what() << "\n";
        return 1;
    }
    return 0;
}
