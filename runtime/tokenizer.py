"""Light runtime tokenizer: `tokenizers` + a jinja2 chat template, no transformers import."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Iterable, Sequence

from specrt.errors import SpecrtError, clipped
from specrt.tokenizer_info import (MAX_RENDER_CHARS, RenderStopped, bounded_work,
                                   compile_template as _compile_template, read_tokenizer_info)


class Tokenizer:
    """Encode/decode with a `tokenizer.json`, and render the model's chat template."""

    def __init__(self, tok: Any, info: dict[str, Any]) -> None:
        self._tok = tok
        self.info = info
        self.special_tokens: dict[str, str] = dict(info.get("special_tokens") or {})
        self.chat_template: str | None = info.get("chat_template")
        self.bos_token_id: int | None = info.get("bos_token_id")
        self.eos_token_ids: list[int] = list(info.get("eos_token_ids") or [])
        self._template = None
        self._max_chars: int | None = None

    @classmethod
    def from_dir(cls, path: str | Path, info: dict[str, Any] | None = None) -> "Tokenizer":
        """Load `tokenizer.json` from `path`; `info` is the manifest's tokenizer entry."""
        import tokenizers

        path = Path(path)
        if not (path / "tokenizer.json").is_file():
            raise SpecrtError(f"{path}: no tokenizer.json")
        info = info if info is not None else read_tokenizer_info(path)
        try:
            tok = tokenizers.Tokenizer.from_file(str(path / "tokenizer.json"))
        except Exception as e:  # tokenizers raises a bare Exception on bad JSON
            raise SpecrtError(f"{path / 'tokenizer.json'}: cannot load: {e}") from None
        return cls(tok, info)

    @property
    def max_token_chars(self) -> int:
        """The most characters of text one token stands for (its longest vocabulary entry: byte-level and byte-
        fallback entries are at least as long as what they decode to); a cheap bound on a text's token count."""
        if self._max_chars is None:
            self._max_chars = max((len(t) for t in self._tok.get_vocab(with_added_tokens=True)), default=1)
        return self._max_chars

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of `text` (special-token strings in `text` map to their ids)."""
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        """Text of `ids`."""
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict[str, Any]],
                            add_generation_prompt: bool = True, **kwargs: Any) -> str:
        """Render `messages` ([{"role", "content"}]) with the model's chat template."""
        import jinja2

        if not self.chat_template:
            raise SpecrtError("this model has no chat template; pass a raw prompt instead")
        if self._template is None:
            self._template = _compile_template(self.chat_template)
        variables = {**self.special_tokens, **kwargs}
        variables.setdefault("tools", None)
        variables.setdefault("documents", None)
        try:  # rendered piece by piece, so an output past MAX_RENDER_CHARS stops as soon as it gets there
            pieces, size = [], 0
            with bounded_work("the chat template"):
                for piece in self._template.generate(messages=messages, add_generation_prompt=add_generation_prompt,
                                                     **variables):
                    size += len(piece)
                    if size > MAX_RENDER_CHARS:
                        raise SpecrtError(f"the chat template's output exceeds {MAX_RENDER_CHARS} characters")
                    pieces.append(piece)
            return "".join(pieces)
        except SpecrtError:
            raise
        except RenderStopped as e:
            raise SpecrtError(str(e)) from None
        except jinja2.TemplateError as e:
            raise SpecrtError(f"chat template error: {clipped(str(e))}") from None
        except (MemoryError, RecursionError) as e:
            raise SpecrtError(f"chat template error: {type(e).__name__} while rendering") from None
        except Exception as e:  # noqa: BLE001 - a template from an artifact may raise anything (1/0, a TypeError)
            raise SpecrtError(f"chat template error: {type(e).__name__}: {clipped(str(e))}") from None

    def stream_decoder(self, skip_special_tokens: bool = False) -> "StreamDecoder":
        return StreamDecoder(self, skip_special_tokens=skip_special_tokens)


class StreamDecoder:
    """Incremental detokenizer: push new ids, get text deltas (prefix/read-offset technique).

    Text is held back while it ends in U+FFFD (an incomplete UTF-8 sequence from byte-level BPE),
    so the concatenated deltas plus `flush()` equal `decode(all_ids)`.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = False) -> None:
        self._tok = tokenizer
        self._skip = skip_special_tokens
        self.ids: list[int] = []
        self._prefix = 0  # start of the context window decoded for comparison
        self._read = 0  # ids before this are already emitted

    def _decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=self._skip)

    def push(self, new_ids: Iterable[int]) -> str:
        """Append `new_ids`; return the newly completed text ("" while a character is partial)."""
        self.ids.extend(int(i) for i in new_ids)
        prefix_text = self._decode(self.ids[self._prefix:self._read])
        new_text = self._decode(self.ids[self._prefix:])
        if len(new_text) > len(prefix_text) and not new_text.endswith("\ufffd"):
            self._prefix, self._read = self._read, len(self.ids)
            return new_text[len(prefix_text):]
        return ""

    def flush(self) -> str:
        """Emit whatever is held back (e.g. a genuinely invalid byte sequence at the end)."""
        prefix_text = self._decode(self.ids[self._prefix:self._read])
        new_text = self._decode(self.ids[self._prefix:])
        self._prefix, self._read = self._read, len(self.ids)
        return new_text[len(prefix_text):]
