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


def section(title: str) -> str:
    """The text of README's `## title` section."""
    return README.split(f"\n## {title}\n", 1)[1].split("\n## ", 1)[0]


@pytest.mark.slow
def test_the_five_minute_path_runs_as_written(ray_cluster, tmp_path):
    """README's "Five minutes with your own data", command by command, in a fresh directory holding the files it
    names in their real formats (an open_clip TSV, COCO captions JSON, a query image): imports, check, two trained
    versions, promote, `clipstream serve` in the background, the searches and the encode, and the Python snippet.
    Beside another Ray (this session's), which its own local Rays neither join nor disturb; each `train` quiet by
    default (clipstream's lines only: Ray's, Ray Data's and DeepSpeed's logs in the log file it names, nothing after
    its last line); no process of its own left when it is done."""
    import json as json_module
    import os
    import signal
    import subprocess
    import sys
    import time

    from PIL import Image

    from clipstream.benchmarks.first_run import still_running
    from clipstream.runtime import free_port
    from clipstream.settings import Settings

    text = section("Five minutes with your own data")
    colours = {"red": (200, 30, 30), "blue": (30, 30, 200), "green": (30, 160, 30), "black": (10, 10, 10)}

    def picture(path, colour, k):  # a square of the colour in a shade of its own, a white mark where k puts it
        path.parent.mkdir(parents=True, exist_ok=True)
        image = Image.new("RGB", (32, 32), tuple(min(255, c + k) for c in colours[colour]))
        image.paste((255, 255, 255), (k % 6 * 5, k // 6 % 6 * 5, k % 6 * 5 + 4, k // 6 % 6 * 5 + 4))
        image.save(path)

    rows = []  # 80 pairs a source: 72 to train, enough for a step of 2 workers x the preset's micro batch of 32
    for k in range(80):
        colour = list(colours)[k % 4]
        picture(tmp_path / f"kitchen/{k}.jpg", colour, k)
        rows.append(f"kitchen/{k}.jpg\ta {colour} kettle on a stove")
    (tmp_path / "kitchen.tsv").write_text("filepath\ttitle\n" + "\n".join(rows) + "\n")
    images, annotations = [], []
    for k in range(80):
        colour = list(colours)[(k + 1) % 4]
        picture(tmp_path / f"train2017/{k:012d}.jpg", colour, k)
        images.append({"id": k, "file_name": f"{k:012d}.jpg", "width": 32, "height": 32})
        annotations.append({"id": 100 + k, "image_id": k, "caption": f"a {colour} cup on a table"})
    (tmp_path / "annotations").mkdir()
    (tmp_path / "annotations/captions_train2017.json").write_text(json_module.dumps(
        {"images": images, "annotations": annotations}))
    picture(tmp_path / "query.jpg", "red", 0)

    port = free_port()
    settings = Settings(home=tmp_path / "home", grpc_port=port)
    env = {**{k: v for k, v in os.environ.items() if not k.startswith(("CLIPSTREAM_", "RAY_"))}, **settings.env(),
           "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    env.pop("CLIPSTREAM_SERVER", None)  # (the default: this machine's grpc_port)
    server = None
    try:
        for argv in commands(text):
            if argv[0] == "serve":
                server = subprocess.Popen(["clipstream", *argv], cwd=tmp_path, env=env, stdout=subprocess.DEVNULL,
                                          stderr=subprocess.DEVNULL, start_new_session=True)
                deadline = time.monotonic() + 300
                while subprocess.run(["clipstream", "health"], cwd=tmp_path, env=env,
                                     capture_output=True).returncode != 0:
                    assert server.poll() is None and time.monotonic() < deadline, "clipstream serve did not come up"
                    time.sleep(2)
                continue
            done = subprocess.run(["clipstream", *argv], cwd=tmp_path, env=env, capture_output=True, text=True,
                                  timeout=900)
            assert done.returncode == 0, f"clipstream {' '.join(argv)}: {done.stderr[-2000:]}"
            if argv[0] == "train":
                quiet(done, settings.home)
            if argv[0] == "search":
                assert "kettle" in done.stdout or "cup" in done.stdout or "kitchen" in done.stdout, done.stdout
        snippet = text.split("```python\n", 1)[1].split("```", 1)[0].replace("127.0.0.1:9000", f"127.0.0.1:{port}")
        done = subprocess.run([sys.executable, "-c", snippet + "\nprint(len(hits), vectors.shape)"], cwd=tmp_path,
                              env=env, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-2000:]
        assert done.stdout.split()[0] == "5"
    finally:
        if server is not None:  # SIGTERM, as Kubernetes stops a pod: the command's own clean exit
            os.killpg(server.pid, signal.SIGTERM)
            assert server.wait(timeout=120) == 0
    assert still_running(f"CLIPSTREAM_HOME={settings.home}\0") == []  # (those that exit within seconds aside)
    # this session's Ray, running all along, was neither joined nor disturbed
    assert ray_cluster.get(ray_cluster.remote(lambda: 41 + 1).remote()) == 42


def quiet(done, home) -> None:
    """A `clipstream train` that printed clipstream's lines only, its last line its last, its libraries' logs in
    the file it named."""
    printed = done.stdout.splitlines() + [line for line in done.stderr.replace("\r", "\n").splitlines()
                                          if line.strip() and not line.startswith("clipstream: Ray, DeepSpeed and ")]
    log = Path(done.stderr.split("clipstream: Ray, DeepSpeed and MLflow log to ", 1)[1].split()[0])
    assert log.parent == home / "logs" and log.is_file()
    assert done.stdout.rstrip().splitlines()[-1].startswith("heatmap: ") and len(done.stdout.splitlines()) < 40
    for noise in ("Reporting training result", "DeepSpeed", "ray.data", "Started a local Ray instance", "Traceback",
                  "multiple active Ray instances", "WARNING"):
        assert not any(noise in line for line in printed), f"{noise!r} printed: {[x for x in printed if noise in x]}"
    logged = log.read_text(errors="replace")
    assert "Setting accelerator to CPU" in logged  # DeepSpeed's own line (a logger bound to stdout) went to the file
    assert "multiple active Ray instances" not in logged
