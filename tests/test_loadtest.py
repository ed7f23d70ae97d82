"""`specrt loadtest` against a real server: every request completes, streams equal direct engine runs token for
token, hang-ups are aborted and their slots freed. (A correctness check; its timings are not asserted.)"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from serving import running_server
from specrt.cli import main

pytestmark = pytest.mark.slow

PROMPTS = Path(__file__).parent / "fixtures" / "prompts_smoke.jsonl"


def test_loadtest_loses_nothing(served_art):
    with running_server(served_art, "--method", "dspark", "--scheduler", "fixed", "--threads", "1") as url:
        r = CliRunner().invoke(main, ["loadtest", url, "--clients", "6", "--duration", "8", "--max-tokens", "24",
                                      "--prompts", str(PROMPTS), "--limit", "3", "--disconnect-every", "3",
                                      "--verify", str(served_art), "--json"])
    assert r.exit_code == 0, r.output
    report = json.loads(r.output.strip().splitlines()[-1])
    assert report["ok"], report
    # every client starts at least one request; every third request hangs up (how many more start is timing)
    assert report["requests"] >= 6 and report["hung_up"] == report["requests"] // 3
    assert report["completed"] == report["requests"] - report["hung_up"]
    assert report["errors"] == [] and report["incomplete"] == 0
    assert report["active_slots_after"] == 0 and report["aborted"] >= report["hung_up"]
    bad = report["bad_requests"]  # sent alongside the load; every one refused with a 4xx
    assert bad["sent"] >= 5 and bad["refused"] == bad["sent"]
    assert bad["statuses"]["unknown model"] == [404] and bad["statuses"]["malformed JSON"] == [400]
    v = report["verify"]
    assert v["mismatches"] == 0 and v["checked"] == report["completed"] and v["distinct_requests"] <= 3
    assert 0 < report["output_tokens"] <= 24 * report["completed"]


def test_loadtest_bad_url():
    r = CliRunner().invoke(main, ["loadtest", "http://127.0.0.1:9", "--duration", "1"])
    assert r.exit_code == 1 and "cannot reach http://127.0.0.1:9" in r.output and "Traceback" not in r.output
