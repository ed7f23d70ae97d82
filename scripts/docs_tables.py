#!/usr/bin/env python3
"""Every benchmark table of the README and docs/, generated from the committed JSON results (never copied by hand).

A table is a block between two markers naming what it shows and the files it is made of:

    <!-- table: KIND FILE [FILE ...] -->
    ...generated...
    <!-- /table -->

    python scripts/docs_tables.py           # rewrite every block in README.md and docs/*.md
    python scripts/docs_tables.py --check   # exit 1 if any block differs from what its files give (a test runs this)

KINDS: `sets` (one `specrt bench` report: a row per prompt set, a column per engine; scripts/bench_table.py),
`versus` (the same report against each baseline), `acceptance` (conditional acceptance per draft position), `pooled` (each report's engines over all its prompts; with
several reports, one row per report and engine), `headline` (the README's: the fastest exact method and `ar`
against every baseline), `concurrency` (`specrt bench --concurrency`), `profile` (`specrt profile --json`: costs
in decoding steps), `parity` (`specrt parity --json`, one row per file), `ops` (`scripts/bench_ops.py --json`, the
files' figures side by side in each cell).
"""
from __future__ import annotations

import json
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_table import BASELINES, ci, table  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
BLOCK = re.compile(r"(<!-- table: (?P<spec>[^>]*?) -->\n)(?P<body>.*?)(<!-- /table -->)", re.S)


def _load(name: str) -> dict:
    return json.loads((ROOT / name).read_text())


def _speedup(row: dict) -> str:
    if row["method"] == "ar":
        return "1"
    if row.get("speedup_ci"):
        lo, hi = row["speedup_ci"]
        return f"{row['speedup']:.2f}x [{lo:.2f}, {hi:.2f}]"
    return f"{row['speedup']:.2f}x" if "speedup" in row else "–"


def _tau(row: dict) -> str:
    return f"{row['tau']:.2f}" if "tau" in row else "–"


def sets(files: list[str]) -> str:
    out = []
    for f in files:
        text = table(_load(f))
        out += [text.split("\n\nAgainst ")[0].strip(), text.rsplit("\n\n", 1)[1].strip()]  # the table, the run's line
    return "\n\n".join(out)


def versus(files: list[str]) -> str:
    out = []
    for f in files:
        parts = table(_load(f)).rsplit("\n\n", 1)[0].split("\n\nAgainst ")[1:]
        out += ["Against " + p.strip() for p in parts]
    return "\n\n".join(out)


def pooled(files: list[str]) -> str:
    reports = [(Path(f).stem, _load(f)) for f in files]
    baselines = [b for b in BASELINES if any(b in r.get("vs", {}) for _, rep in reports for r in rep["pooled"])]
    label = len(reports) > 1
    head = (["report"] if label else []) + ["engine", "decode tok/s", "τ", "vs ar"] + [f"vs {b}" for b in baselines] \
        + ["tokens", "identical to ar"]
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * label + "---|" + "---:|" * (len(head) - 2 - label) + "---|"]
    for stem, rep in reports:
        for r in rep["pooled"]:
            cells = ([stem] if label else []) + [r["method"], f"{r['tokens_per_s']:.1f}", _tau(r), _speedup(r)]
            cells += [ci(r.get("vs", {}).get(b)) if b != r["method"] else "–" for b in baselines]
            same = r.get("identical", rep["identical"]) if r["method"] not in BASELINES else "–"
            cells += [str(r["generated_tokens"]), str(same).lower()]
            out.append("| " + " | ".join(cells) + " |")
    return "\n".join(out)


def headline(files: list[str]) -> str:
    """Per report: specrt's `ar` and its fastest exact method against `ar` and every baseline, over all prompts."""
    out = []
    for f in files:
        rep = _load(f)
        rows = {r["method"]: r for r in rep["pooled"]}
        baselines = [b for b in BASELINES if b in rows]
        exact = [r for r in rep["pooled"] if r["method"] not in BASELINES and r["method"] != "ar"]
        best = max(exact, key=lambda r: r["tokens_per_s"])
        if not out:
            out = ["| run | engine | decode tok/s | vs specrt ar | " + " | ".join(f"vs {b}" for b in baselines) + " |",
                   "|---|---|---:|---:|" + "---:|" * len(baselines)]
        for r in (rows["ar"], best):
            cells = [Path(f).stem, f"specrt `{r['method']}`", f"{r['tokens_per_s']:.1f}", _speedup(r)]
            cells += [ci(r.get("vs", {}).get(b)) for b in baselines]
            out.append("| " + " | ".join(cells) + " |")
        for b in baselines:
            r = rows[b]
            out.append("| " + " | ".join([Path(f).stem, b, f"{r['tokens_per_s']:.1f}", _speedup(r)]
                                         + [ci(r.get("vs", {}).get(o)) if o != b else "1" for o in baselines]) + " |")
    return "\n".join(out)


