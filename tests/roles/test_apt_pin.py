"""The driver pin (nvidia_driver's apt preferences) under real apt: with both sources configured, the driver resolves
from the chosen one only, on its branch. The two archives are recorded index entries (Packages and Release files
of the names and versions Debian 12 and NVIDIA's debian12 repository carry), served over HTTP on this machine:
origins are hostnames, localhost playing Debian's mirror and 127.0.0.1 NVIDIA's."""

from __future__ import annotations

import functools
import hashlib
import http.server
import os
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

DEBIAN = {  # bookworm non-free: the driver, its helpers (versioned apart), built from Debian's sources
    "nvidia-smi": ("535.261.03-1", "nvidia-graphics-drivers", "nvidia-support, libnvidia-ml1 (= 535.261.03-1)"),
    "libnvidia-ml1": ("535.261.03-1", "nvidia-graphics-drivers", "nvidia-support"),
    "libcuda1": ("535.261.03-1", "nvidia-graphics-drivers", "nvidia-support"),
    "nvidia-support": ("20220217+3~deb12u1", "nvidia-support", ""),
}



def _driver(version: str) -> dict[str, tuple[str, str, str]]:
    """NVIDIA's repository: Debian's names, built from the same source name, depending on Debian's helper."""
    return {"nvidia-smi": (version, "nvidia-graphics-drivers", f"nvidia-support, libnvidia-ml1 (= {version})"),
            "libnvidia-ml1": (version, "nvidia-graphics-drivers", "nvidia-support"),
            "libcuda1": (version, "nvidia-graphics-drivers", "nvidia-support")}


# A newer 535 than Debian's, the 580 branch, and NCCL beside them.
NVIDIA = {**_driver("535.288.01-1"), "libnccl2": ("2.27.7-1+cuda13.0", "nccl", "")}
NCCL_CU12 = {"libnccl2": ("2.27.7-1+cuda12.9", "nccl", "")}  # the same NCCL built for CUDA 12
NVIDIA_580 = {**_driver("580.65.06-1"),
              "cuda-drivers-580": ("580.65.06-1", "cuda-drivers", "nvidia-smi (= 580.65.06-1), libcuda1")}


def _packages(entries: dict[str, tuple[str, str, str]], *more: dict[str, tuple[str, str, str]]) -> str:
    stanzas = []
    for table in (entries, *more):
        for name, (version, source, depends) in table.items():
            stanza = [f"Package: {name}", f"Source: {source}", f"Version: {version}", "Architecture: amd64",
                      f"Filename: pool/{name}_{version}_amd64.deb", "Size: 1024", f"SHA256: {'0' * 64}",
                      f"Description: {name}"]
            if depends:
                stanza.insert(4, f"Depends: {depends}")
            stanzas.append("\n".join(stanza))
    return "\n\n".join(stanzas) + "\n"


def _release(origin: str, index: Path, rel: str, **fields: str) -> str:
    data = index.read_bytes()
    head = "".join(f"{k}: {v}\n" for k, v in {"Origin": origin, "Label": origin, **fields}.items())
    return head + f"SHA256:\n {hashlib.sha256(data).hexdigest()} {len(data)} {rel}\n"


class _Quiet(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args: Any) -> None:  # apt's probes for InRelease and by-hash files 404 by design
        pass


@pytest.fixture(scope="module")
def archives(tmp_path_factory: pytest.TempPathFactory) -> Iterator[int]:
    root = tmp_path_factory.mktemp("archives")
    dist = root / "debian" / "dists" / "bookworm"
    (dist / "non-free" / "binary-amd64").mkdir(parents=True)
    index = dist / "non-free" / "binary-amd64" / "Packages"
    index.write_text(_packages(DEBIAN))
    (dist / "Release").write_text(_release("Debian", index, "non-free/binary-amd64/Packages", Suite="oldstable",
                                           Codename="bookworm", Components="non-free", Architectures="amd64"))
    flat = root / "nvidia"
    flat.mkdir()
    (flat / "Packages").write_text(_packages(NVIDIA, NVIDIA_580, NCCL_CU12))
    (flat / "Release").write_text(_release("NVIDIA", flat / "Packages", "Packages", Architectures="amd64"))
    handler = functools.partial(_Quiet, directory=str(root))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield server.server_address[1]
    finally:
        server.shutdown()


