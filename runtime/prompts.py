"""Prompt inputs: text through the chat template, raw ids, and `{"turns": [...]}` JSONL files."""
from __future__ import annotations

import gzip
import json
from pathlib import Path

from specrt.errors import SpecrtError
from specrt.runtime.tokenizer import Tokenizer


NO_TOKENIZER = "this artifact has no tokenizer (its model had none)"


def read_prompts_file(path: str | Path, limit: int | None = None) -> list[str]:
    """First turn of each `{"turns": [...]}` line (the format of the prompt sets in datasets/; a `.gz` file is read
    through gzip)."""
    return [text for _, text in read_prompt_lines(path, limit)]


def read_prompt_lines(path: str | Path, limit: int | None = None) -> list[tuple[int, str]]:
    """(line number, first turn) of each `{"turns": [...]}` line, so errors can name the line."""
    return [(lineno, turns[0]) for lineno, turns in _rows(path, limit, conversations=False)]


def read_conversations(path: str | Path, limit: int | None = None) -> list[tuple[str, ...]]:
    """Each line's conversation up to its last user turn: (user, assistant, ..., user). A line with `"replies"`
    (the assistant's answers to all but its last turn) is a multi-turn prompt; one without is its first turn."""
    return [turns for _, turns in _rows(path, limit, conversations=True)]


def _rows(path: str | Path, limit: int | None, *, conversations: bool) -> list[tuple[int, tuple[str, ...]]]:
    p = Path(path)
    if limit is not None and limit < 1:
        raise SpecrtError(f"--limit must be >= 1, got {limit}")
    if not p.is_file():
        raise SpecrtError(f"prompts file not found: {p}")
    prompts: list[tuple[int, tuple[str, ...]]] = []
    try:
        data = p.read_bytes()
        text = (gzip.decompress(data) if p.suffix == ".gz" else data).decode("utf-8")
    except (OSError, EOFError, UnicodeDecodeError) as e:
        raise SpecrtError(f"cannot read prompts file {p}: {e}") from None
    for lineno, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            turns, replies = row["turns"], row.get("replies") if conversations else None
            if not isinstance(turns, list):  # a bare string would yield its first character
                raise TypeError
            turn = turns[0]
        except (json.JSONDecodeError, KeyError, IndexError, TypeError, AttributeError):
            raise SpecrtError(f"{p}:{lineno}: expected a JSON object with a non-empty \"turns\" list") from None
        if not isinstance(turn, str):
            raise SpecrtError(f"{p}:{lineno}: turns[0] must be a string")
        if replies is None:
            prompts.append((lineno, (turn,)))
        else:
            if not (isinstance(replies, list) and len(replies) == len(turns) - 1
                    and all(isinstance(t, str) for t in turns + replies)):
                raise SpecrtError(f"{p}:{lineno}: \"replies\" must be one string per turn but the last")
            prompts.append((lineno, tuple(t for pair in zip(turns, replies + [None]) for t in pair if t is not None)))
        if limit is not None and len(prompts) >= limit:
            break
    if not prompts:
        raise SpecrtError(f"{p} has no prompts")
    return prompts


def parse_input_ids(text: str) -> list[int]:
    try:
        ids = [int(t) for t in text.replace(" ", "").split(",") if t != ""]
    except ValueError:
        raise SpecrtError(f"--input-ids must be comma-separated integers, got {text!r}") from None
    if not ids:
        raise SpecrtError("--input-ids is empty")
    return ids


def encode_conversation(tokenizer: Tokenizer | None, turns: tuple[str, ...] | list[str]) -> list[int]:
    """Token ids for a conversation (user, assistant, ..., user) through the chat template, with a generation
    prompt; one turn is `encode_prompt`'s."""
    if len(turns) == 1:
        return encode_prompt(tokenizer, turns[0])
    if tokenizer is None:
        raise SpecrtError(f"{NO_TOKENIZER}, and text prompts need one: export from a model that has a tokenizer")
    if not tokenizer.chat_template:
        raise SpecrtError("a multi-turn prompt needs a chat template, and this artifact's tokenizer has none")
    messages = [{"role": ("user", "assistant")[i % 2], "content": t} for i, t in enumerate(turns)]
    return tokenizer.encode(tokenizer.apply_chat_template(messages, add_generation_prompt=True),
                            add_special_tokens=False)


def encode_prompt(tokenizer: Tokenizer | None, text: str, *, raw: bool = False) -> list[int]:
    """Token ids for a user message: chat template with a generation prompt unless `raw`."""
    if tokenizer is None:
        raise SpecrtError(f"{NO_TOKENIZER}, and text prompts need one: export from a model that has a tokenizer")
    if not raw and tokenizer.chat_template:
        text = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
    return tokenizer.encode(text, add_special_tokens=raw)