def concurrency(files: list[str]) -> str:
    out = ["| report | in flight | method / scheduler | tok/s | per request | vs best of ar and fixed | verified drafts | τ |",
           "|---|---:|---|---:|---:|---:|---:|---:|"]
    for f in files:
        for r in _load(f)["rows"]:
            label = r["method"] if r["method"] == "ar" else f"{r['method']} / {r['scheduler']}"
            out.append(f"| {Path(f).stem} | {r['concurrency']} | {label} | {r['tokens_per_s']:.1f} | "
                       f"{r['per_request_tokens_per_s']:.1f} | {r['vs_best_of_ar_and_fixed']:.2f}x | "
                       f"{r['mean_verify_len']:.2f} | {r['tau']:.2f} |")
    return "\n".join(out)


def profile(files: list[str]) -> str:
    out = []
    for f in files:
        p = _load(f)
        steps = p["in_steps"]
        tokens = sorted(steps["verify_steps"], key=int)
        out += [f"{Path(f).stem}: {p['backend']}, {p['threads']} threads, a decoding step {steps['step_ms']:.1f} ms "
                f"at position {p['position']}", "",
                "| verified tokens | " + " | ".join(tokens) + " | " + " | ".join(f"{h} draft call" for h in
                                                                        steps["draft_steps"]) + " |",
                "|---|" + "---:|" * (len(tokens) + len(steps["draft_steps"])),
                "| cost (decoding steps) | " + " | ".join(f"{steps['verify_steps'][t]:.2f}" for t in tokens) + " | "
                + " | ".join(f"{v:.2f}" for v in steps["draft_steps"].values()) + " |", ""]
    return "\n".join(out).strip()


def parity(files: list[str]) -> str:
    out = ["| weights | prompts | greedy identical to transformers | first divergence (min / mean token) | "
           "largest logit difference (max / mean over prompts) |", "|---|---:|---:|---:|---:|"]
    for f in files:
        p = _load(f)
        out.append(f"| {Path(f).stem.removeprefix('parity_')} | {p['prompts']} | {p['identical']}/{p['prompts']} | "
                   f"{p['first_divergence_min']} / {p['first_divergence_mean']} | "
                   f"{p['max_abs_logit_diff']:.3g} / {p['mean_max_abs_logit_diff']:.3g} |")
    return "\n".join(out)


def acceptance(files: list[str]) -> str:
    """Conditional acceptance per draft position of every speculative engine, pooled over a report's prompts."""
    out = []
    for f in files:
        rows = [r for r in _load(f)["pooled"] if "per_position_acceptance" in r]
        k = max(len(r["per_position_acceptance"]["conditional"]) for r in rows)
        out += ["| engine | " + " | ".join(f"position {i + 1}" for i in range(k)) + " |", "|---|" + "---:|" * k]
        out += ["| " + r["method"] + " | " + " | ".join(f"{a:.2f}" for a in r["per_position_acceptance"]["conditional"])
                + " |" for r in rows]
    return "\n".join(out)


def ops(files: list[str]) -> str:
    """`scripts/bench_ops.py --json` reports: median microseconds per call of each op (the scalar reference left
    out), a row per weight shape and M, the reports' figures side by side in a cell."""
    reps = [_load(f)["rows"] for f in files]
    names = [o for o in dict.fromkeys(r["op"] for r in reps[0]) if "scalar" not in o]
    cells = [{(r["shape"], r["M"], r["op"]): r["us"] for r in rows} for rows in reps]
    out = ["| shape | M | " + " | ".join(names) + " |", "|---|---:|" + "---:|" * len(names)]
    for shape, m in dict.fromkeys((r["shape"], r["M"]) for r in reps[0]):
        row = [" / ".join(f"{c[(shape, m, o)]:.1f}" for c in cells) if (shape, m, o) in cells[0] else "" for o in names]
        out.append(f"| {shape} | {m} | " + " | ".join(row) + " |")
    return "\n".join(out)


KINDS = {"acceptance": acceptance, "sets": sets, "versus": versus, "pooled": pooled, "headline": headline, "concurrency": concurrency,
         "profile": profile, "parity": parity, "ops": ops}


def render(text: str, where: str) -> str:
    def one(m: re.Match) -> str:
        kind, *files = m["spec"].split()
        if kind not in KINDS or not files:
            raise SystemExit(f"{where}: bad table marker {m['spec']!r} (kinds: {', '.join(KINDS)})")
        return m.group(1) + KINDS[kind](files) + "\n" + m.group(4)
    return BLOCK.sub(one, text)


def pages() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def main(argv: list[str]) -> int:
    check = "--check" in argv
    stale = []
    for page in pages():
        text = page.read_text()
        new = render(text, str(page.relative_to(ROOT)))
        if new != text:
            stale.append(str(page.relative_to(ROOT)))
            if not check:
                page.write_text(new)
    if check and stale:
        print(f"tables out of date in {', '.join(stale)}: run python scripts/docs_tables.py", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
