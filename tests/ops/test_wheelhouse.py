"""The controller's wheelhouse: keyed by source state, complete, checked against the nodes' Python, cached."""

from __future__ import annotations

import json
import os
import shutil
import sys
import tarfile
from pathlib import Path

import pytest
from shardstack.errors import ShardstackError
from shardstack.ops import wheelhouse
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


def _link_or_copy(src: str, dst: str) -> None:
    try:
        os.link(src, dst)
    except OSError:  # another filesystem
        shutil.copy(src, dst)


@pytest.mark.skipif(sys.version_info[:2] != wheelhouse.TARGET_PYTHON, reason="needs the nodes' CPython")
def test_the_project_wheelhouse_is_complete_and_cached(tmp_path: Path) -> None:
    # Dependencies come from the shared cache (built once per pyproject); the source part goes to a fresh cache.
    shared = wheelhouse.cache_root()
    deps_name = f"deps-{wheelhouse.deps_key(project_dir())}"
    cache = tmp_path / "cache"
    if (shared / deps_name).is_dir():
        cache.mkdir()
        shutil.copytree(shared / deps_name, cache / deps_name, copy_function=_link_or_copy)
    first = wheelhouse.build(project_dir(), cache, log=lambda _m: None)
    assert first.built and first.path.parent == cache
    manifest = json.loads((first.path / "manifest.json").read_text())
    names = {p.name for p in first.path.glob("*.whl")}
    assert manifest["shardstack_wheel"] in names and manifest["requirement"].startswith("shardstack[train,serve]==")
    assert any(n.startswith("torch-2.13.0") for n in names)
    assert set(manifest["files"]) == names
    with tarfile.open(first.path / wheelhouse.ARCHIVE) as tar:
        assert set(tar.getnames()) == names | {"manifest.json"}
    again = wheelhouse.build(project_dir(), cache, log=lambda _m: None)
    assert not again.built and again.path == first.path and again.shardstack_sha256 == first.shardstack_sha256
