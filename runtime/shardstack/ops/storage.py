"""What lies on the cluster's shared storage and how it gets there: models and data put from this machine (copied
as the job account, checked file by file), data sets prepared on a train node, checkpoints exported for serving."""

from __future__ import annotations

import hashlib
import json
import re
import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shardstack.errors import ShardstackError
from shardstack.ops.inventory import Cluster
from shardstack.ops.runner import run_command, run_module


@dataclass
class ClusterExport:
    host: str
    out_dir: str
    current: str
    output: str
    step: int | None = None  # the step exported, as `shardstack export` reported it
    signed: bool = True  # the export's manifest is signed with the node's key (False: --allow-unsigned)


def export_argv(venv: str, checkpoint: str, out: str, *, key_file: str | None = None,
                allow_unsigned: bool = False, fmt: str = "shardstack") -> list[str]:
    """`shardstack export` as the node runs it: with the node's signing key (the default one, or the job's
    checkpoint.signing_key_file), or --allow-unsigned for a job that signs nothing."""
    argv = [f"{venv}/bin/shardstack", "export", "--checkpoint", checkpoint, "--out", out, "--format", fmt]
    if allow_unsigned:
        argv.append("--allow-unsigned")
    elif key_file:
        argv += ["--key-file", key_file]
    return argv


def serving_format(cluster: Cluster) -> str:
    """The export format the inference tier loads: a Hugging Face directory when an inference node runs vLLM (which
    loads nothing else; the built-in engine loads both), else shardstack's own."""
    engines = {cluster.host_setting("inference_service_engine", "inference_service", host)
               for host in cluster.hosts("inference_nodes")}
    return "hf" if "vllm" in engines else "shardstack"


def export_current(cluster: Cluster, checkpoint_dir: str, name: str, *, key_file: str | None = None,
                   allow_unsigned: bool = False) -> ClusterExport:
    """Export a checkpoint (a step directory, or a checkpoint root: its newest valid checkpoint) to
    <shared>/exports/<name> on the first train node, as the job account with the node's signing key, in the format
    the inference tier loads (serving_format), and point <shared>/exports/current at it.

    The switch is a symlink rename, so an inference node (re)starting at any moment sees either the old or the
    new model, never half of one.
    """
    head = cluster.group("train_nodes")[0]
    venv = cluster.setting("training_runtime_venv", "training_runtime", "train_nodes")
    models = f"{cluster.shared_dir}/exports"
    out = f"{models}/{name}"
    script = " && ".join(shlex.join(c) for c in (
        export_argv(venv, checkpoint_dir, out, key_file=key_file, allow_unsigned=allow_unsigned,
                    fmt=serving_format(cluster)),
        ["ln", "-sfn", "--no-target-directory", name, f"{models}/.current.tmp"],
        ["mv", "-T", f"{models}/.current.tmp", f"{models}/current"]))
    res = run_command(["runuser", "-u", cluster.job_account, "--", "sh", "-c", script], cluster.path, head)[head]
    if not res.success:
        raise ShardstackError(f"export on {head} failed: {(res.stderr or res.stdout or res.message or '')[-800:]}")
    output = (res.stdout + res.stderr).strip()
    step = re.search(r"exported step (\d+)", output)
    return ClusterExport(head, out, f"{models}/current", output, int(step[1]) if step else None,
                         not allow_unsigned)


NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


def check_name(name: str, what: str = "name") -> str:
    """A directory name under <shared>/pretrained or <shared>/data: one path component, nothing hidden."""
    if not NAME.match(name):
        raise ShardstackError(f"{what} {name!r} is not valid", hint="use [A-Za-z0-9._-], starting with a letter or "
                              "digit, up to 128 characters")
    return name


