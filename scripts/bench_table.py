#!/usr/bin/env python3
"""Markdown tables from `specrt bench --json` reports, so the README's figures are generated, never copied by hand.

    python scripts/bench_table.py docs/measure/run1.json [docs/measure/run2.json ...]

One table per report: a row per prompt set and one for all, a column per engine with its decode tokens/s, its
speedup over specrt `ar` (median of the paired per-prompt ratios, 95% bootstrap interval) and τ; then, per
baseline, every engine's speedup over it; then the report's quiet-machine line. With several reports, a last
table puts each engine's pooled τ and speedup side by side across them.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

BASELINES = ("llama.cpp", "openvino", "openvino-lookup", "hf")


def ci(c: dict | None) -> str:
    return "–" if not c else f"{c['median']:.2f}x [{c['low']:.2f}, {c['high']:.2f}]"


def speedup(row: dict) -> str:
    if row["method"] == "ar":
        return "1"
    if not row.get("speedup_ci"):
        return "–"
    lo, hi = row["speedup_ci"]
    return f"{row['speedup']:.2f}x [{lo:.2f}, {hi:.2f}]"


def table(report: dict) -> str:
    sets = [(d["dataset"], d["results"]) for d in report["datasets"]] + [("all", report["pooled"])]
    engines = [r["method"] for r in report["pooled"]]
    baselines = [b for b in BASELINES if b in engines]
    out = ["| set | " + " | ".join(engines) + " |", "|---|" + "---:|" * len(engines)]
    for name, rows in sets:
        by = {r["method"]: r for r in rows}
        cells = []
        for e in engines:
            r = by[e]
            tau = f", τ {r['tau']:.2f}" if "tau" in r else ""
            cells.append(f"{r['tokens_per_s']:.1f} tok/s{tau}<br>{speedup(r)}")
        out.append(f"| {name} | " + " | ".join(cells) + " |")
    for b in baselines:
        out += ["", f"Against {b} (median ratio of decode rates over the tokens both generated, 95% interval):", "",
                "| set | " + " | ".join(e for e in engines if e != b) + " |",
                "|---|" + "---:|" * (len(engines) - 1)]
        for name, rows in sets:
            by = {r["method"]: r for r in rows}
            out.append(f"| {name} | " + " | ".join(ci(by[e]["vs"].get(b)) for e in engines if e != b) + " |")
    q, m = report["quiet"], report["machine"]
    tokens = {r["method"]: r["generated_tokens"] for r in report["pooled"]}
    out += ["", f"{report['prompts']} prompts x {report['repeats']} passes, {report['max_new_tokens']} new tokens, "
            f"interleaved; {m['cpu']}, {m['cores']} cores; generated tokens per pass: "
            + ", ".join(f"{k} {v}" for k, v in tokens.items())
            + f"; other processes {q['other_cores_mean']} cores on average (max {q['other_cores_max']} in a "
            f"{q.get('window_s', 0.5)} s window), idle engines {q['idle_engines_cpu_s']} CPU s, "
            f"{'quiet' if q['quiet'] else 'NOT quiet: ' + q.get('warning', '')}; identical: {report['identical']}."]
    return "\n".join(out)


def across(reports: list[tuple[str, dict]]) -> str:
    engines = [r["method"] for r in reports[0][1]["pooled"]]
    out = ["| engine | " + " | ".join(name for name, _ in reports) + " |", "|---|" + "---:|" * len(reports)]
    for e in engines:
        cells = []
        for _, rep in reports:
            r = next((x for x in rep["pooled"] if x["method"] == e), None)
            if r is None:
                cells.append("–")
                continue
            tau = f"τ {r['tau']:.3f}, " if "tau" in r else ""
            ll = f"; vs llama.cpp {ci(r['vs'].get('llama.cpp'))}" if r["vs"].get("llama.cpp") else ""
            cells.append(f"{tau}{r['tokens_per_s']:.1f} tok/s, vs ar {speedup(r)}{ll}")
        out.append(f"| {e} | " + " | ".join(cells) + " |")
    return "\n".join(out)


def main(paths: list[str]) -> None:
    reports = [(Path(p).stem, json.loads(Path(p).read_text())) for p in paths]
    for name, rep in reports:
        print(f"#### {name}\n\n{table(rep)}\n")
    if len(reports) > 1:
        print(f"#### side by side\n\n{across(reports)}")


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    main(sys.argv[1:])
