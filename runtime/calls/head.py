"""What every draft head's call shares: its context rows, sampling inputs and the truncation op's settings."""
from __future__ import annotations

from dataclasses import dataclass
from specrt import artifact as io
from specrt.runtime.arrays import Array, device, namespace


@dataclass
class ContextRows:
    """Slots' pending context rows, padded: row i holds `rows[i]` target positions start[i], start[i] + 1, ...

    features [B, c, F'] (the head's feature columns), next_tokens [B, c] (the token after each position: MTP pairs
    h_t with x_{t+1}), start [B], rows [B]; entries past rows[i] are ignored by the head (they land in its cache
    past its valid length, as a target's rejected drafts do)."""

    features: Array
    next_tokens: Array
    start: Array
    rows: Array


def positions(start: Array, width: int) -> Array:
    """[B, width]: start[i], start[i] + 1, ... (the positions of a row of `width` cells)."""
    xp = namespace(start)
    return start[:, None] + xp.arange(width, dtype=start.dtype, device=device(start))


def settings(feeds: dict[str, Array], *, temperature: Array | float = 0.0, noise: Array | float = 0.0,
             threshold: float = 0.0, budget: int = -1) -> None:
    """Sampling inputs (temperature [B], 0 = argmax drafts; noise [B, K] uniforms for sampled drafts) and, where the
    head has a confidence head, specrt::ConfidenceTruncate's threshold and budget (0 and -1: report survival only,
    cut nothing)."""
    feeds[io.TEMPERATURE][...] = temperature
    feeds[io.NOISE][...] = noise
    if io.TRUNCATE_BUDGET in feeds:
        feeds[io.TRUNCATE_THRESHOLD][...] = threshold
        feeds[io.TRUNCATE_BUDGET][...] = budget
