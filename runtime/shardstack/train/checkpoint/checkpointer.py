"""The collective side of checkpoints: every rank saves its DCP shards, rank 0 commits with a signed manifest (see
`layout` for the on-disk format) and prunes; `resume` loads the checkpoint a job goes on from (`resume.Resume`: the
newest that verifies, quarantining the invalid ones it passes, refusing another job's), `space` decides whether one
more fits.

Ownership: every manifest names its `job` (the job config's name) and a `run_id`: a random id drawn at the first
save of a job that did not resume, and copied from the checkpoint on every resume, so it names one line of history
across restarts, requeues and resubmissions (a `resume: never` start, or adopting a checkpoint that has none, draws
a new one)."""

from __future__ import annotations

import logging
import os
import socket
import time
import uuid
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.stateful import Stateful

from shardstack.errors import ShardstackError
from shardstack.signing import SigningKey, load_signing_key, sign
from shardstack.train.checkpoint.layout import (
    DCP_METADATA,
    MANIFEST,
    MANIFEST_FORMAT,
    file_entry,
    fsync_dir,
    fsync_file,
    list_checkpoints,
    quarantine,
    remove_tree,
    step_dir_name,
    verify_checkpoint,
    write_json_durable,
)
from shardstack.train.checkpoint.ranks import DistLike, Ranks
from shardstack.train.checkpoint.resume import Resume, quarantine_quietly
from shardstack.train.checkpoint.space import SpaceCheck, check_space
from shardstack.train.dist import process_group_timeout

if TYPE_CHECKING:
    from shardstack.train.config import CheckpointConfig

log = logging.getLogger("shardstack.checkpoint")

@dataclass
class _PendingSave:
    step: int
    future: Future
    started: float = field(default_factory=time.monotonic)


