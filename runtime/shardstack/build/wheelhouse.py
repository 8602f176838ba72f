"""Build the wheelhouses the nodes install shardstack from, offline and hash-locked (docs/operations.md).

One wheelhouse per venv, accelerator class (shardstack.accel: cpu, cu126, cu129, cu130) and target Python, because
torch's build and its nvidia-* libraries differ per class, and compiled wheels per CPython (Debian 12 nodes run 3.11,
Debian 13 nodes 3.13). Two venvs: the runtime's (shardstack[train,serve]) and the vLLM
engine's (`Venv`: vLLM pins torch and a large tree of its own). The controller resolves and downloads each from the
package index for the nodes' platform (CPython 3.11 or 3.13, x86_64, glibc ≥ 2.34) whatever its own is, and writes a
lock with the sha256 of every file; nodes install with `pip install --no-index --require-hashes -r requirements.lock`.
Cache, per class:

    <cache>/wheelhouse/<class>/deps-<hash of pyproject.toml + class>/  the dependencies and deps.lock
    <cache>/wheelhouse/<class>/<hash of pyproject + runtime/>/          hard links to those + the shardstack wheel,
        requirements.lock (everything), shardstack.lock (the own wheel), manifest.json and wheelhouse.tar
    <cache>/wheelhouse/vllm-<class>/…                                   the same for the vLLM venv
    <cache>/wheelhouse/<class>-cp313/…, vllm-<class>-cp313/…             the same for CPython 3.13 nodes

Dependencies only change with pyproject.toml (or the class table), so a code change costs one small
`pip wheel --no-deps`. The shardstack wheel is rebuilt only when the source hash changes, so the bytes (and the
nodes' install stamps) stay the same between deploys and a re-run of site.yml changes nothing. Each new source still
adds a wheelhouse archive (~1 GiB for vLLM's): every build touches the directories it uses and removes those of its
class unused for PRUNE_AFTER_S, so a cache that serves many commits does not fill the disk.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tarfile
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from shardstack.accel import BY_NAME, AcceleratorClass
from shardstack.build.resolver import (
    DEFAULT_PYTHON,
    RUNTIME,
    Venv,
    abi_tag,
    index_args,
    lock_line,
    pip_run,
    require_checkout,
    resolve,
    target_args,
)
from shardstack.errors import ShardstackError

ARCHIVE = "wheelhouse.tar"
LOCK = "requirements.lock"
OWN_LOCK = "shardstack.lock"
_SKIP_DIRS = {"__pycache__", ".pytest_cache"}
# Longer than any deploy that reads a wheelhouse: one unused for this long belongs to an older source.
PRUNE_AFTER_S = 86400


def cache_root() -> Path:
    return Path(os.environ.get("SHARDSTACK_CACHE", "/var/cache/shardstack")) / "wheelhouse"


def _digest(paths: list[Path], root: Path, extra: str = "") -> str:
    h = hashlib.sha256(extra.encode())
    for p in sorted(paths):
        h.update(str(p.relative_to(root)).encode() + b"\0")
        h.update(p.read_bytes() + b"\0")
    return h.hexdigest()[:16]


def source_files(project: Path) -> list[Path]:
    require_checkout(project)
    files = [project / "pyproject.toml", project / "README.md"]
    for dirpath, dirnames, filenames in os.walk(project / "runtime"):
        dirnames[:] = [d for d in dirnames if d not in _SKIP_DIRS and not d.endswith(".egg-info")]
        files += [Path(dirpath) / f for f in filenames if not f.endswith((".pyc", ".pyo"))]
    return files


def deps_key(project: Path, accel: AcceleratorClass | None = None, venv: Venv = RUNTIME,
             python: tuple[int, int] = DEFAULT_PYTHON) -> str:
    return _digest([project / "pyproject.toml"], project, (repr(accel) if accel else "")
                   + ("" if venv is RUNTIME else venv.fingerprint())
                   + ("" if python == DEFAULT_PYTHON else abi_tag(python)))


def source_key(project: Path) -> str:
    return _digest(source_files(project), project)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


# --- building -----------------------------------------------------------------------------------------------------


@dataclass
class Wheelhouse:
    path: Path
    key: str  # "<class>[-cp313]-<source key>": what a node's install stamp holds
    accelerator: str
    python: str  # the nodes' CPython, "3.11" or "3.13"
    torch: str
    shardstack_wheel: str  # file name inside path
    shardstack_sha256: str
    requirement: str  # what the nodes install, e.g. "shardstack[train,serve]==0.1.0"
    venv: str  # runtime | vllm
    lock: str  # file name of the full hash lock inside path
    files: int
    bytes: int
    built: bool  # False when the cache already held it
    seconds: float

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["path"] = str(self.path)
        return d


def _copy_source(project: Path, dest: Path) -> None:
    """Build from a copy: building in place would drop build/ and egg-info into the tree other runs share."""
    for f in source_files(project):
        target = dest / f.relative_to(project)
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(f, target)


def _check_tags(wheel_dir: Path, python: tuple[int, int] = DEFAULT_PYTHON) -> None:
    want = abi_tag(python)
    bad = []
    for whl in wheel_dir.glob("*.whl"):
        py, abi, plat = whl.stem.split("-")[-3:]
        wrong_platform = plat != "any" and "x86_64" not in plat
        wrong_python = abi not in ("none", "abi3") and want not in py.split(".")
        if wrong_platform or wrong_python:
            bad.append(whl.name)
    if bad:
        raise ShardstackError(f"wheels that do not fit the nodes (CPython {'.'.join(map(str, python))}, "
                              f"x86_64): {', '.join(sorted(bad))}",
                              hint="the index served wheels for another platform; check its configuration")


def _atomic_dir(final: Path, fill: Callable[[Path], None]) -> None:
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


def _fetch_deps(project: Path, accel: AcceleratorClass, venv: Venv, python: tuple[int, int], dest: Path,
                log: Callable[[str], None]) -> None:
    """Resolve, download exactly those files, check them against the index's hashes and write deps.lock."""
    pins = resolve(project, accel, venv, python)
    log(f"wheelhouse: {accel.name} ({abi_tag(python)}): {len(pins)} files, torch {accel.torch_version}")
    with tempfile.TemporaryDirectory() as tmp:
        exact = Path(tmp) / "pins.txt"
        exact.write_text("".join(f"{p.name}==={p.version}\n" for p in pins))
        pip_run(["download", "--quiet", "--no-deps", "--dest", str(dest), *target_args(python), *index_args(accel),
              "-r", str(exact)], f"downloading the {accel.name} wheelhouse")
    lines = []
    for p in pins:
        path = dest / p.filename
        if not path.is_file():
            raise ShardstackError(f"pip downloaded no {p.filename} for {p.name} {p.version}")
        digest = _sha256(path)
        if p.sha256 and digest != p.sha256:
            raise ShardstackError(f"{p.filename}: sha256 {digest} differs from the index's {p.sha256}",
                                  hint="a corrupt download or a tampered mirror; remove it and build again")
        lines.append(lock_line(p.name, p.version, digest))
    _check_tags(dest, python)
    (dest / "deps.lock").write_text("\n".join(lines) + "\n")


