"""README.md: its contents list is its headings, every link lands (on a section, on a file), and every command it shows
is one the CLI accepts; the same for benchmarks/README.md and k8s/README.md where they apply."""

import re
from pathlib import Path

import pytest

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


def commands(text: str) -> list[list[str]]:
    """Every `clipstream ...` command in the shell blocks of `text`: a line's own, or what follows `--` (a `ray job
    submit`), up to a pipe, `&&`, `;` or `&`, without its redirections; continuation lines joined, comments dropped."""
    import shlex

    found = []
    for block in re.findall(r"```(?:bash|sh)\n(.*?)```", text, re.S):
        for line in re.sub(r"\\\n\s*", " ", block).splitlines():
            tokens = shlex.split(line, comments=True)
            segment: list[str] = []
            redirected = False
            for token in [*tokens, "|"]:
                if token in (">", ">>", "2>", "<"):
                    redirected = True
                elif token in ("|", "&&", ";", "&"):
                    start = next((i for i, t in enumerate(segment) if t == "clipstream" and (i == 0 or segment[i - 1] == "--")),
                                 None)
                    if start is not None:
                        found.append(segment[start + 1:])
                    segment, redirected = [], False
                elif not redirected:
                    segment.append(token)
    return found


@pytest.mark.parametrize("path", ["README.md", "benchmarks/README.md", "k8s/README.md"])
def test_every_clipstream_command_the_docs_show_is_one_the_cli_accepts(path):
    """A renamed command or option leaves no example behind: each parses with the CLI's own parser."""
    from clipstream.cli.parser import parser

    shown = commands((ROOT / path).read_text())
    assert shown or path == "benchmarks/README.md"
    refused = []
    for argv in shown:
        try:
            parser().parse_args(argv)
        except SystemExit:
            refused.append(" ".join(["clipstream", *argv]))
    assert refused == []