class Checkpointer:
    """Saves and restores the trainer's `app_state` (a DCP `Stateful`) under `cfg.dir`; a no-op when it is None.

    Every rank must call every method in the same order (they are collective). `job` owns the checkpoints: it is
    recorded in each manifest and resume refuses another job's. `stage` and `job_config` are recorded too: the stage
    for `checkpoint ls`, the job config so `export` knows the model shape.
    `on_space_check` is called on every rank with each save's `SpaceCheck`, `on_commit` with the step of each
    checkpoint once it is committed (in the background for async saves); the trainer feeds its metrics with both.
    """

    def __init__(
        self,
        cfg: CheckpointConfig,
        *,
        config_hash: str,
        job: str,
        dist: DistLike | None = None,
        stage: int | None = None,
        job_config: dict[str, Any] | None = None,
        on_space_check: Callable[[SpaceCheck], None] | None = None,
        on_commit: Callable[[int], None] | None = None,
    ) -> None:
        self.cfg = cfg
        if not isinstance(cfg.async_save, bool):  # a programming error: JobConfig.for_device settles it
            raise ValueError(f"checkpoint.async_save {cfg.async_save!r} is not settled for a device")
        self.async_save = cfg.async_save
        self.config_hash = config_hash
        self.job = job
        self.run_id: str | None = None  # from the checkpoint resumed, else drawn at the first save (rank 0)
        self.stage = stage
        self.job_config = job_config
        self.on_space_check = on_space_check
        self.on_commit = on_commit
        self.enabled = cfg.dir is not None
        self.root = Path(cfg.dir) if cfg.dir is not None else None
        self.ranks = Ranks(dist)
        self.rank, self.world_size = self.ranks.rank, self.ranks.world_size
        self.last_saved_step: int | None = None
        self.last_save_seconds: float | None = None  # blocking time of the last save (staging only when async)
        self.skipped_saves = 0
        self._last_skipped_step: int | None = None
        self._last_total_bytes: int | None = None  # of the newest checkpoint this job committed or resumed (rank 0)
        self._pending: _PendingSave | None = None
        self._executor: ThreadPoolExecutor | None = None
        self._pg = None
        self.key: SigningKey | None = self._open_key() if self.enabled else None
        if self.enabled and self.async_save:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="shardstack-ckpt")
            if self.ranks.distributed:
                # Async uploads run collectives from a background thread: give them their own gloo group so they
                # can never interleave with the training loop's collectives on the default group. Its timeout is
                # the job's (a new group does not inherit the default group's): these are the NFS-bound ones.
                timeout = process_group_timeout()
                self._pg = torch.distributed.new_group(backend="gloo",
                                                       **({"timeout": timeout} if timeout is not None else {}))

    def _open_key(self) -> SigningKey | None:
        """Every rank reads the key (any rank may be rank 0 after a restart); one rank's failure fails them all."""
        assert self.root is not None
        if not self.cfg.require_signature:
            if self.rank == 0:
                log.warning(
                    "checkpoint.require_signature is false: checkpoints under %s are saved and resumed UNSIGNED; "
                    "anyone who can write there can change what this job resumes (they still cannot run code "
                    "through it: nothing is unpickled into live objects)", self.root)
            return None
        key_path = Path(self.cfg.signing_key_file)
        key: SigningKey | None = None
        error: tuple[str, str | None] | None = None
        if key_path.resolve().is_relative_to(self.root.resolve()):
            error = (f"checkpoint.signing_key_file ({key_path}) lies under checkpoint.dir: whoever can write "
                     f"checkpoints could read the key", "keep the key off the shared storage")
        else:
            try:
                key = load_signing_key(key_path)
            except ShardstackError as exc:
                error = (exc.args[0], exc.hint)
        errors = [(rank, e) for rank, e in enumerate(self.ranks.all_gather(error)) if e is not None]
        if errors:
            rank, (message, hint) = errors[0]
            where = f" (rank {rank})" if self.world_size > 1 else ""
            raise ShardstackError(
                f"{message}{where}", hint=f"{hint + '; ' if hint else ''}checkpoint.signing_key_file names the key; "
                "a local single-user run without one can set checkpoint.require_signature: false")
        return key

    # -- resume ----------------------------------------------------------------------------------------------------

    def resume(self, app_state: Stateful) -> int:
        """Load the checkpoint `cfg.resume` names (auto: the newest valid one) into `app_state`; its step, or 0."""
        if not self.enabled or self.cfg.resume == "never":
            return 0
        assert self.root is not None
        t0 = time.monotonic()
        chosen = Resume(self.cfg, self.root, self.key, job=self.job, config_hash=self.config_hash,
                        ranks=self.ranks).load(app_state)
        if chosen is None:
            if self.rank == 0:
                log.info("no valid checkpoint under %s: starting from step 0", self.root)
            return 0
        path, manifest = chosen
        step = manifest["step"]
        self.last_saved_step = step
        self._last_total_bytes = manifest["total_bytes"]
        self.run_id = manifest.get("run_id")
        if self.rank == 0:
            restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)
            log.info(
                "%sresumed from %s (step %d, saved by %d ranks at stage %s; now %d ranks) in %.1fs; job %s, run %s",
                f"elastic restart {restart}: " if restart else "", path, step, manifest["world_size"],
                manifest["stage"], self.world_size, time.monotonic() - t0, self.job, self.run_id or "new",
            )
        return step

    # -- save ------------------------------------------------------------------------------------------------------

    def maybe_save(self, step: int, app_state: Stateful) -> bool:
        """Save when `step` is a multiple of the interval; otherwise only cheap local checks. True if it saved."""
        if not self.enabled or self.cfg.interval <= 0 or step % self.cfg.interval:
            self._raise_if_failed()
            return False
        return self.save(step, app_state)

    def finish(self, step: int, app_state: Stateful) -> None:
        """Save the last step unless it was just saved (or just skipped for space), then wait for every async save
        to commit."""
        if not self.enabled:
            return
        if step > 0 and step not in (self.last_saved_step, self._last_skipped_step):
            self.save(step, app_state)
        self.wait()
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None

    def wait(self) -> None:
        """Block until the pending async save (if any) has committed; re-raise its error."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.future.result()

    def _raise_if_failed(self) -> None:
        if self._pending is not None and self._pending.future.done() and self._pending.future.exception():
            self.wait()

    def save(self, step: int, app_state: Stateful) -> bool:
        """Save `step` unless the checkpoint filesystem lacks the space for it (then warn and return False)."""
        if not self.enabled:
            return False
        assert self.root is not None
        self.wait()  # one save in flight at a time; also surfaces a failed async save
        t0 = time.monotonic()
        state = app_state.state_dict()
        space = check_space(self.ranks, self.root, step, state, last_total_bytes=self._last_total_bytes,
                            first=self.last_saved_step is None)
        if self.on_space_check is not None:
            self.on_space_check(space)
        if space.skipped:
            self.skipped_saves += 1
            self._last_skipped_step = step
            if self.rank == 0:
                log.warning(
                    "skipping the checkpoint of step %d: %s has %.1f MiB free, one checkpoint needs about %.1f MiB "
                    "(with margin); training goes on, the newest checkpoint stays %s", step, self.root,
                    space.free_bytes / 2**20, space.needed_bytes / 2**20,
                    f"step {self.last_saved_step}" if self.last_saved_step is not None else "none")
            return False
        nonce = self.ranks.broadcast(uuid.uuid4().hex[:8] if self.rank == 0 else None)
        tmp = self.root / f"{step_dir_name(step)}.tmp-{nonce}"
        if self.rank == 0:
            tmp.mkdir(parents=True)
        self.ranks.broadcast(None)  # the directory exists before any rank writes into it
        if self.async_save:
            assert self._executor is not None
            upload = dcp.async_save(state, checkpoint_id=str(tmp), process_group=self._pg)
            self._pending = _PendingSave(step, self._executor.submit(self._finish_async, upload, step, tmp))
        else:
            dcp.save(state, checkpoint_id=str(tmp))
            self._commit(step, tmp, group=None)
        self.last_saved_step = step
        self.last_save_seconds = time.monotonic() - t0
        if self.rank == 0:
            log.info(
                "checkpoint step %d: %s in %.2fs", step,
                "staged, writing in the background" if self.async_save else "committed",
                self.last_save_seconds,
            )
        return True

    def _finish_async(self, upload: Any, step: int, tmp: Path) -> None:
        future = getattr(upload, "upload_completion", upload)
        future.result()
        self._commit(step, tmp, group=self._pg)
        if self.rank == 0:
            log.info("checkpoint step %d: committed in the background", step)

    def _commit(self, step: int, tmp: Path, *, group) -> None:
        """Hash every rank's shards, then rank 0 writes the manifest and renames the directory into place."""
        # DCP names each rank's files __<rank>_<n>.distcp and has fsynced them; each rank hashes its own.
        local = {p.name: file_entry(p) for p in sorted(tmp.glob(f"__{self.rank}_*.distcp"))}
        gathered = self.ranks.gather(local, group=group)
        error: str | None = None
        if self.rank == 0:
            try:
                self._write_manifest(step, tmp, gathered)  # type: ignore[arg-type]
            except OSError as exc:
                error = f"could not commit checkpoint step {step} in {tmp}: {exc}"
            except ShardstackError as exc:
                error = str(exc)
        error = self.ranks.broadcast(error, group=group)  # doubles as the barrier: nobody moves on before the commit
        if error is not None:
            raise ShardstackError(error)
        if self.on_commit is not None:
            self.on_commit(step)

    def _write_manifest(self, step: int, tmp: Path, per_rank: list[dict[str, dict[str, Any]]]) -> None:
        assert self.root is not None
        files: dict[str, dict[str, Any]] = {}
        for entries in per_rank:
            files.update(entries)
        fsync_file(tmp / DCP_METADATA)
        files[DCP_METADATA] = file_entry(tmp / DCP_METADATA)
        if self.run_id is None:
            self.run_id = uuid.uuid4().hex
            log.info("job %s: new run id %s (carried by every checkpoint it resumes from)", self.job, self.run_id)
        manifest = {
            "format": MANIFEST_FORMAT,
            "step": step,
            "world_size": self.world_size,
            "stage": self.stage,
            "config_hash": self.config_hash,
            "job": self.job,
            "run_id": self.run_id,
            "created": datetime.now(UTC).isoformat(timespec="seconds"),
            "host": socket.gethostname(),
            "torch_version": torch.__version__,
            "files": files,
            "total_bytes": sum(f["size"] for f in files.values()),
            "job_config": self.job_config,
        }
        write_json_durable(tmp / MANIFEST, sign(manifest, self.key) if self.key is not None else manifest)
        fsync_dir(tmp)
        final = self.root / step_dir_name(step)
        if final.exists():
            # Only after resuming from an older step (resume named one, or the newer ones are signed with another
            # key) or starting over (resume: never): this run's history replaces a valid one; an invalid one is
            # evidence and is quarantined instead.
            existing = verify_checkpoint(final, key=self.key, checksums=False)
            if existing.valid and not self._owns(existing.manifest):
                raise ShardstackError(
                    f"cannot commit checkpoint step {step}: {final} belongs to job "
                    f"{existing.manifest.get('job') if existing.manifest else None!r}, not to this job {self.job!r}",
                    hint="give each job its own checkpoint.dir")
            if existing.valid:
                log.warning("replacing existing %s with the checkpoint of this run", final)
                remove_tree(final)
            else:
                assert existing.problem is not None
                log.warning("existing %s is not valid: %s", final, existing.problem)
                quarantine(final, existing.problem)
        os.rename(tmp, final)
        fsync_dir(self.root)
        self._last_total_bytes = manifest["total_bytes"]
        self._prune(final)

    def _owns(self, manifest: dict[str, Any] | None) -> bool:
        """Whether a (valid) checkpoint is this job's: it names this job, or names none and this job adopts those."""
        job = manifest.get("job") if manifest is not None else None
        return job == self.job or (job is None and self.cfg.allow_config_change)

    def _prune(self, committed: Path) -> None:
        """Keep the newest `keep` valid checkpoints of this job and the one just committed; delete its older valid
        ones. Invalid ones are never counted and never deleted: they are quarantined (those signed with another key
        are left); another job's are left alone."""
        if self.cfg.keep <= 0:
            return
        kept = 0
        for _step, path in reversed(list_checkpoints(self.root)):  # type: ignore[arg-type]
            info = verify_checkpoint(path, key=self.key, checksums=False)  # sizes: cheap enough for every save
            if info.problem is not None:
                if info.problem.reason != "other-key":
                    log.warning("checkpoint %s is not valid: %s", path, info.problem)
                    quarantine_quietly(path, info.problem)
                continue
            if not self._owns(info.manifest):
                continue
            kept += 1
            if kept > self.cfg.keep and path != committed:
                log.info("removing %s (keep: %d)", path.name, self.cfg.keep)
                try:
                    remove_tree(path)
                except OSError as exc:
                    log.warning("could not remove %s: %s", path, exc.strerror)
