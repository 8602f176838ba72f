"""Which checkpoint a job resumes from, and loading it: the one `checkpoint.resume` names, or (auto) the newest
that verifies and loads, older ones tried in turn; each invalid one passed is quarantined (rank 0), and a checkpoint
of another job (or, unless allowed, another config) is refused. Collective: every rank calls `load`."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.stateful import Stateful

from shardstack.errors import ShardstackError
from shardstack.signing import SigningKey
from shardstack.train.checkpoint.layout import (
    STALE_RE,
    Problem,
    check_files,
    list_checkpoints,
    quarantine,
    read_manifest,
)
from shardstack.train.checkpoint.ranks import Ranks
from shardstack.train.checkpoint.reader import (
    CheckpointReader,
    ChecksumMismatch,
    WeightsOnlyLoadPlanner,
    dcp_failure,
)

if TYPE_CHECKING:
    from shardstack.train.config import CheckpointConfig

log = logging.getLogger("shardstack.checkpoint")


def quarantine_quietly(path: Path, problem: Problem) -> None:
    """Quarantine on rank 0 without ever raising: the other ranks are not waiting for it, they must not hang."""
    try:
        log.warning("quarantined %s as %s", path.name, quarantine(path, problem).name)
    except OSError as exc:
        log.warning("could not quarantine %s: %s", path, exc.strerror)


class Resume:
    """One resume of job `job` (whose config hashes to `config_hash`) from the checkpoints under `root`, checked
    with `key` (None: unsigned checkpoints, `require_signature: false`)."""

    def __init__(self, cfg: CheckpointConfig, root: Path, key: SigningKey | None, *, job: str, config_hash: str,
                 ranks: Ranks) -> None:
        self.cfg, self.root, self.key, self.job, self.config_hash, self.ranks = cfg, root, key, job, config_hash, ranks

    def load(self, app_state: Stateful) -> tuple[Path, dict[str, Any]] | None:
        """The checkpoint loaded into `app_state` and its manifest; None when auto found no valid one."""
        if self.ranks.rank == 0:
            self.root.mkdir(parents=True, exist_ok=True)
            self._remove_stale()
        if self.cfg.resume == "auto":
            return self._load_newest_valid(app_state)
        return self._load_explicit(Path(self.cfg.resume), app_state)

    def _check_owner(self, path: Path, manifest: dict[str, Any]) -> None:
        """Refuse another job's checkpoint always; one from another config, or one that names no job (written
        before manifests did), only with checkpoint.allow_config_change."""
        allow = self.cfg.allow_config_change
        flag = "--allow-config-change (checkpoint.allow_config_change: true)"
        theirs = manifest.get("job")
        if theirs is not None and theirs != self.job:
            raise ShardstackError(
                f"checkpoint {path} belongs to job {theirs!r}, not to this job {self.job!r}: refusing to resume it",
                hint=f"give each job its own checkpoint.dir: point job {self.job!r} at another one, or move job "
                     f"{theirs!r}'s checkpoints out of {self.root}")
        if theirs is None and not allow:
            raise ShardstackError(
                f"checkpoint {path} names no job (it was written before checkpoints recorded their job), so it "
                f"cannot be told apart from another job's; this job is {self.job!r}: refusing to resume it",
                hint=f"if it is this job's, resume once with {flag} to adopt it; otherwise give this job its own "
                     "checkpoint.dir")
        changed = manifest["config_hash"] != self.config_hash
        if changed and not allow:
            raise ShardstackError(
                f"checkpoint {path} of job {self.job!r} was written with config hash {manifest['config_hash']}, "
                f"this job's config hashes to {self.config_hash}: refusing to resume it",
                hint=f"the model, data, optimizer, schedule, global batch or seed changed; continue anyway with "
                     f"{flag}, or start over with checkpoint.resume: never or another checkpoint.dir")
        if self.ranks.rank == 0 and theirs is None:
            log.warning("adopting checkpoint %s, which names no job, as job %s's (allow_config_change); its next "
                        "checkpoint starts a new run id", path.name, self.job)
        if self.ranks.rank == 0 and changed:
            log.warning("checkpoint %s was written with config hash %s, this job has %s; resuming anyway "
                        "(allow_config_change; model and optimizer shapes are checked by the load)",
                        path.name, manifest["config_hash"], self.config_hash)

    def _load(self, path: Path, manifest: dict[str, Any], app_state: Stateful) -> tuple[Problem | None, bool]:
        """DCP load through the restricted reader and planner, which checks every file it reads against the signed
        manifest's sha256 as it reads it (the resume's one read of each file; nothing is deserialized before its
        file matched). A mismatch, or a `.metadata` that is not checkpoint metadata, is the Problem returned on
        every rank, with whether `app_state` may hold part of the checkpoint (its other files' items); any other
        rank's failure is one clear error on all."""
        reader = CheckpointReader(path, manifest["files"], verify_reads=True)
        problem: Problem | None = None
        try:
            reader.read_metadata()  # parsed and checked here, on every rank, so DCP never meets a bad one
        except ChecksumMismatch as exc:
            problem = Problem("checksum-mismatch", str(exc))
        except ShardstackError as exc:
            problem = Problem("bad-metadata", str(exc))
        problems = [p for p in self.ranks.all_gather(problem) if p is not None]
        if problems:
            return problems[0], False
        state = app_state.state_dict()
        try:
            dcp.load(state, storage_reader=reader, planner=WeightsOnlyLoadPlanner())
        except CheckpointException as exc:
            mismatch = next((err for err, _ in exc.failures.values() if isinstance(err, ChecksumMismatch)), None)
            if mismatch is not None:
                return Problem("checksum-mismatch", str(mismatch)), True
            raise ShardstackError(f"cannot load checkpoint {path}: {dcp_failure(exc)}") from None
        app_state.load_state_dict(state)
        return None, True

    def _load_explicit(self, path: Path, app_state: Stateful) -> tuple[Path, dict[str, Any]]:
        if not path.is_absolute() and not path.exists():
            path = self.root / path
        parsed = self.ranks.broadcast(read_manifest(path, key=self.key) if self.ranks.rank == 0 else None)
        problem = self._verify_everywhere(path, parsed)
        if problem is None:
            self._check_owner(path, parsed[0])  # the same broadcast manifest on every rank: all raise or none does
            problem, _ = self._load(path, parsed[0], app_state)
        if problem is not None:
            raise ShardstackError(
                f"checkpoint.resume names {path}, which is not a valid checkpoint: {problem}",
                hint="use resume: auto to take the newest valid checkpoint, or never to start fresh",
            )
        return path, parsed[0]

    def _load_newest_valid(self, app_state: Stateful) -> tuple[Path, dict[str, Any]] | None:
        """Load the newest checkpoint that verifies and loads, trying older ones; each invalid one is quarantined
        (rank 0), except those signed with another key: they may be fine, and this job must not start over on top
        of them. A file whose sha256 differs is found by the load itself (it reads each file once, hashing it), so
        the state may already hold another file's items: loading an older checkpoint overwrites all of them, but
        with none left this process must not train on from step 0."""
        candidates = self.ranks.broadcast(list_checkpoints(self.root) if self.ranks.rank == 0 else None)
        other_key: list[Problem] = []
        partly_loaded: tuple[Path, Problem] | None = None
        for _step, path in reversed(candidates):
            parsed = self.ranks.broadcast(read_manifest(path, key=self.key) if self.ranks.rank == 0 else None)
            problem = self._verify_everywhere(path, parsed)
            if problem is None:
                self._check_owner(path, parsed[0])  # the same broadcast manifest everywhere: all raise or none
                problem, touched = self._load(path, parsed[0], app_state)
                if problem is None:
                    return path, parsed[0]
                if touched:
                    partly_loaded = (path, problem)
            if problem.reason == "other-key":
                other_key.append(problem)
                if self.ranks.rank == 0:
                    log.warning("skipping checkpoint %s: %s; trying the previous one", path, problem)
                continue
            if self.ranks.rank == 0:
                log.warning("skipping checkpoint %s: %s; trying the previous one", path, problem)
                quarantine_quietly(path, problem)
        if other_key:
            raise ShardstackError(
                f"no checkpoint under {self.root} is signed with this job's key, and {len(other_key)} are signed "
                f"with another: {other_key[0]}",
                hint="put the key they were signed with at checkpoint.signing_key_file, or move those checkpoints "
                     "away to start from step 0")
        if partly_loaded is not None:
            raise ShardstackError(
                f"checkpoint {partly_loaded[0]} failed while it was loaded ({partly_loaded[1]}) and no older valid "
                "checkpoint is left; part of it may already be in the model, so this run does not start over",
                hint="run the job again: it starts from step 0 (the damaged checkpoint is quarantined)")
        return None

    def _verify_everywhere(self, path: Path, parsed: tuple[dict[str, Any] | None, Problem | None]) -> Problem | None:
        """Verify that the files are there with their sizes (split across ranks); the first problem any rank found,
        or None. The sha256 of each file is checked by the load, on the bytes it reads (`_load`): hashing here too
        would read every file twice."""
        manifest, problem = parsed
        if manifest is None:
            return problem
        names = sorted(manifest["files"])
        mine = check_files(path, manifest["files"], names[self.ranks.rank :: self.ranks.world_size], checksums=False)
        problems = [p for p in self.ranks.all_gather(mine) if p is not None]
        return problems[0] if problems else None

    def _remove_stale(self) -> None:
        """Directories of saves that never committed (a crash mid-save) or deletions that never finished."""
        for entry in self.root.iterdir():
            if STALE_RE.match(entry.name) and entry.is_dir():
                log.warning("removing %s: a save or delete that never finished", entry)
                shutil.rmtree(entry, ignore_errors=True)
