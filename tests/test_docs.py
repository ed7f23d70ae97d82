"""The README and the documentation site: the site builds with no broken link or reference (`mkdocs build
--strict`), every benchmark table is what scripts/docs_tables.py makes of the committed JSON, the README stays short,
and CI runs exactly the README's test command."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_site_builds_strictly(tmp_path):
    r = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(ROOT / "mkdocs.yml"),
                        "-d", str(tmp_path / "site")], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert (tmp_path / "site" / "architecture" / "index.html").is_file()


def test_a_broken_link_fails_the_build(tmp_path):
    """The check can fail: a page linking to a page that does not exist stops a strict build."""
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "index.md").write_text("# x\n\nSee [the missing page](missing.md).\n")
    cfg = tmp_path / "mkdocs.yml"
    cfg.write_text((ROOT / "mkdocs.yml").read_text().split("nav:")[0] + "nav:\n  - Home: index.md\n"
                   + "validation:\n  links:\n    not_found: warn\n")
    r = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(cfg), "-d", str(tmp_path / "s")],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode != 0 and "missing.md" in r.stdout + r.stderr


def test_tables_are_generated_from_the_committed_results():
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "docs_tables.py"), "--check"], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    pages = [ROOT / "README.md", *(ROOT / "docs").glob("*.md")]
    assert sum(p.read_text().count("<!-- table: ") for p in pages) >= 10


def test_readme_is_short_and_ci_runs_its_test_command():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 300
    command = "pip install -q -c requirements/ci.lock -e '.[cpu,test]' && python -m pytest -q"
    assert command in readme
    assert (ROOT / ".ci" / "run").read_text().rstrip().endswith(command)