def _apt(tmp_path: Path, port: int, preferences: str | None,
         names: tuple[str, ...] = ("nvidia-smi", "libcuda1")) -> dict[str, Any]:
    """apt-get update against both archives in a private apt state, then the policy and a simulated install."""
    state = tmp_path / "state"
    for d in ("lists/partial", "cache/archives/partial", "prefs"):
        (state / d).mkdir(parents=True, exist_ok=True)
    (state / "status").write_text("")
    (state / "sources.list").write_text(
        f"deb [trusted=yes] http://localhost:{port}/debian bookworm non-free\n"
        f"deb [trusted=yes] http://127.0.0.1:{port}/nvidia ./\n")
    if preferences is not None:
        (state / "prefs" / "shardstack-nvidia-driver").write_text(preferences)
    conf = state / "apt.conf"
    conf.write_text("".join(f'{k} "{v}";\n' for k, v in {
        "Dir::State": state, "Dir::State::Lists": state / "lists", "Dir::State::status": state / "status",
        "Dir::Cache": state / "cache", "Dir::Etc::SourceList": state / "sources.list",
        "Dir::Etc::SourceParts": state / "none", "Dir::Etc::Preferences": state / "none",
        "Dir::Etc::PreferencesParts": state / "prefs", "Dir::Etc::Parts": state / "none",
        "APT::Architecture": "amd64", "Acquire::Languages": "none", "Acquire::http::Proxy": "DIRECT",
        "Debug::NoLocking": "true"}.items()))
    env = {**os.environ, "APT_CONFIG": str(conf)}

    def run(*argv: str) -> str:
        proc = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        return proc.stdout

    run("apt-get", "update", "-q")
    policy = run("apt-cache", "policy", *names)
    simulated = run("apt-get", "install", "--simulate", "--no-install-recommends", *names)
    inst = {line.split()[1]: line for line in simulated.splitlines() if line.startswith("Inst ")}
    return {"policy": policy, "inst": inst}


def _pin(role_eval: Any, debian_container: dict, port: int, **over: str) -> str:
    r = role_eval("nvidia_driver", debian_container, shardstack_cuda_repo_url=f"http://127.0.0.1:{port}/nvidia", **over)
    return r.render("apt-preferences.j2")


def test_without_the_pin_the_driver_is_mixed(archives: int, tmp_path: Path) -> None:
    """The control: both archives, no preferences — NVIDIA's newer versions win whatever the branch."""
    got = _apt(tmp_path, archives, None)
    assert "(580.65.06-1 NVIDIA:" in got["inst"]["nvidia-smi"]


def test_distro_driver_never_from_nvidias_repository(
    archives: int, tmp_path: Path, role_eval: Any, debian_container: dict
) -> None:
    pin = _pin(role_eval, debian_container, archives, nvidia_driver_source="distro", nvidia_driver_branch="535")
    got = _apt(tmp_path, archives, pin)
    # NVIDIA's 535.288.01-1 is newer and on the branch, its 580 newer still: neither is a candidate.
    for name in ("nvidia-smi", "libnvidia-ml1", "libcuda1"):
        assert "(535.261.03-1 Debian:" in got["inst"][name], got["inst"][name]
    assert got["policy"].count("Candidate: 535.261.03-1") == 2
    assert got["policy"].count(" -1\n        500 http://127.0.0.1:") == 4


def test_cuda_repo_driver_never_from_debian(
    archives: int, tmp_path: Path, role_eval: Any, debian_container: dict
) -> None:
    got = _apt(tmp_path, archives, _pin(role_eval, debian_container, archives))
    for name in ("nvidia-smi", "libnvidia-ml1", "libcuda1"):
        assert "(580.65.06-1 NVIDIA:" in got["inst"][name], got["inst"][name]
    # The helper NVIDIA's packages depend on still comes from Debian (only the driver's own sources are blocked).
    assert "(20220217+3~deb12u1 Debian:" in got["inst"]["nvidia-support"]
    assert got["policy"].count("535.261.03-1 -1\n        500 http://localhost:") == 2


@pytest.mark.parametrize(("driver_cuda", "want"), [("12.8", "2.27.7-1+cuda12.9"), ("13.0", "2.27.7-1+cuda13.0")])
def test_nccl_held_to_the_drivers_cuda_major(
    archives: int, tmp_path: Path, role_eval: Any, hardware: Any, debian_container: dict, driver_cuda: str, want: str
) -> None:
    """nccl's pin: of the same NCCL built for CUDA 12.9 and 13.0, a branch-570 node (CUDA 12.8) gets the CUDA 12
    build; without the pin apt takes the CUDA 13 one, which that driver cannot run."""
    assert "(2.27.7-1+cuda13.0 NVIDIA:" in _apt(tmp_path / "none", archives, None, ("libnccl2",))["inst"]["libnccl2"]
    pin = role_eval("nccl", debian_container, shardstack_hardware=hardware(),
                    nvidia_driver_compat={"branch": "570", "driver_cuda": driver_cuda}).render("apt-preferences.j2")
    assert f"({want} NVIDIA:" in _apt(tmp_path, archives, pin, ("libnccl2",))["inst"]["libnccl2"]
