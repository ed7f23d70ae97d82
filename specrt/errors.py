"""User-facing errors: the CLI prints these as one line and exits non-zero."""
from __future__ import annotations

from typing import Any


class SpecrtError(Exception):
    """A problem with the user's input (paths, checkpoints, artifacts, prompts, flags)."""


def clipped(text: str, n: int = 200) -> str:
    """The first line of `text`, at most `n` characters of it: a message quotes what it was given, which may be
    megabytes (saying how long it was)."""
    line = text.splitlines()[0] if text else ""
    return line if len(line) <= n else f"{line[:n]}...({len(line)} characters)"


def quoted(value: Any, n: int = 60) -> str:
    """`value` as a message quotes it: its repr, clipped."""
    try:
        return clipped(repr(value), n)
    except ValueError:  # an int past Python's 4,300 digits has no repr
        return f"an integer of about {value.bit_length() * 0.30103:.0f} digits"