def _copy(cluster: Cluster, src: Path, dest: str, *, become: bool) -> str:
    """Copy a file or directory of this machine into the directory `dest` on the first train node (shared storage,
    so every node sees it), as the job account (`become`): it owns what jobs read and write there, and root would be
    squashed to nobody on the NFS export (root_squash). The copy module compares checksums: unchanged files are not
    sent again."""
    head = cluster.group("train_nodes")[0]
    args = {"src": f"{src}/" if src.is_dir() else str(src), "dest": f"{dest}/", "mode": "u=rwX,go=rX",
            "directory_mode": "0755"}
    res = run_module("ansible.builtin.copy", args, cluster.path, head, become=become,
                     become_user=cluster.job_account if become else None)
    if head not in res or not res[head].success:
        msg = res[head].message if head in res else "no result"
        raise ShardstackError(f"copying {src} to {head}:{dest} failed: {msg}",
                              hint="is the shared storage mounted? shardstack validate")
    return head


def place_model(cluster: Cluster, local_dir: Path, *, name: str | None = None, become: bool = True) -> str:
    """Copy a model directory of this machine (e.g. the cached pretrained model) to <shared>/pretrained/<name> (its
    own name by default) through the first train node, where every node sees it; returns that path. Unchanged files
    are not copied again (the copy module compares checksums)."""
    dest = f"{cluster.shared_dir}/pretrained/{check_name(name or local_dir.name, 'model name')}"
    _copy(cluster, local_dir, dest, become=become)
    return dest


def local_checksums(src: Path) -> dict[str, str]:
    """sha256 of every file under a directory (or of one file), by its path relative to what the copy writes."""
    files = sorted(p for p in src.rglob("*") if p.is_file()) if src.is_dir() else [src]
    return {(p.relative_to(src).as_posix() if src.is_dir() else p.name): _sha256(p) for p in files}


