"""Runtime tokenizer: encode/decode, HF-compatible chat templates, streaming detokenization."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from specrt.errors import SpecrtError
from specrt.runtime.tokenizer import StreamDecoder, Tokenizer
from specrt.tokenizer_info import read_tokenizer_info

TEXTS = [
    "Hello, world! How are you today?",
    "naïve café — 東京タワー 🚀🎉 ok",
    "  leading spaces\n\ttabs and\r\nnewlines  ",
    "emoji family 👨‍👩‍👧 and flags 🇯🇵",
]
CONVERSATIONS = [
    [{"role": "user", "content": "What is 2+2?"}],
    [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Hi"},
     {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Bye 👋"}],
]
TEMPLATE = (
    "{% for m in messages %}\n"
    "  {% if m['role'] not in ['user', 'assistant', 'system'] %}"
    "{{ raise_exception('bad role ' + m['role']) }}{% endif %}\n"
    "<|{{ m['role'] }}|>{{ m['content'] | trim }}{{ eos_token }}\n"
    "{% endfor %}\n"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


@pytest.fixture(scope="module")
def bpe_dir(tmp_path_factory) -> Path:
    """A small byte-level BPE tokenizer (GPT-2 style), trained in-test, with a chat template."""
    from tokenizers import Tokenizer as HFTok, decoders, models, pre_tokenizers, trainers

    tok = HFTok(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    # ASCII-only corpus: non-ASCII characters stay split into single-byte tokens.
    tok.train_from_iterator(["Hello, world! How are you today? the quick brown fox jumps"] * 20,
                            trainer)
    d = tmp_path_factory.mktemp("bpe")
    tok.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<s>", "eos_token": "</s>", "chat_template": TEMPLATE}))
    return d


def test_info_and_roundtrip(bpe_dir):
    info = read_tokenizer_info(bpe_dir, extra_eos_token_ids=[1, 7])
    assert info["bos_token_id"] == 0 and info["eos_token_ids"] == [1, 7]
    assert info["chat_template"] == TEMPLATE
    tok = Tokenizer.from_dir(bpe_dir, info)
    for text in TEXTS:
        assert tok.decode(tok.encode(text)) == text
    assert tok.encode("</s>") == [1]


def test_chat_template_matches_transformers(bpe_dir):
    from transformers import PreTrainedTokenizerFast

    ref = PreTrainedTokenizerFast(tokenizer_file=str(bpe_dir / "tokenizer.json"),
                                  bos_token="<s>", eos_token="</s>", chat_template=TEMPLATE)
    tok = Tokenizer.from_dir(bpe_dir)
    for conv in CONVERSATIONS:
        for gen in (True, False):
            assert tok.apply_chat_template(conv, add_generation_prompt=gen) == \
                ref.apply_chat_template(conv, tokenize=False, add_generation_prompt=gen)
    with pytest.raises(SpecrtError, match="bad role tool"):
        tok.apply_chat_template([{"role": "tool", "content": "x"}])


def test_no_template_is_user_error(bpe_dir):
    tok = Tokenizer.from_dir(bpe_dir, {"chat_template": None})
    with pytest.raises(SpecrtError, match="no chat template"):
        tok.apply_chat_template(CONVERSATIONS[0])


def test_a_conversation_is_encoded_through_the_template(bpe_dir):
    """A multi-turn prompt (user, assistant, user) is the template's rendering of its messages, with a generation
    prompt; one turn is the single-prompt encoding; no template is a user error."""
    from specrt.runtime.prompts import encode_conversation, encode_prompt

    tok = Tokenizer.from_dir(bpe_dir, read_tokenizer_info(bpe_dir))
    turns = ("What is 2+2?", "4.", "And 3+3?")
    messages = [{"role": r, "content": t} for r, t in zip(("user", "assistant", "user"), turns)]
    ids = encode_conversation(tok, turns)
    assert tok.decode(ids) == tok.apply_chat_template(messages, add_generation_prompt=True)
    assert tok.decode(ids).count("<|user|>") == 2 and tok.decode(ids).endswith("<|assistant|>")
    assert encode_conversation(tok, turns[:1]) == encode_prompt(tok, turns[0])
    with pytest.raises(SpecrtError, match="multi-turn prompt needs a chat template"):
        encode_conversation(Tokenizer.from_dir(bpe_dir, {"chat_template": None}), turns)


def _stream(tok: Tokenizer, ids: list[int], step: int = 1) -> list[str]:
    dec = StreamDecoder(tok)
    deltas = [dec.push(ids[i:i + step]) for i in range(0, len(ids), step)]
    return deltas + [dec.flush()]


@pytest.mark.parametrize("text", TEXTS)
def test_stream_equals_full_decode(bpe_dir, text):
    tok = Tokenizer.from_dir(bpe_dir)
    ids = tok.encode(text)
    for step in (1, 2, 3):
        deltas = _stream(tok, ids, step)
        assert "".join(deltas) == tok.decode(ids)
        assert not any("\ufffd" in d for d in deltas)
    if not text.isascii():  # multi-byte characters really are split across ids
        assert any("\ufffd" in tok.decode(ids[:i]) for i in range(len(ids)))


def test_stream_invalid_utf8_tail_is_flushed(bpe_dir):
    tok = Tokenizer.from_dir(bpe_dir)
    ids = tok.encode("ok 🚀")
    cut = ids[:-1]  # last byte of the emoji missing: only flush() emits the replacement char
    deltas = _stream(tok, cut)
    assert "".join(deltas) == tok.decode(cut) and deltas[-1].endswith("\ufffd")


def test_runtime_does_not_import_transformers(bpe_dir):
    code = ("import sys; from specrt.runtime.tokenizer import Tokenizer; "
            f"t = Tokenizer.from_dir({str(bpe_dir)!r}); "
            "t.apply_chat_template([{'role': 'user', 'content': 'hi'}]); t.encode('hi'); "
            "assert 'transformers' not in sys.modules and 'torch' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.slow
def test_smollm2_gguf_tokenizer(tmp_path):
    from transformers import AutoTokenizer

    from specrt.configs.fetch import default_model_path
    from specrt.exporter.loaders.tokenizer import TokenizerSource

    path = default_model_path()
    info = TokenizerSource.from_gguf(path, eos_token_ids=(2,)).save(tmp_path)
    assert info["files"] == ["chat_template.jinja", "tokenizer.json", "tokenizer_config.json"]
    assert info["bos_token_id"] == 1 and info["eos_token_ids"] == [2]
    assert info["special_tokens"]["eos_token"] == "<|im_end|>"
    ref = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    tok = Tokenizer.from_dir(tmp_path, json.loads(json.dumps(info)))
    for conv in CONVERSATIONS:
        for gen in (True, False):
            prompt = tok.apply_chat_template(conv, add_generation_prompt=gen)
            assert prompt == ref.apply_chat_template(conv, tokenize=False, add_generation_prompt=gen)
            assert tok.encode(prompt) == ref.encode(prompt, add_special_tokens=False)
    for text in TEXTS:
        ids = tok.encode(text)
        assert ids == ref.encode(text, add_special_tokens=False)
        assert tok.decode(ids) == ref.decode(ids) == text
        assert "".join(_stream(tok, ids)) == text


def test_chat_affixes_say_what_a_runtime_without_jinja_can_render():
    """specrt/tokenizer_info.py chat_affixes, what the exporter stores for the C++ runtime: the text around one user
    message and around conversation turns, composed to equal the template's rendering; trimmed contents recorded;
    templates whose text depends on the content, the date, or that refuse a role, marked as such."""
    from specrt.tokenizer_info import chat_affixes, compile_template

    chatml = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
              "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    got = chat_affixes(chatml, {})
    assert got["prefix"] == "<|im_start|>user\n" and got["suffix"] == "<|im_end|>\n<|im_start|>assistant\n"
    assert not got["trim"] and got["roles"]["between"]["assistant>user"] == "<|im_end|>\n<|im_start|>user\n"
    messages = [{"role": "system", "content": "S"}, {"role": "user", "content": " u "},
                {"role": "assistant", "content": "a"}, {"role": "user", "content": "v"}]
    roles = got["roles"]
    composed = roles["start"]["system"] + "S" + roles["between"]["system>user"] + " u " + \
        roles["between"]["user>assistant"] + "a" + roles["between"]["assistant>user"] + "v" + roles["end"]["user"] + \
        roles["generation"]
    assert composed == compile_template(chatml).render(messages=messages, add_generation_prompt=True)
    trimmed = chat_affixes(chatml.replace("m['content']", "m['content'] | trim"), {})
    assert trimmed["trim"] and "start" in trimmed["roles"]
    no_system = chat_affixes("{% for m in messages %}{% if m['role'] == 'system' %}{{ raise_exception('no system') }}"
                             "{% endif %}[{{ m['role'] }}]{{ m['content'] }}{% endfor %}", {})
    assert "start" in no_system["roles"] and "system" not in no_system["roles"]["start"]
    assert "other than verbatim" in chat_affixes("{% for m in messages %}{{ m['content'] | upper }}{% endfor %}",
                                                 {})["unsupported"]
    assert "date" in chat_affixes("{{ strftime_now('%d') }}{% for m in messages %}{{ m['content'] }}{% endfor %}",
                                  {})["unsupported"]
    positional = chat_affixes("{% for m in messages %}{{ loop.index }}:{{ m['content'] }}{% endfor %}", {})
    assert "prefix" in positional and "unsupported" in positional["roles"]
    assert chat_affixes(None, {}) is None
