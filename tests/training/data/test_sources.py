"""`clipstream data fetch`: open image sets from an npm registry (a loopback one serving tarballs in the real
layout), pinned by integrity, cached whole or not at all, checked on every read, never changed by an error."""

import base64
import hashlib
import http.server
import io
import json
import os
import socket
import tarfile
import threading

import pytest
from PIL import Image

from clipstream import console
from clipstream.cli import main
from clipstream.settings import Settings
from clipstream.training.data import sources
from clipstream.training.data.sources import SOURCES, Package, RegistryError, Source, SourceError, fetch, package_dir

EMOJI = [{"unified": "1F600", "short_name": "grinning", "category": "Smileys & Emotion", "image": "1f600.png"},
         {"unified": "1F431", "short_name": "cat", "category": "Animals & Nature", "image": "1f431.png"}]


def _png(k: int) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGBA", (16, 16), (60 * k % 255, 120, 200, 255)).save(buffer, format="PNG")
    return buffer.getvalue()


def _tarball(files: dict[str, bytes]) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as tar:
        for name, data in files.items():
            info = tarfile.TarInfo(f"package/{name}")
            info.size, info.mode = len(data), 0o644
            tar.addfile(info, io.BytesIO(data))
    return buffer.getvalue()


def _integrity(data: bytes) -> str:
    return "sha512-" + base64.b64encode(hashlib.sha512(data).digest()).decode()


IMAGES = _tarball({"emoji.json": json.dumps(EMOJI).encode(), "LICENSE": b"The MIT License (MIT)\n",
                   **{f"img/mini/64/{e['image']}": _png(k) for k, e in enumerate(EMOJI)}})
TAGS = _tarball({"icons.json": json.dumps({"cat": {"name": "cat", "tags": ["pet"]}}).encode()})
MINI = Source("mini", (Package("mini-emoji", "1.0.0", _integrity(IMAGES)), Package("@acme/tags", "2.0.0", _integrity(TAGS))),
              "CC-BY-4.0 (graphics)", "Mini emoji by the tests", "https://example.org/mini")


def _closed_port() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


@pytest.fixture
def registry(tmp_path):
    """An npm registry on loopback serving MINI's tarballs at npm's tarball paths (a scoped one among them)."""
    root = tmp_path / "registry"
    for path, data in (("mini-emoji/-/mini-emoji-1.0.0.tgz", IMAGES), ("@acme/tags/-/tags-2.0.0.tgz", TAGS)):
        (root / path).parent.mkdir(parents=True)
        (root / path).write_bytes(data)

    class Quiet(http.server.SimpleHTTPRequestHandler):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, directory=str(root), **kwargs)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Quiet)
    thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()
    thread.join()