def _used(path: Path) -> Path:
    """Mark the directory as in use now (its mtime is what prune() reads)."""
    if path.is_dir():
        os.utime(path)
    return path


def prune(root: Path, keep: set[Path], log: Callable[[str], None] = print, now: float | None = None) -> list[Path]:
    """Remove the wheelhouses, dependency sets and abandoned temporaries under one class directory that were last
    used more than PRUNE_AFTER_S ago, except `keep`; return what went."""
    cutoff = (now if now is not None else time.time()) - PRUNE_AFTER_S
    gone = []
    for d in sorted(root.iterdir()) if root.is_dir() else []:
        if d.is_dir() and d not in keep and d.stat().st_mtime < cutoff:
            shutil.rmtree(d, ignore_errors=True)
            gone.append(d)
    if gone:
        log(f"wheelhouse: removed {len(gone)} unused for {PRUNE_AFTER_S // 3600} h from {root}: "
            + ", ".join(d.name for d in gone))
    return gone


def dependencies(project: Path, cache: Path | None = None, *, accel: AcceleratorClass, venv: Venv = RUNTIME,
                 python: tuple[int, int] = DEFAULT_PYTHON, log: Callable[[str], None] = print) -> Path:
    """The directory of the venv's dependencies (wheels + deps.lock) for the class and the nodes' Python, fetched
    when the cache lacks it."""
    deps = (cache or cache_root()) / venv.directory(accel, python) / f"deps-{deps_key(project, accel, venv, python)}"
    if not (deps / "deps.lock").is_file():
        log(f"wheelhouse: fetching the {accel.name} dependencies of {venv.requirement(accel)} for CPython "
            f"{python[0]}.{python[1]} into {deps} (once per pyproject.toml)")
        _atomic_dir(deps, lambda tmp: _fetch_deps(project, accel, venv, python, tmp, log))
    return _used(deps)