def _sha256(path: Path) -> str:
    with path.open("rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def checksum_argv(dest: str) -> list[str]:
    """sha256 of every file under `dest` on a node, one `HASH  ./relative/path` line each (sha256sum's format)."""
    return ["sh", "-c", 'cd "$1" && find . -type f -print0 | sort -z | xargs -0r sha256sum', "sh", dest]


def parse_checksums(text: str) -> dict[str, str]:
    out = {}
    for line in text.splitlines():
        digest, sep, name = line.partition("  ")
        if sep and re.fullmatch(r"[0-9a-f]{64}", digest):
            out[name.removeprefix("./")] = digest
    return out


@dataclass
class Verified:
    """A copy on shared storage checked file by file against the source here."""

    path: str
    files: int
    bytes: int
    extra: list[str]  # files on the node the source does not have (left by an earlier copy; not an error)


def compare_checksums(local: dict[str, str], remote: dict[str, str], where: str) -> list[str]:
    """Extra files on the node are not the copy's business; returns them. A file missing there or different is an
    error naming it (all of them, sorted)."""
    missing = sorted(set(local) - set(remote))
    differ = sorted(n for n in set(local) & set(remote) if local[n] != remote[n])
    if missing or differ:
        parts = ([f"missing on the node: {', '.join(missing)}"] if missing else []) + (
            [f"sha256 differs: {', '.join(differ)}"] if differ else [])
        raise ShardstackError(f"{where} does not match the source: {'; '.join(parts)}",
                              hint="put it again; if it still differs, check the shared storage (shardstack validate)")
    return sorted(set(remote) - set(local))


def verify_copy(cluster: Cluster, head: str, src: Path, dest: str) -> Verified:
    """sha256 of every file of `src` here against the copy at `dest` on `head`, in one command on the node."""
    local = local_checksums(src)
    res = run_command(checksum_argv(dest), cluster.path, head)
    if head not in res or not res[head].success:
        r = res.get(head)
        raise ShardstackError(f"cannot read the checksums of {head}:{dest}: "
                              f"{(r.stderr or r.message or '') if r else 'no result'}".strip())
    extra = compare_checksums(local, parse_checksums(res[head].stdout), f"{head}:{dest}")
    size = sum(p.stat().st_size for p in ([src] if src.is_file() else src.rglob("*")) if p.is_file())
    return Verified(dest, len(local), size, extra)


def put_model(cluster: Cluster, local_dir: Path, name: str | None = None) -> Verified:
    """`shardstack model put`: a Hugging Face model directory here → <shared>/pretrained/<name>, verified."""
    if not (local_dir / "config.json").is_file():
        raise ShardstackError(f"{local_dir} is not a model directory (no config.json)",
                              hint="pass a Hugging Face model directory (config.json, weights, tokenizer)")
    dest = f"{cluster.shared_dir}/pretrained/{check_name(name or local_dir.resolve().name, 'model name')}"
    head = _copy(cluster, local_dir, dest, become=True)
    return verify_copy(cluster, head, local_dir, dest)


def put_data(cluster: Cluster, src: Path, name: str | None = None) -> Verified:
    """`shardstack data put`: a corpus (a text file, a directory of them) or prepared token shards here →
    <shared>/data/<name>, verified."""
    if not src.exists():
        raise ShardstackError(f"{src} does not exist")
    if src.is_dir() and not any(p.is_file() for p in src.rglob("*")):
        raise ShardstackError(f"{src} holds no files")
    default = src.resolve().name if src.is_dir() else src.stem
    dest = f"{cluster.shared_dir}/data/{check_name(name or default, 'data name')}"
    head = _copy(cluster, src, dest, become=True)
    return verify_copy(cluster, head, src, dest)


def on_shared(path: str, shared: str) -> bool:
    """Whether an absolute path lies under the shared directory (`..` resolved, no prefix tricks: /srv/x-y is not
    under /srv/x)."""
    import posixpath

    if not path.startswith("/"):
        return False
    norm, root = posixpath.normpath(path), posixpath.normpath(shared)
    return norm != root and posixpath.commonpath([norm, root]) == root


def prepare_argv(venv: str, user: str, source: str, out: str, *, tokenizer: str = "bytes",
                 workers: int | None = None) -> list[str]:
    """`shardstack data prepare` on a node, as the job account (which owns <shared>/data)."""
    argv = ["runuser", "-u", user, "--", f"{venv}/bin/shardstack", "data", "prepare", source, "--out", out,
            "--tokenizer", tokenizer, "--json"]
    return argv + (["--workers", str(workers)] if workers else [])


@dataclass
class ClusterPrepare:
    host: str
    source: str  # the input on shared storage
    out: str
    meta: dict[str, Any]  # meta.json's fields, as `data prepare --json` printed them
    copied: Verified | None = None  # the local input, put on shared storage first


def prepare_on_cluster(cluster: Cluster, source: str, out_name: str, *, tokenizer: str = "bytes",
                       workers: int | None = None) -> ClusterPrepare:
    """`shardstack data prepare --cluster`: tokenise a corpus into <shared>/data/<out_name> on the first train node.
    The input is a path under the shared directory, or a file or directory here, put first to
    <shared>/data/<out_name>-text (verified). The tokenizer is `bytes` or a directory the node sees."""
    check_name(out_name, "--out-name")
    shared = cluster.shared_dir
    if tokenizer != "bytes" and not on_shared(tokenizer, shared):
        raise ShardstackError(f"--tokenizer {tokenizer} is not under the shared directory {shared}",
                              hint="put the model first (shardstack model put DIR) and pass its path on the "
                                   "cluster, or bytes")
    copied = None
    if on_shared(source, shared):
        where = source
    elif Path(source).exists():
        copied = put_data(cluster, Path(source), f"{out_name}-text")
        where = copied.path if Path(source).is_dir() else f"{copied.path}/{Path(source).name}"
    else:
        raise ShardstackError(f"input {source} is neither a file here nor a path under the shared directory {shared}")
    head = cluster.group("train_nodes")[0]
    venv = str(cluster.setting("training_runtime_venv", "training_runtime", "train_nodes"))
    out = f"{shared}/data/{out_name}"
    argv = prepare_argv(venv, cluster.job_account, where, out, tokenizer=tokenizer, workers=workers)
    res = run_command(argv, cluster.path, head)
    r = res.get(head)
    if r is None or not r.success:
        detail = ((r.stderr or r.stdout or r.message or "") if r else "no result").strip().splitlines()
        raise ShardstackError(f"data prepare on {head} failed: {detail[-1] if detail else 'rc ' + str(r.rc)}")
    try:
        meta = json.loads(r.stdout[r.stdout.index("{"):])
    except ValueError:
        raise ShardstackError(f"data prepare on {head} printed no result: {r.stdout[-300:]}") from None
    return ClusterPrepare(head, where, out, meta, copied)
