"""Build the wheelhouse the nodes install shardstack from, offline (the air-gap path: docs/operations.md).

The controller builds it once per source state into a cache outside the clone:

    <cache>/wheelhouse/deps-<hash of pyproject.toml>/   every dependency of shardstack[train,serve] (torch included)
    <cache>/wheelhouse/<hash of pyproject + runtime/>/   hard links to those + the shardstack wheel + manifest.json,
                                                         and wheelhouse.tar with all of it (what the nodes get)

Dependencies only change with pyproject.toml, so a code change costs one small `pip wheel --no-deps`. The
shardstack wheel is rebuilt only when the source hash changes, so the bytes (and the nodes' install stamps) stay
the same between deploys and a re-run of site.yml changes nothing.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from shardstack.errors import ShardstackError

EXTRAS = "train,serve"
ARCHIVE = "wheelhouse.tar"
# The nodes run Debian 12's CPython; wheels built here must fit it (tags are checked below).
TARGET_PYTHON = (3, 11)
_SKIP_DIRS = {"__pycache__", ".pytest_cache"}


def cache_root() -> Path:
    return Path(os.environ.get("SHARDSTACK_CACHE", "/var/cache/shardstack")) / "wheelhouse"


def _digest(paths: list[Path], root: Path) -> str:
    h = hashlib.sha256()
    for p in sorted(paths):
        h.update(str(p.relative_to(root)).encode() + b"\0")
        h.update(p.read_bytes() + b"\0")
    return h.hexdigest()[:16]


def source_files(project: Path) -> list[Path]:
    files = [project / "pyproject.toml", project / "README.md"]
    for dirpath, dirnames, filenames in os.walk(project / "runtime"):
        dirnames[:] = [d for d in dirnames if d not in _SKIP_DIRS and not d.endswith(".egg-info")]
        files += [Path(dirpath) / f for f in filenames if not f.endswith((".pyc", ".pyo"))]
    return files


def deps_key(project: Path) -> str:
    return _digest([project / "pyproject.toml"], project)


def source_key(project: Path) -> str:
    return _digest(source_files(project), project)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


@dataclass
class Wheelhouse:
    path: Path
    key: str
    shardstack_wheel: str  # file name inside path
    shardstack_sha256: str
    requirement: str  # what the nodes install, e.g. "shardstack[train,serve]==0.1.0"
    files: int
    bytes: int
    built: bool  # False when the cache already held it
    seconds: float

    def to_dict(self) -> dict:
        d = asdict(self)
        d["path"] = str(self.path)
        return d


def _pip(*args: str, cwd: Path | None = None) -> None:
    cmd = [sys.executable, "-m", "pip", "--disable-pip-version-check", *args]
    proc = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True)
    if proc.returncode != 0:
        tail = "\n".join((proc.stderr or proc.stdout).strip().splitlines()[-8:])
        raise ShardstackError(f"`pip {' '.join(args[:2])} …` failed building the wheelhouse:\n{tail}",
                              hint="the controller needs the wheels (or an index) for every dependency")


def _copy_source(project: Path, dest: Path) -> None:
    """Build from a copy: building in place would drop build/ and egg-info into the tree other runs share."""
    for f in source_files(project):
        target = dest / f.relative_to(project)
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(f, target)


def _check_tags(wheel_dir: Path) -> None:
    want = f"cp{TARGET_PYTHON[0]}{TARGET_PYTHON[1]}"
    bad = []
    for whl in wheel_dir.glob("*.whl"):
        py, abi, plat = whl.stem.split("-")[-3:]
        wrong_platform = plat != "any" and "x86_64" not in plat
        wrong_python = abi not in ("none", "abi3") and want not in py.split(".")
        if wrong_platform or wrong_python:
            bad.append(whl.name)
    if bad:
        raise ShardstackError(f"wheels that do not fit the nodes (CPython {'.'.join(map(str, TARGET_PYTHON))}, "
                              f"x86_64): {', '.join(sorted(bad))}",
                              hint="build the wheelhouse with a CPython of the nodes' version")


def _atomic_dir(final: Path, fill) -> None:
    """Fill a temporary sibling, then rename: a half-built wheelhouse is never seen under its final name."""
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=final.parent))
    try:
        fill(tmp)
        os.chmod(tmp, 0o755)
        try:
            tmp.rename(final)
        except OSError:  # another build won the race; theirs is as good as ours
            if not final.is_dir():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def build(project: Path, cache: Path | None = None, *, log=print) -> Wheelhouse:
    """Return the wheelhouse for the project's current source, building what the cache lacks."""
    if sys.version_info[:2] != TARGET_PYTHON:
        raise ShardstackError(
            f"the wheelhouse must be built with CPython {'.'.join(map(str, TARGET_PYTHON))} (the nodes' Python); "
            f"this is {sys.version.split()[0]}", hint="run the shardstack CLI from a python3.11 virtualenv")
    started = time.monotonic()
    cache = cache or cache_root()
    key = source_key(project)
    final = cache / key
    built = False
    if not (final / "manifest.json").is_file():
        built = True
        deps = cache / f"deps-{deps_key(project)}"
        if not deps.is_dir():
            log(f"wheelhouse: fetching dependencies of shardstack[{EXTRAS}] into {deps} (once per pyproject.toml)")

            def fill_deps(tmp: Path) -> None:
                with tempfile.TemporaryDirectory() as src:
                    _copy_source(project, Path(src))
                    _pip("wheel", "--quiet", "--wheel-dir", str(tmp), f"{src}[{EXTRAS}]")
                for whl in tmp.glob("shardstack-*.whl"):
                    whl.unlink()
                _check_tags(tmp)

            _atomic_dir(deps, fill_deps)
        log(f"wheelhouse: building the shardstack wheel into {final}")

        def fill(tmp: Path) -> None:
            with tempfile.TemporaryDirectory() as src:
                _copy_source(project, Path(src))
                _pip("wheel", "--quiet", "--no-deps", "--no-build-isolation", "--wheel-dir", str(tmp), src)
            for whl in deps.glob("*.whl"):
                os.link(whl, tmp / whl.name)
            own = next(tmp.glob("shardstack-*.whl"))
            version = own.name.split("-")[1]
            files = {p.name: _sha256(p) for p in sorted(tmp.glob("*.whl"))}
            manifest = {"key": key, "requirement": f"shardstack[{EXTRAS}]=={version}", "shardstack_wheel": own.name,
                        "shardstack_sha256": files[own.name], "deps_key": deps.name, "files": files}
            (tmp / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
            # One archive for the nodes: a single transfer and checksum instead of one per wheel.
            with tarfile.open(tmp / ARCHIVE, "w") as tar:
                for f in sorted(tmp.iterdir()):
                    if f.name != ARCHIVE:
                        tar.add(f, arcname=f.name)

        _atomic_dir(final, fill)
    manifest = json.loads((final / "manifest.json").read_text())
    wheels = list(final.glob("*.whl"))
    return Wheelhouse(path=final, key=key, shardstack_wheel=manifest["shardstack_wheel"],
                      shardstack_sha256=manifest["shardstack_sha256"], requirement=manifest["requirement"],
                      files=len(wheels), bytes=sum(w.stat().st_size for w in wheels), built=built,
                      seconds=time.monotonic() - started)


def prune(cache: Path | None = None, keep: int = 3) -> list[Path]:
    """Drop all but the newest `keep` source wheelhouses (deps dirs are shared and stay)."""
    cache = cache or cache_root()
    houses = sorted((p for p in cache.glob("*") if p.is_dir() and not p.name.startswith(("deps-", "."))),
                    key=lambda p: p.stat().st_mtime, reverse=True)
    for old in houses[keep:]:
        shutil.rmtree(old, ignore_errors=True)
    return houses[keep:]
