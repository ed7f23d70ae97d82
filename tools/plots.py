"""Figures: a cost profile's plot (`specrt profile --plot`), and how every tool writes its PNGs."""
from __future__ import annotations

from pathlib import Path

from specrt.runtime.profile import Profile


def save_figure(fig, path: str | Path) -> Path:
    """Lay out, write as PNG (folders made) and close a matplotlib figure; the path written."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


def plot_profile(profile: Profile, path: str | Path) -> Path:
    """Verify cost against total verified tokens per batch size, and each head's draft call, in ms."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    for b, row in sorted(profile.verify.items()):
        ps = sorted(row)
        left.plot(ps, [row[p] for p in ps], marker="o", label=f"B = {b}")
    left.set(xlabel="verified tokens per call (packed, all slots)", ylabel="ms per target call",
             title="Verify cost (first point: a plain decoding step)")
    left.grid(alpha=0.3)
    left.legend()
    batches = sorted(profile.verify)
    right.plot(batches, [profile.step_ms(b) for b in batches], marker="s", color="k", label="decode step (target)")
    for head, row in sorted(profile.draft.items()):
        right.plot(sorted(row), [row[b] for b in sorted(row)], marker="o", label=f"{head} draft call")
    right.set(xlabel="slots B", ylabel="ms per call", title="Draft call against a decoding step")
    right.grid(alpha=0.3)
    right.legend()
    fig.suptitle(f"{profile.backend}, {profile.threads} threads, cache position {profile.position}, "
                 f"{profile.machine}", fontsize=9)
    return save_figure(fig, path)
