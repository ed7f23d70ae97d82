"""Run statistics every method reports: tokens, time split, and for speculative methods τ and acceptance."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class RunStats:
    method: str = "ar"
    requests: int = 0
    generated_tokens: int = 0
    decode_tokens: int = 0  # tokens produced by decode steps (the first token comes from prefill)
    steps: int = 0  # target calls after prefill (decode steps or verify rounds)
    prefill_s: float = 0.0
    decode_s: float = 0.0
    draft_s: float = 0.0
    verify_s: float = 0.0
    gamma: int = 0
    rounds: list[tuple[int, int, int]] = field(default_factory=list)  # (verify_len, accepted, committed)

    def add(self, other: "RunStats") -> None:
        """Sum another run's (a step's) counts and times into this one."""
        for name in ("generated_tokens", "decode_tokens", "steps", "prefill_s", "decode_s", "draft_s", "verify_s"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        self.rounds += other.rounds

    def acceptance(self) -> dict[str, list[float]]:
        """Per draft position k: P(accepted) over rounds that verified k, and P(accepted | k-1 accepted)."""
        uncond, cond = [], []
        for k in range(1, self.gamma + 1):
            tried = [a for ell, a, _ in self.rounds if ell >= k]
            reached = [a for a in tried if a >= k - 1]
            uncond.append(round(sum(a >= k for a in tried) / len(tried), 4) if tried else 0.0)
            cond.append(round(sum(a >= k for a in reached) / len(reached), 4) if reached else 0.0)
        return {"unconditional": uncond, "conditional": cond}

    def to_dict(self) -> dict:
        d = {"method": self.method, "requests": self.requests, "generated_tokens": self.generated_tokens,
             "steps": self.steps, "prefill_ms": round(self.prefill_s * 1e3, 3),
             "decode_s": round(self.decode_s, 4),
             "decode_tokens_per_s": round(self.decode_tokens / self.decode_s, 3) if self.decode_s else 0.0,
             "end_to_end_tokens_per_s": round(self.generated_tokens / (self.prefill_s + self.decode_s), 3)
             if self.prefill_s + self.decode_s else 0.0}
        if self.method != "ar":
            n = len(self.rounds)
            d.update(gamma=self.gamma, rounds=n,
                     tau=round(sum(c for _, _, c in self.rounds) / n, 4) if n else 0.0,
                     mean_verify_len=round(sum(ell for ell, _, _ in self.rounds) / n, 4) if n else 0.0,
                     per_position_acceptance=self.acceptance(),
                     draft_s=round(self.draft_s, 4), verify_s=round(self.verify_s, 4),
                     other_s=round(self.decode_s - self.draft_s - self.verify_s, 4))
        return d