@pytest.fixture
def home(tmp_path, monkeypatch, registry):
    """Settings of a home under tmp_path whose registry is the loopback one, as a command sees them; MINI a source."""
    monkeypatch.chdir(tmp_path)
    for name in [n for n in os.environ if n.startswith("CLIPSTREAM_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("CLIPSTREAM_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("CLIPSTREAM_NPM_REGISTRY", registry)
    monkeypatch.setitem(SOURCES, "mini", MINI)
    return Settings()


def _snapshot(folder) -> dict:
    return {p: (p.read_bytes(), p.stat().st_mtime_ns) for p in sorted(folder.rglob("*")) if p.is_file()}


def test_fetch_unpacks_the_pinned_tarballs_with_their_licence_and_manifest(home):
    [done] = fetch(home, ["mini"], progress=False)
    cache = home.home / "sources"
    assert done.dirs == (cache / "mini-emoji-1.0.0" / "package", cache / "acme+tags-2.0.0" / "package")
    images = package_dir(home, "mini")
    assert images == done.dirs[0] and package_dir(home, "mini", "@acme/tags") == done.dirs[1]
    assert json.loads((images / "emoji.json").read_text()) == EMOJI
    assert [(images / "img/mini/64" / e["image"]).read_bytes() for e in EMOJI] == [_png(0), _png(1)]
    assert (images / "LICENSE").read_text() == "The MIT License (MIT)\n"  # the package's own, kept
    assert json.loads((done.dirs[1] / "icons.json").read_text())["cat"]["tags"] == ["pet"]
    licence = (images.parent / "SOURCE.md").read_text()
    for text in ("mini-emoji@1.0.0", "CC-BY-4.0 (graphics)", "Mini emoji by the tests", "https://example.org/mini",
                 MINI.packages[0].integrity):
        assert text in licence
    manifest = json.loads((images.parent / "manifest.json").read_text())
    assert manifest["integrity"] == MINI.packages[0].integrity
    assert manifest["files"]["package/img/mini/64/1f431.png"] == [len(_png(1)), hashlib.sha256(_png(1)).hexdigest()]
    assert set(manifest["files"]) == {"SOURCE.md", "package/emoji.json", "package/LICENSE",
                                      "package/img/mini/64/1f600.png", "package/img/mini/64/1f431.png"}
    assert sorted(p.name for p in cache.iterdir()) == [".lock", "acme+tags-2.0.0", "mini-emoji-1.0.0"]  # no temp left
    with pytest.raises(SourceError, match="mini has no package 'nope': mini-emoji, @acme/tags"):
        package_dir(home, "mini", "nope")


def test_a_tarball_that_differs_from_its_pin_is_refused_and_nothing_is_kept(home):
    pinned = Package("mini-emoji", "1.0.0", _integrity(b"other bytes"))
    SOURCES["mini"] = Source("mini", (pinned,), "MIT", "t", "https://example.org")
    with pytest.raises(SourceError) as refused:
        fetch(home, ["mini"], progress=False)
    message = str(refused.value)
    assert message.startswith("mini-emoji@1.0.0 from http://127.0.0.1:") and "nothing was kept" in message
    assert f"expected {pinned.integrity}, got {_integrity(IMAGES)}" in message and "CLIPSTREAM_NPM_REGISTRY" in message
    assert [p.name for p in (home.home / "sources").iterdir()] == [".lock"]


def test_a_fetched_source_is_served_from_the_cache_without_the_network(home):
    fetch(home, ["mini"], progress=False)
    before = _snapshot(home.home / "sources")
    [again] = fetch(home, ["mini"], registry=_closed_port(), progress=False)
    assert again.dirs[0] == package_dir(home, "mini") and _snapshot(home.home / "sources") == before


class _CtrlC:
    """A progress bar whose first update is a Ctrl-C: the download stops midway."""

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def update(self, n):
        raise KeyboardInterrupt


@pytest.mark.parametrize("stage", ["download", "unpack"])
def test_an_interrupted_fetch_leaves_no_entry_and_a_later_run_fetches_it(home, monkeypatch, stage):
    real = tarfile.TarFile.extractall

    def interrupted(self, path, members=None, *, filter=None, **kwargs):
        real(self, path, members=self.getmembers()[:2], filter=filter)  # some files written, then Ctrl-C
        raise KeyboardInterrupt

    with monkeypatch.context() as patch:
        if stage == "download":
            patch.setattr(console, "bar", lambda **options: _CtrlC())
        else:
            patch.setattr(tarfile.TarFile, "extractall", interrupted)
        with pytest.raises(KeyboardInterrupt):
            fetch(home, ["mini"], progress=False)
    cache = home.home / "sources"
    assert [p.name for p in cache.iterdir()] == [".lock"]
    with pytest.raises(SourceError, match=r"mini \(mini-emoji@1.0.0\) is not fetched .*run `clipstream data fetch mini`"):
        package_dir(home, "mini")
    (cache / ".tmp-killed" / "package").mkdir(parents=True)  # what a SIGKILLed run leaves: cleaned by the next
    fetch(home, ["mini"], progress=False)
    assert (package_dir(home, "mini") / "emoji.json").is_file() and not (cache / ".tmp-killed").exists()


@pytest.mark.parametrize("damage, problem", [
    (lambda d: (d / "package/img/mini/64/1f600.png").write_bytes(_png(5)), "package/img/mini/64/1f600.png: changed"),
    (lambda d: (d / "package/emoji.json").unlink(), "package/emoji.json: missing"),
    (lambda d: (d / "package/extra.png").write_bytes(b"x"), "package/extra.png: not in the manifest"),
    (lambda d: (d / "manifest.json").write_text("{"), "manifest.json: unreadable (JSONDecodeError)"),
])
def test_a_damaged_cache_is_an_error_naming_the_file_and_is_left_as_it_is(home, damage, problem):
    fetch(home, ["mini"], progress=False)
    entry = home.home / "sources" / "mini-emoji-1.0.0"
    damage(entry)
    before = _snapshot(home.home / "sources")
    for read in (lambda: package_dir(home, "mini"), lambda: fetch(home, ["mini"], progress=False)):
        with pytest.raises(SourceError) as damaged:
            read()
        assert str(damaged.value) == (f"the cache of mini (mini-emoji@1.0.0) at {entry} is damaged: {problem}; run "
                                      "`clipstream data fetch --refetch mini` to fetch it again (nothing was changed)")
        assert _snapshot(home.home / "sources") == before
    fetch(home, ["mini"], progress=False, refetch=True)
    assert json.loads((package_dir(home, "mini") / "emoji.json").read_text()) == EMOJI
    assert sorted(p.name for p in (home.home / "sources").iterdir()) == [".lock", "acme+tags-2.0.0", "mini-emoji-1.0.0"]


def test_a_registry_that_cannot_be_reached_or_lacks_the_package_is_one_line(home, monkeypatch):
    with pytest.raises(RegistryError) as unreachable:
        fetch(home, ["mini"], registry=_closed_port(), progress=False)
    assert str(unreachable.value).startswith("mini-emoji@1.0.0: the npm registry at http://127.0.0.1:")
    assert str(unreachable.value).endswith("check the network, or set CLIPSTREAM_NPM_REGISTRY to a mirror")
    SOURCES["mini"] = Source("mini", (Package("mini-emoji", "9.9.9", MINI.packages[0].integrity),), "MIT", "t", "h")
    with pytest.raises(RegistryError, match=r"mini-emoji@9.9.9: http://\S+/mini-emoji/-/mini-emoji-9.9.9.tgz answered "
                                            "HTTP 404 File not found: set CLIPSTREAM_NPM_REGISTRY"):
        fetch(home, ["mini"], progress=False)
    with socket.socket() as silent:  # accepts connections, never answers
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        monkeypatch.setattr(sources, "TIMEOUT", 0.3)
        with pytest.raises(RegistryError, match="cannot be reached .*timed out"):
            fetch(home, ["mini"], registry=f"http://127.0.0.1:{silent.getsockname()[1]}", progress=False)
    assert [p.name for p in (home.home / "sources").iterdir()] == [".lock"]


def test_the_registry_setting_is_an_http_url(home):
    assert Settings(npm_registry="http://mirror.local:4873/npm/").npm_registry == "http://mirror.local:4873/npm"
    with pytest.raises(ValueError, match="give the registry's http:// or https:// URL"):
        Settings(npm_registry="registry.npmjs.org")


def test_data_fetch_prints_each_source_its_licence_and_path(home, capsys):
    assert main(["data", "fetch", "mini", "--json"]) == 0
    cache = home.home / "sources"
    assert json.loads(capsys.readouterr().out) == [{
        "source": "mini", "licence": MINI.licence, "attribution": MINI.attribution, "homepage": MINI.homepage,
        "packages": [{"package": "mini-emoji", "version": "1.0.0", "path": str(cache / "mini-emoji-1.0.0/package")},
                     {"package": "@acme/tags", "version": "2.0.0", "path": str(cache / "acme+tags-2.0.0/package")}]}]
    assert main(["data", "fetch", "mini"]) == 0
    assert capsys.readouterr().out.splitlines() == [
        "mini: CC-BY-4.0 (graphics); Mini emoji by the tests (https://example.org/mini)",
        f"  mini-emoji@1.0.0 {cache / 'mini-emoji-1.0.0/package'}", f"  @acme/tags@2.0.0 {cache / 'acme+tags-2.0.0/package'}"]


def _error(capsys) -> str:
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return err.strip().splitlines()[-1]


def test_data_fetch_errors_are_one_line(home, capsys, monkeypatch):
    with pytest.raises(SystemExit) as unknown:
        main(["data", "fetch", "nope"])
    assert unknown.value.code == 2 and "argument SOURCE: invalid choice: 'nope' (choose from" in _error(capsys)
    monkeypatch.setitem(SOURCES, "mini", Source("mini", (Package("mini-emoji", "1.0.0", _integrity(b"x")),), "MIT",
                                                "t", "h"))
    assert main(["data", "fetch", "mini"]) == 2
    assert _error(capsys).startswith("clipstream: error: mini-emoji@1.0.0 from http://127.0.0.1:")
    monkeypatch.setitem(SOURCES, "mini", MINI)
    monkeypatch.setenv("CLIPSTREAM_NPM_REGISTRY", "ftp://mirror")
    assert main(["data", "fetch", "mini"]) == 2
    assert _error(capsys) == ("clipstream: error: npm_registry: 'ftp://mirror': give the registry's http:// or "
                              "https:// URL, e.g. https://registry.npmjs.org")
    monkeypatch.setenv("CLIPSTREAM_NPM_REGISTRY", _closed_port())
    assert main(["data", "fetch", "mini"]) == 1  # the network, not the input: exit 1 (parser.EXIT_STATUS)
    assert _error(capsys).startswith("clipstream: error: mini-emoji@1.0.0: the npm registry at http://127.0.0.1:")
    monkeypatch.setenv("CLIPSTREAM_NPM_REGISTRY", home.npm_registry)
    assert main(["data", "fetch", "mini"]) == 0
    (home.home / "sources/mini-emoji-1.0.0/package/emoji.json").write_text("[]")
    assert main(["data", "fetch", "mini"]) == 2
    assert _error(capsys).endswith("is damaged: package/emoji.json: changed; run `clipstream data fetch --refetch mini` "
                                   "to fetch it again (nothing was changed)")
    assert main(["data", "fetch", "--refetch", "mini"]) == 0


@pytest.mark.slow
def test_every_pin_is_the_integrity_the_real_registry_publishes():
    """Each pinned package's version and integrity as registry.npmjs.org publishes them (its metadata: no tarball is
    downloaded here; the demo's test in the full tier fetches the real Twemoji and captions through these pins)."""
    import urllib.error
    import urllib.request

    for source in SOURCES.values():
        for package in source.packages:
            url = f"https://registry.npmjs.org/{package.name.replace('/', '%2f')}/{package.version}"
            try:
                with urllib.request.urlopen(url, timeout=30) as response:
                    published = json.load(response)
            except urllib.error.URLError as exc:  # (every machine of this project reaches the registry: a failure)
                pytest.fail(f"{package}: the npm registry's metadata at {url} cannot be read: {exc}")
            assert (published["name"], published["dist"]["integrity"]) == (package.name, package.integrity), source.name