def build(project: Path, cache: Path | None = None, *, accel: AcceleratorClass | None = None,
          venv: Venv = RUNTIME, python: tuple[int, int] = DEFAULT_PYTHON,
          log: Callable[[str], None] = print) -> Wheelhouse:
    """Return the venv's wheelhouse of the class and the nodes' Python for the project's current source, building
    what the cache lacks."""
    accel = accel or BY_NAME["cpu"]
    started = time.monotonic()
    directory = venv.directory(accel, python)
    root = (cache or cache_root()) / directory
    requirement = venv.requirement(accel)
    skey = source_key(project)
    final = root / skey
    built = False
    if not (final / "manifest.json").is_file():
        built = True
        deps = dependencies(project, cache, accel=accel, venv=venv, python=python, log=log)
        log(f"wheelhouse: building the shardstack wheel into {final}")

        def fill(tmp: Path) -> None:
            with tempfile.TemporaryDirectory() as src:
                _copy_source(project, Path(src))
                pip_run(["wheel", "--quiet", "--no-deps", "--no-build-isolation", "--wheel-dir", str(tmp), src],
                     "building the shardstack wheel")
            for whl in deps.glob("*.whl"):
                os.link(whl, tmp / whl.name)
            own = next(tmp.glob("shardstack-*.whl"))
            version = own.name.split("-")[1]
            own_sha = _sha256(own)
            own_line = lock_line(requirement, version, own_sha)
            (tmp / OWN_LOCK).write_text(own_line + "\n")
            (tmp / LOCK).write_text(f"# shardstack wheelhouse {directory}-{skey}: pip install --no-index "
                                    f"--find-links . --require-hashes -r {LOCK}\n{own_line}\n"
                                    + (deps / "deps.lock").read_text())
            files = {p.name: _sha256(p) for p in sorted(tmp.glob("*.whl"))}
            manifest = {"key": f"{directory}-{skey}", "venv": venv.name, "accelerator": accel.name,
                        "python": "{}.{}".format(*python), "torch": accel.torch_version,
                        "requirement": f"{requirement}=={version}",
                        "shardstack_wheel": own.name, "shardstack_sha256": own_sha, "lock": LOCK,
                        "own_lock": OWN_LOCK, "deps_key": deps.name, "files": files}
            (tmp / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
            # One archive for the nodes: a single transfer and checksum instead of one per wheel.
            with tarfile.open(tmp / ARCHIVE, "w") as tar:
                for f in sorted(tmp.iterdir()):
                    if f.name != ARCHIVE:
                        tar.add(f, arcname=f.name)

        _atomic_dir(final, fill)
    manifest = json.loads((final / "manifest.json").read_text())
    prune(root, {_used(final), _used(root / manifest["deps_key"])}, log)
    wheels = list(final.glob("*.whl"))
    return Wheelhouse(path=final, key=manifest["key"], accelerator=manifest["accelerator"],
                      python=manifest.get("python", "{}.{}".format(*DEFAULT_PYTHON)), torch=manifest["torch"],
                      shardstack_wheel=manifest["shardstack_wheel"], shardstack_sha256=manifest["shardstack_sha256"],
                      requirement=manifest["requirement"], venv=manifest.get("venv", "runtime"),
                      lock=manifest["lock"], files=len(wheels), bytes=sum(w.stat().st_size for w in wheels),
                      built=built, seconds=time.monotonic() - started)

