"""README.md: its contents list is its headings, and every link to a section of it lands on one."""

import re
from pathlib import Path

README = (Path(__file__).resolve().parents[1] / "README.md").read_text()


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


def test_every_link_to_a_section_lands_on_a_heading():
    anchors = {anchor(m.group(1)) for m in re.finditer(r"^#{1,6} (.+)$", README, re.M)}
    assert sorted(set(re.findall(r"\]\(#([^)]+)\)", README)) - anchors) == []
