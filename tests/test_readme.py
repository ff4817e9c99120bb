"""README.md: its contents list is its headings, and every link to a section of it lands on one."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def anchor(title: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces as dashes."""
    return re.sub(r"[^\w\- ]", "", title.lower()).replace(" ", "-")


def test_the_contents_list_is_the_headings_in_order():
    headings = [(len(m.group(1)), m.group(2)) for m in re.finditer(r"^(#{2,3}) (.+)$", README, re.M)
                if m.group(2) != "Contents"]
    contents = README.split("## Contents", 1)[1].split("\n## ", 1)[0]
    listed = [(2 + len(m.group(1)) // 2, m.group(2), m.group(3)) for m in
              re.finditer(r"^( *)- \[(.+?)\]\(#(.+?)\)$", contents, re.M)]
    assert [(level, title) for level, title, _ in listed] == headings
    assert all(target == anchor(title) for _, title, target in listed)


def anchors(text: str) -> set[str]:
    return {anchor(m.group(1)) for m in re.finditer(r"^#{1,6} (.+)$", text, re.M)}


def test_every_link_to_a_section_lands_on_a_heading():
    """In README.md and benchmarks/README.md, to their own sections and to each other's; and every relative file
    they link exists."""
    texts = {path: (ROOT / path).read_text() for path in ("README.md", "benchmarks/README.md")}
    for path, text in texts.items():
        assert sorted(set(re.findall(r"\]\(#([^)]+)\)", text)) - anchors(text)) == [], path
        for target, section in re.findall(r"\]\((?!https?:|#)([^)#\s]+)(?:#([^)\s]+))?\)", text):
            resolved = ((ROOT / path).parent / target).resolve()
            assert resolved.exists(), (path, target)
            if section:
                assert section in anchors(resolved.read_text()), (path, target, section)
