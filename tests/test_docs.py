"""User docs that are generated from data stay in step with it."""
from pathlib import Path

from tinyloop.modes import markdown_table

ROOT = Path(__file__).resolve().parents[1]


def test_mode_matrix_page_matches_the_data():
    assert markdown_table() in (ROOT / "docs" / "modes.md").read_text()


def test_readme_opens_with_the_two_commands_and_ci_runs_the_test_one():
    lines = [l for l in (ROOT / "README.md").read_text().splitlines() if l.startswith("bash ")]
    assert lines[:2] == ["bash scripts/run.sh", "bash scripts/test.sh"]
    ci = [l for l in (ROOT / ".ci" / "run").read_text().splitlines() if l.strip() and not l.startswith(("#", "set ", "cd "))]
    assert ci == ["bash scripts/test.sh"]
