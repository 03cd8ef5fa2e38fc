"""The README stays short and opens with the two commands; every relative link in it and in docs/ leads somewhere.

The README is what a user reads first: a size limit keeps the long explanations in `docs/`, where the README links
to each of them. A link is checked as GitHub resolves it, relative to the file that holds it; text in code blocks
and code spans is not a link.
"""

from __future__ import annotations

import re
from pathlib import Path
from urllib.parse import unquote

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
DOCS = sorted((REPO / "docs").glob("*.md"))
README_LIMIT_BYTES = 15_000
OPENING_COMMANDS = ["bash scripts/demo.sh", "bash scripts/test.sh"]

_FENCED_BLOCK = re.compile(r"^```.*?^```", re.DOTALL | re.MULTILINE)
_CODE_SPAN = re.compile(r"`[^`\n]*`")
_LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
_NOT_RELATIVE = ("http://", "https://", "mailto:", "#")


def relative_links(markdown: str) -> list[str]:
    """The targets of the Markdown links outside code, leaving out web addresses and links within the page."""
    prose = _CODE_SPAN.sub("", _FENCED_BLOCK.sub("", markdown))
    return [target for target in _LINK.findall(prose) if not target.startswith(_NOT_RELATIVE)]


def test_the_readme_fits_on_a_screen_or_two():
    size = len(README.read_bytes())
    assert size <= README_LIMIT_BYTES, (
        f"README.md is {size:,} bytes, over {README_LIMIT_BYTES:,}: move the longer explanations into docs/ and "
        "link them"
    )


def test_the_readme_opens_with_the_two_commands():
    first_block = _FENCED_BLOCK.search(README.read_text())
    assert first_block, "README.md has no code block"
    lines = first_block.group(0).splitlines()
    assert lines[0] == "```bash", f"README.md's first code block is {lines[0]!r}, not the bash block of its commands"
    commands = [line.split("#")[0].strip() for line in lines[1:-1]]
    assert commands == OPENING_COMMANDS, f"README.md opens with {commands}, not {OPENING_COMMANDS}"


def test_the_link_finder_reads_links_outside_code_only():
    markdown = "See [a](docs/a.md), [b](https://x.org) and [c](#c).\n`[d](d.md)`\n```\n[e](e.md)\n```\n"
    assert relative_links(markdown) == ["docs/a.md"]


def test_every_relative_link_leads_to_a_file_in_the_repository():
    broken = [
        f"{page.relative_to(REPO)}: {target}"
        for page in (README, *DOCS)
        for target in relative_links(page.read_text())
        if not (page.parent / unquote(target.split("#")[0])).exists()
    ]
    assert not broken, f"links to paths that do not exist: {broken}"


def test_the_readme_links_every_docs_page():
    linked = {(REPO / unquote(target.split("#")[0])).resolve() for target in relative_links(README.read_text())}
    unlinked = [str(page.relative_to(REPO)) for page in DOCS if page.resolve() not in linked]
    assert not unlinked, f"README.md never links {unlinked}: add each to its list of docs"
