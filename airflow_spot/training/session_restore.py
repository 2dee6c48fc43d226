"""How a :class:`~airflow_spot.training.session.SpotSession` restores what ``track()`` registers: from the job's
newest usable checkpoint (rank 0 choosing it for every rank), else the warm start's, with each rank's own
random state. A mixin of ``SpotSession`` (it uses the session's ``checkpoints``, ``ranks``, ``tracked``, ``sharded``,
``warm_start_*``, ``start_step`` and ``_warned``)."""
from __future__ import annotations

import logging
import uuid
from typing import Any

import torch

from airflow_spot.storage.checkpoint import CheckpointError, CheckpointStore, Manifest
from airflow_spot.storage.host_share import HostShare
from airflow_spot.storage.object_store import open_store
from airflow_spot.storage.protocol import JobLayout
from airflow_spot.training.payload import load_foreign_payload, load_payload
from airflow_spot.training.sharded import DCP_KEY, BrokenShardError, read_payload
from airflow_spot.training.state import restore_rng

log = logging.getLogger("airflow_spot.session")


class SessionRestore:
    """Restore tracked objects (and the random state) from a checkpoint's payload."""

    def _restore(self, objects: dict[str, Any]) -> None:
        """Restore ``objects`` from the job's newest usable checkpoint (or the warm start's)."""
        restored = self._load_newest(self.checkpoints, read_payload(load_payload), lambda manifest, payload, fetch: (
            self.sharded.load(payload, tuple(objects), self._source(manifest), fetch=fetch)))
        if restored is not None:
            manifest, payload = restored
            self._apply(payload, keys=tuple(objects), source=self._source(manifest))
            self.step = self.restored_step = manifest.step
            log.info("resumed from checkpoint at step %d (%s)", manifest.step, manifest.directory)
        elif self.warm_start_uri:
            keys = tuple(k for k in objects if k in self.warm_start_keys)
            warm = self._load_newest(
                CheckpointStore(open_store(self.warm_start_uri).child(JobLayout.CHECKPOINTS)),
                read_payload(load_foreign_payload), lambda manifest, payload, fetch: self.sharded.load(
                    payload, keys, self._source(manifest, warm=True), objects, warm=True, fetch=fetch))
            if warm is None:
                raise FileNotFoundError(f"warm start: no checkpoint under {self.warm_start_uri}")
            self._apply(warm[1], keys=keys, rng=False, source=self._source(warm[0], warm=True))
            log.info("warm-started %s from %s step %d", self.warm_start_keys, self.warm_start_uri, warm[0].step)
        elif self.start_step > 0:  # planned after progress that was committed and is now gone: never redo from 0
            raise CheckpointError(
                f"this segment was planned to start at step {self.start_step}, but {self.checkpoints.store.uri} "
                "holds no checkpoint: the checkpoint directory was deleted or the store emptied. Put the "
                "checkpoints back (e.g. from a backup), or start the job again from step 0 under a new checkpoint_uri"
            )

    def _source(self, manifest: Manifest, warm: bool = False) -> str:
        if warm:
            return f"the warm start's checkpoint at step {manifest.step} ({self.warm_start_uri})"
        return f"the checkpoint at step {manifest.step} ({self.checkpoints.store.uri}/{manifest.directory})"

    def _load_newest(self, checkpoints: CheckpointStore, read, load_sharded) -> tuple[Manifest, dict] | None:
        """The newest usable checkpoint of ``checkpoints`` and its payload, its sharded state loaded by
        ``load_sharded(manifest, payload, fetch)`` (``fetch(names, folder)``: the shard files a rank reads). A
        checkpoint with a shard file found broken there is skipped as one with a broken payload is, and the next
        older one restored in its place: every rank knows (DCP gathers the ranks' failures, and they agree)."""
        skip: dict[str, str] = {}
        while True:
            restored, share = self._restore_latest(checkpoints, read, skip)
            if restored is None:
                if share is not None:
                    share.remove()
                return None
            manifest, payload = restored
            shared = checkpoints.sharing(share)

            def fetch(names: list[str], folder: str) -> None:
                fetched = shared.fetch_into(manifest, folder, names)
                if share is None and fetched:
                    log.info("checkpoint files: %d fetched from the store", fetched)

            failure: Exception | None = None
            try:
                load_sharded(manifest, payload, fetch)
            except Exception as exc:  # noqa: BLE001 - raised below, once every rank knows
                failure = exc
            if not self._fall_back(share, failure):
                if failure is not None:
                    raise failure
                return restored
            skip[manifest.directory] = str(failure or "another rank found one of its shard files broken")

    def _fall_back(self, share: HostShare | None, failure: Exception | None) -> bool:
        """Whether every rank skips this checkpoint for an older one (a broken shard file); removes the host
        share once every rank has read what it needs. A rank that failed otherwise fails every rank here, rather
        than leaving the others to wait for it in their first collective."""
        broken = isinstance(failure, BrokenShardError)
        if self.ranks is None:
            return broken
        any_broken, other = self.ranks.agree(broken, failure is not None and not broken)
        if share is not None:
            share.remove()
            if share.fetched or share.reused:
                log.info("checkpoint files: %d fetched from the store by this rank, %d fetched by another rank of "
                         "this host", share.fetched, share.reused)
        if other and failure is None:
            raise CheckpointError("another rank could not restore the checkpoint rank 0 chose (its log says why); "
                                  "every rank stops, and the next attempt restores again")
        return any_broken and not other

    def _restore_latest(self, checkpoints: CheckpointStore, load, skip: dict[str, str]
                        ) -> tuple[tuple[Manifest, dict] | None, HostShare | None]:
        """The newest usable checkpoint of ``checkpoints`` (but those in ``skip``) and its payload, and the host
        share its files are fetched through (None: one process). Under several ranks rank 0 chooses it (the
        fall-back past broken checkpoints included) and every rank reads that one: ranks that read "the newest"
        each would load different states if a save or a prune came in between."""
        if self.ranks is None:
            return checkpoints.restore_latest(load, skip), None
        # (directory, error, token of the host share): the ranks of one host fetch each file once between them
        chosen: tuple[str | None, str | None, str] = (None, None, uuid.uuid4().hex)
        restored = share = None
        if self.is_writer:
            share = HostShare(chosen[2])
            try:
                restored = checkpoints.sharing(share).restore_latest(load, skip)
                chosen = (restored[0].directory if restored else None, None, chosen[2])
            except Exception as exc:  # every rank fails with it, rather than waiting for rank 0
                share.remove()
                self.ranks.from_writer((None, f"{type(exc).__name__}: {exc}", chosen[2]))
                raise
        directory, error, token = self.ranks.from_writer(chosen)
        if error is not None:
            raise CheckpointError(f"rank 0 could not restore the job's checkpoint: {error}")
        share = share or HostShare(token)
        failure = None
        try:
            if not self.is_writer and directory is not None:
                restored = checkpoints.sharing(share).restore(directory, load)
        except Exception as exc:  # noqa: BLE001 - raised below, once every rank knows
            failure = exc
        # every rank has the payload once all agree; a rank that could not read it fails every rank here (not
        # later, inside DCP's collectives, where the others would wait for it)
        (failed,) = self.ranks.agree(failure is not None)
        if failure is not None or failed:
            share.remove()
        if failure is not None:
            raise failure
        if failed:
            raise CheckpointError(f"another rank could not read the checkpoint {directory} rank 0 chose (its log "
                                  "says why); every rank stops, and the next attempt restores again")
        return restored, share

    def _checkpointable(self, objects: dict[str, Any]) -> dict[str, Any]:
        """What to checkpoint for each object handed to ``track()``; warns (once per problem, at start)
        about data feeding that cannot resume bit-exactly (see :mod:`airflow_spot.training.data`)."""
        from torch.utils.data import DataLoader

        from airflow_spot.training.data import GeneratorState, adopt_data_loader

        out: dict[str, Any] = {}
        for name, obj in objects.items():
            problems: list[str] = []
            if isinstance(obj, DataLoader):
                obj, problems = adopt_data_loader(name, obj)
            elif GeneratorState.supports(obj):
                obj = GeneratorState(obj)
            elif not (hasattr(obj, "state_dict") and hasattr(obj, "load_state_dict")):
                raise TypeError(
                    f"track({name}=...): {type(obj).__name__} has no state_dict/load_state_dict, so it cannot be "
                    "checkpointed (track models, optimizers, schedulers, samplers, DataLoaders, RNGs)"
                )
            if hasattr(obj, "resume_warnings"):
                problems += obj.resume_warnings()
            for problem in problems:
                if problem not in self._warned:
                    self._warned.add(problem)
                    log.warning("resume will not be bit-exact: %s", problem)
            if obj is not None:
                out[name] = obj
        if torch.cuda.is_available() and not torch.are_deterministic_algorithms_enabled():
            problem = ("CUDA kernels may be non-deterministic: a resumed run continues from the saved state but is "
                       "not bit-identical to an uninterrupted one; call torch.use_deterministic_algorithms(True)")
            if problem not in self._warned:
                self._warned.add(problem)
                log.warning("resume will not be bit-exact: %s", problem)
        return out

    def _apply(self, payload: dict, keys: tuple[str, ...], source: str, rng: bool = True) -> None:
        own = self._own_rank_state(payload, source) if rng else None
        saved = {**payload["objects"], **(own or {}).get("objects", {})}  # this rank's own random generators
        for name in keys:
            if name in self.sharded or name in (payload.get(DCP_KEY) or ()):
                continue  # restored by ShardedObjects.load (through DCP; across the kinds at a warm start, else refused)
            if name not in saved:
                raise KeyError(f"{source} has no state for tracked object {name!r} (it holds {sorted(saved)}): "
                               "track under the names the job saved, or start a new job (a new checkpoint_uri)")
            try:
                self.tracked[name].load_state_dict(saved[name])
            except Exception as exc:
                raise RuntimeError(
                    f"cannot restore tracked object {name!r} from {source}: {type(exc).__name__}: {exc}. Build "
                    f"{name!r} as it was when that checkpoint was saved (the same shapes and parameter groups; "
                    "change it after track()), or train the changed model as a new job: a new checkpoint_uri, "
                    "with warm_start_uri to start it from this job's weights") from exc
        if rng:
            restore_rng(own["rng"] if own else payload["rng"])

    def _own_rank_state(self, payload: dict, source: str) -> dict | None:
        """This rank's own part of ``payload``: its global RNG state and its tracked random generators
        (``{"rng", "objects"}``); None for rank 0 and a single process (the payload's own are theirs)."""
        if self.ranks is None or self.ranks.writer:
            return None
        per_rank = payload.get("rank_state") or []
        if len(per_rank) == self.ranks.world_size:
            return per_rank[self.ranks.rank]
        problem = (f"{source} was saved by {len(per_rank) or 1} rank(s), this attempt runs {self.ranks.world_size}: "
                   "each rank takes rank 0's random state and random generators")
        if problem not in self._warned:
            self._warned.add(problem)
            log.warning("resume will not be bit-exact: %s", problem)
        return None
