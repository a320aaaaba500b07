"""The README as a landing page: short, its example runs, its two commands are what CI runs, and every link of
the README and of docs/ points at something that exists."""

from __future__ import annotations

import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))


def _blocks(text: str, lang: str) -> list[str]:
    return re.findall(r"```" + lang + r"\n(.*?)```", text, flags=re.S)


def test_readme_is_a_landing_page():
    text = README.read_text(encoding="utf-8")
    assert len(text.splitlines()) <= 200
    for heading in ("## Two commands", "## In 30 seconds", "## Headline", "## Where to go next"):
        assert heading in text


def test_readme_example_runs():
    (example,) = _blocks(README.read_text(encoding="utf-8"), "python")
    exec(compile(example, "README.md", "exec"), {})     # its asserts check the bytes moved


def test_readme_commands_are_what_ci_runs():
    """The README's two commands set up with scripts/setup.sh; CI runs the same set-up and the same test command,
    and checks the generated spec."""
    commands = _blocks(README.read_text(encoding="utf-8"), "bash")
    assert commands[0].strip() == "./scripts/setup.sh && .venv/bin/kvlayout conformance"
    setup, test = commands[1].strip().split(" && ")
    ci = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()
          if line.strip() and not line.lstrip().startswith("#")]
    assert setup in ci and test in ci and ci.index(setup) < ci.index(test)
    assert ".venv/bin/kvlayout spec --check" in ci


def _slug(heading: str) -> str:
    """GitHub's anchor of a Markdown heading."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def _anchors(path: pathlib.Path) -> set[str]:
    text = re.sub(r"```.*?```", "", path.read_text(encoding="utf-8"), flags=re.S)
    return {_slug(m) for m in re.findall(r"^#{1,6} (.+)$", text, flags=re.M)}


@pytest.mark.parametrize("page", [README] + DOCS, ids=lambda p: p.name)
def test_links_resolve(page):
    text = re.sub(r"```.*?```", "", page.read_text(encoding="utf-8"), flags=re.S)
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+://", target):
            continue
        path, _, anchor = target.partition("#")
        where = page if not path else (page.parent / path).resolve()
        assert where.exists(), f"{page.name}: {target}"
        if anchor and where.suffix == ".md":
            assert anchor in _anchors(where), f"{page.name}: {target}"
