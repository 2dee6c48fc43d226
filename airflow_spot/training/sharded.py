"""Sharded state (FSDP2 ``fully_shard``, DTensor parameters) saved and restored through
``torch.distributed.checkpoint`` (DCP), inside the store's checkpoints.

Data parallel ranks hold the same state, so rank 0 writes one payload for all (:mod:`.session`). Sharded ranks
each hold a different part of the model and optimizer, so each must write its own: a tracked ``nn.Module``
whose state dict holds a DTensor, and a tracked optimizer over its parameters, are saved with DCP's per-rank
layout (``.metadata`` and ``__<rank>_<n>.distcp``), and resumed with DCP, which reshards when the resumed run
has another number of ranks. Everything else (the other tracked objects, each rank's random state, the step)
stays in rank 0's payload, as under data parallel; the payload names the objects DCP holds (``"dcp"``).

One save, on every rank:

1. rank 0 names the checkpoint's directory and tells the others;
2. ``dcp.save`` writes each rank's part into a **node-local temporary folder** of that rank (a folder of its
   own, so nothing assumes the ranks share a disk: the next step is several instances an attempt);
3. each rank puts its own files into the checkpoint's directory of the store, hashed on the way
   (:meth:`CheckpointStore.put_file`), rank 0 its payload too;
4. rank 0 gathers every rank's file entries (or its error) and commits the one manifest (schema 4,
   ``meta["layout"] = "dcp"``), last; a rank that failed means no manifest, so never one naming a file that
   is not published.

Why a local folder and not a DCP ``StorageWriter`` over the store: DCP's ``FileSystemWriter`` is the tested
path for its layout (write planning, deduplication of replicated tensors, the metadata), and going through
a local file lets the store's own upload (boto3's transfer manager, the block digest, the published-size
check) publish each file unchanged. The cost is a second pass over the bytes through the local disk.

Periodic (and insurance) saves are **two-phase**, as unsharded ones are: in the foreground each rank copies its
shards to host memory (DCP's own staging helpers, which keep each DTensor's mesh and placements), the stall;
then steps 1-4 run in the session writer's background thread on every rank, while training goes on. Their
collectives (DCP's planning, the directory's name, the gather of file entries, the outcome) run on a gloo group
made for saves alone (:attr:`ShardedObjects.save_group`): on the group of the training step's collectives or
of the session's per-step agreement, a collective from the thread would interleave with the main thread's in
another order on another rank. Every rank starts the same background saves in the same order, because the
session starts them only on flags agreed by all ranks (each rank's writer being busy among them: one in
flight at a time), and waits for the one in flight before any synchronous save (a notice's, ``spot.save()``,
the final one), which writes from the live state without the copy. A failed background save is logged and
counted (:meth:`AsyncCheckpointer._collect`); it commits nothing and the next one tries again.

Restore: rank 0 chooses the checkpoint (falling back past broken ones, as for a payload; the sizes of all its
files checked); each rank gets the payload and DCP's metadata, then ``dcp.load`` through a reader that fetches
the shard files this rank's plan reads, and only those, each verified against the manifest (once per host,
through the :class:`~airflow_spot.storage.host_share.HostShare` the session's restore opens): the hosts of a
several-node job each fetch their own ranks' shards (and rank 0's file, which holds the unsharded entries),
not the whole checkpoint. A shard file that does not verify fails every rank's ``dcp.load`` (DCP gathers the
ranks' failures) as :class:`BrokenShardError`, and the session falls back to the checkpoint before.
Then ``set_model_state_dict`` / ``set_optimizer_state_dict``.
"""
from __future__ import annotations

import logging
import os
import shutil
import tempfile
import time
import uuid
from collections.abc import Callable
from typing import Any

import torch

from airflow_spot.storage.checkpoint import (
    FETCH_PREFIX, LAYOUT_DCP, PAYLOAD, CheckpointError, CheckpointSaveError, CheckpointStore, FileEntry, Manifest,
)
from airflow_spot.storage.object_store import store_errors
from airflow_spot.training.async_save import AsyncCheckpointer
from airflow_spot.training.ranks import Ranks

log = logging.getLogger("airflow_spot.session")

#: the payload's key naming the tracked objects whose state is in the checkpoint's DCP files
DCP_KEY = "dcp"
#: the payload's key naming the optimizers that had no state yet when saved (see :meth:`ShardedObjects._save`)
FRESH_KEY = "dcp_fresh"
#: the payload's key for the local folder holding the verified DCP files (added when read, never saved)
_FOLDER_KEY = "_dcp_folder"


class BrokenShardError(CheckpointError):
    """A shard file of the checkpoint being restored is missing or does not verify: the checkpoint is unusable
    (raised on every rank alike, so the ranks fall back together)."""


def _dtensor_type() -> type | None:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # torch built without distributed
        return None
    return DTensor


def holds_dtensor(obj: Any) -> bool:
    """Whether a (nested) state dict holds a DTensor."""
    dtensor = _dtensor_type()
    if dtensor is None:
        return False
    stack = [obj]
    while stack:
        item = stack.pop()
        if isinstance(item, dtensor):
            return True
        if isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, (list, tuple)):
            stack.extend(item)
    return False


class ShardedObjects:
    """The tracked objects whose state is sharded, and how to save and restore them with DCP.

    :param ranks: the attempt's ranks (None: one process, which may still run ``torch.distributed`` on one rank).
    """

    def __init__(self, ranks: Ranks | None) -> None:
        self.ranks = ranks
        #: name -> the module (a model) or (module, optimizer) (an optimizer over that module's parameters)
        self.objects: dict[str, Any] = {}
        #: a gloo group for the saves' collectives alone (made when sharded state is first tracked; see module doc)
        self.save_group: Any = None
        #: this process's ranks over ``save_group`` (None: one process)
        self._save_ranks: Ranks | None = None
        #: the host copy of the last background save and the layout it was made for (see :func:`_to_host`)
        self._host: tuple[tuple, dict[str, Any]] | None = None

    def __bool__(self) -> bool:
        return bool(self.objects)

    def __contains__(self, name: str) -> bool:
        return name in self.objects

    # ------------------------------------------------------------------ track
    def classify(self, objects: dict[str, Any], tracked: dict[str, Any]) -> None:
        """Add the sharded ones of ``objects`` (``tracked``: every object tracked so far, these included).

        :raises ValueError: for sharded state this cannot save: an optimizer over sharded and plain parameters,
            or over parameters of no tracked sharded model; DTensors in another kind of object.
        :raises RuntimeError: sharded state without ``torch.distributed`` initialised.
        """
        from torch import nn

        found: dict[str, Any] = {}
        for name, obj in objects.items():
            if isinstance(obj, nn.Module):
                if holds_dtensor(obj.state_dict()):
                    found[name] = obj
            elif isinstance(obj, torch.optim.Optimizer):
                kinds = {holds_dtensor(p) for g in obj.param_groups for p in g["params"]}
                if kinds == {True, False}:
                    raise ValueError(
                        f"track({name}=...): the optimizer holds sharded (DTensor) and plain parameters; one "
                        "checkpoint format cannot hold both. Give the sharded parameters and the plain ones "
                        "optimizers of their own, or shard the whole model (fully_shard on its root module too)")
                if kinds == {True}:
                    found[name] = obj
            elif hasattr(obj, "state_dict") and holds_dtensor(obj.state_dict()):
                raise ValueError(
                    f"track({name}=...): {type(obj).__name__}'s state holds sharded tensors (DTensor), which only a "
                    "tracked nn.Module or torch.optim.Optimizer is saved as (through torch.distributed.checkpoint); "
                    "rank 0's payload would keep rank 0's shard only. Keep this state in plain tensors, or in a "
                    "module or optimizer")
        if not found:
            return
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError(
                f"track({', '.join(found)}): sharded state (DTensor parameters, e.g. FSDP fully_shard) needs "
                "torch.distributed: call torch.distributed.init_process_group() before the SpotSession is built, "
                "and keep it until the session ends (each rank saves its own shard through it)")
        if self.save_group is None:
            # Every rank tracks the same objects, so every rank gets here once, as new_group needs. A CPU group
            # (gloo) even under NCCL: DCP's planning collectives and the commit's carry Python objects.
            self.save_group = dist.new_group(backend="gloo")
            if self.ranks is not None:
                self._save_ranks = Ranks(self.ranks.rank, self.ranks.world_size, self.save_group)
        modules = {n: o for n, o in {**tracked, **found}.items() if isinstance(o, nn.Module) and
                   (n in found or n in self.objects)}
        for name, obj in found.items():
            if isinstance(obj, nn.Module):
                self.objects[name] = obj
                continue
            params = {id(p) for g in obj.param_groups for p in g["params"]}
            owner = [n for n, m in modules.items() if params <= {id(p) for p in m.parameters()}]
            if not owner:
                raise ValueError(
                    f"track({name}=...): the optimizer's parameters are sharded but belong to no single tracked "
                    f"sharded model (tracked: {sorted(modules) or 'none'}); track the model it optimizes in the same "
                    f"or an earlier track() call, e.g. spot.track(model=model, {name}={name})")
            self.objects[name] = (modules[owner[0]], obj)

    # ------------------------------------------------------------------ state dicts
    def _state(self, names: list[str]) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

        out = {}
        for name in names:
            obj = self.objects[name]
            out[name] = (get_optimizer_state_dict(*obj) if isinstance(obj, tuple) else get_model_state_dict(obj))
        return out

    def _group(self) -> Any:
        # the ranks' gloo group (a CPU group: DCP's planning collectives carry objects); None: the default group
        return self.ranks.group if self.ranks is not None else None

    # ------------------------------------------------------------------ save
    def save(self, checkpoints: CheckpointStore, writer: AsyncCheckpointer, step: int, payload: dict | None,
             meta: dict, background: bool) -> bool:
        """Save one checkpoint at ``step`` (every rank calls it, at the same point of the same sequence of saves;
        ``payload`` is rank 0's, None elsewhere) and record it with rank 0's ``writer`` (its last committed step;
        retention).

        ``background``: stage the shards to host memory and hand the rest to ``writer``'s thread (the caller
        agreed with every rank that no rank's writer is busy, and waits for it before the next synchronous
        save); returns True, the time spent here being the save's stall. Otherwise write now, from the live
        state, after the write in flight (if any); returns False (the save's time is recorded as its write).

        :raises CheckpointSaveError: on every rank, when any rank could not write its part of a synchronous save
            (nothing committed); a background save's is logged by ``writer``, and the next one tries again."""
        writer.wait()  # the previous background save's collectives come first, on every rank
        background = background and _host_copy_available()  # (the same on every rank: one torch build)
        # get_optimizer_state_dict gives an optimizer without state yet (a save before the first step) some, by a
        # step at lr 0 (Adam's step count then starts at 1): that is undone here and at the restore, for bit-exactness
        fresh = sorted(n for n, o in self.objects.items() if isinstance(o, tuple) and not o[1].state)
        try:
            state = self._state(sorted(self.objects))  # its names: what the payload says DCP holds
            if background:
                state, self._host = _to_host(state, self._host)
        finally:
            for name in fresh:
                self.objects[name][1].state.clear()  # the state dict (and its copy) keep their own references
        if background:
            if not writer.submit(self._write_and_record, checkpoints, writer, step, state, payload, meta, fresh):
                # cannot be, after writer.wait(); were it so, this rank would skip a save the others take
                raise RuntimeError("a background sharded save was refused: the writer is busy")
            return True
        self._write_and_record(checkpoints, writer, step, state, payload, meta, fresh)
        return False

    def _write_and_record(self, checkpoints: CheckpointStore, writer: AsyncCheckpointer, step: int,
                          state: dict[str, Any], payload: dict | None, meta: dict, fresh: list[str]) -> None:
        started = time.monotonic()
        manifest = self._save(checkpoints, step, state, payload, meta, fresh)
        if manifest is not None:  # rank 0, committed: heartbeats now name this step
            writer.committed(manifest, time.monotonic() - started)

    def _save(self, checkpoints: CheckpointStore, step: int, state: dict[str, Any], payload: dict | None, meta: dict,
              fresh: list[str]) -> Manifest | None:
        # Every collective here is on save_group: this may run in the writer's thread beside the training step.
        import torch.distributed.checkpoint as dcp

        started = time.monotonic()
        ranks = self._save_ranks
        writer = ranks is None or ranks.writer
        directory = checkpoints.new_directory(step) if writer else None
        if ranks is not None:
            directory = ranks.from_writer(directory)
        entries: list[FileEntry] = []
        error = None
        # DCP makes the folder in its planning step, whose errors it hands to every rank: a rank that failed to
        # make it here would skip collectives the others wait in (and misalign every later save's)
        folder = os.path.join(tempfile.gettempdir(), f"airflow-spot-dcp-{os.getpid()}-{uuid.uuid4().hex[:12]}")
        try:
            # sync_files=False: these files are temporary; the store's upload is what must be durable.
            # Entries every rank holds alike (an optimizer's step counts, its param groups) go to rank 0's file,
            # not spread over all: a restoring rank fetches whole files, and would otherwise fetch nearly every
            # rank's file for a few bytes of each
            dcp.save(state, process_group=self.save_group,
                     storage_writer=dcp.FileSystemWriter(folder, sync_files=False),
                     planner=dcp.DefaultSavePlanner(dedup_save_to_lowest_rank=True))
            for name in sorted(os.listdir(folder)):
                entries.append(checkpoints.put_file(directory, name, _copy_from(os.path.join(folder, name)), step))
            if writer:
                # the staged state's names, not self.objects': one tracked since has no DCP files here
                body = {**payload, DCP_KEY: sorted(state), FRESH_KEY: fresh}
                entries.insert(0, checkpoints.put_file(directory, PAYLOAD, lambda f: torch.save(body, f), step))
        except Exception as exc:  # noqa: BLE001 - reported to rank 0, which commits nothing; raised on every rank
            rank = 0 if ranks is None else ranks.rank
            error = f"rank {rank}: {type(exc).__name__}: {exc}"
        finally:
            shutil.rmtree(folder, ignore_errors=True)
        gathered = [(entries, error)] if ranks is None else ranks.to_writer((entries, error))
        manifest, outcome = None, None
        if writer:
            outcome = "; ".join(e for _, e in gathered if e)
            files = [f for fs, _ in gathered for f in fs]
            if not outcome and len({f.name for f in files}) != len(files):
                outcome = f"two ranks wrote files of one name: {sorted(f.name for f in files)}"
            if not outcome:
                try:
                    manifest = checkpoints.commit(step, directory, tuple(files), meta, time.monotonic() - started,
                                                  layout=LAYOUT_DCP)
                except Exception as exc:  # noqa: BLE001 - every rank raises it below
                    outcome = f"rank 0 committing: {type(exc).__name__}: {exc}"
        if ranks is not None:
            outcome = ranks.from_writer(outcome)
        if outcome:
            raise CheckpointSaveError(f"sharded checkpoint at step {step} was not committed ({outcome}); committed "
                                      "checkpoints are untouched")
        return manifest

    # ------------------------------------------------------------------ restore
    def load(self, payload: dict, names: tuple[str, ...], source: str, tracked: dict[str, Any] | None = None,
             warm: bool = False, fetch: Fetch | None = None) -> None:
        """Restore the sharded ones of ``names`` from the DCP files beside ``payload`` (every rank calls it,
        with the payload it read, and so the same names); removes the local copy of the files. ``fetch(names,
        folder)`` brings the shard files a rank reads into the folder (None: they are there already).

        A warm start (``warm``) also crosses between the two kinds for a model (an ``nn.Module``; ``tracked``
        holds this run's objects): an unsharded job's model into this run's sharded one (its full state dict,
        sharded here) and a sharded job's model into this run's unsharded one (DCP reads the shards into full
        tensors). A resume of the job's own state, and an optimizer either way, are refused with the fix."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.api import CheckpointException
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions, get_model_state_dict, set_model_state_dict, set_optimizer_state_dict,
        )

        folder = payload.pop(_FOLDER_KEY, None)
        tracked = tracked or {}
        try:
            saved = set(payload.get(DCP_KEY) or ())
            wanted = [n for n in names if n in self.objects and n in saved]
            into_sharded, into_plain = [], []  # a warm start's models crossing between the two kinds
            for name in names:
                if name in saved and name not in self.objects:
                    if warm and isinstance(tracked.get(name), torch.nn.Module):
                        into_plain.append(name)
                        continue
                    raise RuntimeError(
                        f"{source} holds {name!r} sharded (saved through torch.distributed.checkpoint) but this run "
                        f"tracks it unsharded; shard it as that job did (fully_shard), or convert the checkpoint to "
                        "one file (torch.distributed.checkpoint.format_utils.dcp_to_torch_save) and load it yourself")
                if name in self.objects and name not in saved:
                    if warm and not isinstance(self.objects[name], tuple) and name in payload["objects"]:
                        into_sharded.append(name)
                        continue
                    raise RuntimeError(
                        f"{source} holds {name!r} " + ("in one payload (unsharded)" if name in payload["objects"]
                                                       else "nowhere") +
                        ", but this run tracks it sharded; resuming an unsharded job's state (or warm-starting an "
                        "optimizer) into sharded state is not supported: run it unsharded, or start a new job (a "
                        "new checkpoint_uri) that warm-starts the model only (warm_start_keys)")
            try:
                if wanted:
                    state = self._state(wanted)
                    dcp.load(state, process_group=self._group(), storage_reader=_reader(folder, fetch))
                    for name in wanted:
                        obj = self.objects[name]
                        if isinstance(obj, tuple):
                            set_optimizer_state_dict(obj[0], obj[1], state[name])
                            if name in (payload.get(FRESH_KEY) or ()):
                                obj[1].state.clear()  # saved before its first step: no state, as then
                        else:
                            set_model_state_dict(obj, state[name])
                for name in into_sharded:  # every rank holds the full state dict: each takes its shards of it
                    set_model_state_dict(self.objects[name], _without_ddp_prefix(payload["objects"][name]),
                                         options=StateDictOptions(full_state_dict=True))
                for name in into_plain:  # every rank reads the whole model from the shard files, on its own
                    full = {name: get_model_state_dict(tracked[name])}
                    dcp.load(full, storage_reader=_reader(folder, fetch), no_dist=True)
                    set_model_state_dict(tracked[name], full[name])
            except CheckpointException as exc:  # a BaseException: the ranks' gathered failures
                raise _read_failure(exc, source) from exc
            except Exception as exc:
                crossing = " (from the other kind: sharded / unsharded)" if into_sharded or into_plain else ""
                raise RuntimeError(
                    f"cannot restore {wanted + into_sharded + into_plain} from {source}{crossing}: "
                    f"{type(exc).__name__}: {exc}. Build them as they were when that checkpoint was saved (the same "
                    "shapes, parameter names and groups), or train the changed model as a new job (a new "
                    "checkpoint_uri)") from exc
        finally:
            if folder:
                shutil.rmtree(folder, ignore_errors=True)


#: ``fetch(names, folder)``: brings the named files of the checkpoint being restored, verified, into ``folder``
Fetch = Callable[[list[str], str], None]


def _reader(folder: str, fetch: Fetch | None) -> Any:
    """DCP's file reader over ``folder``, fetching first the files this rank's read plan names."""
    import torch.distributed.checkpoint as dcp

    class FetchingReader(dcp.FileSystemReader):
        def read_data(self, plan, planner):
            if fetch is not None:
                fetch(sorted({self.storage_data[item.storage_index].relative_path for item in plan.items}), folder)
            return super().read_data(plan, planner)

    return FetchingReader(folder)


def _read_failure(exc: BaseException, source: str) -> Exception:
    """What a failed ``dcp.load`` means: a broken shard file (:class:`BrokenShardError`, to fall back), a store
    that cannot be read (a :class:`CheckpointError`, never a fall-back), else the state not matching the files."""
    failures = [e for e, _ in getattr(exc, "failures", {}).values()] or [exc]
    for failure in failures:
        if isinstance(failure, CheckpointError):
            return BrokenShardError(f"{source}: {failure}")
    for failure in failures:
        if isinstance(failure, store_errors()):
            return CheckpointError(f"cannot read {source}: {type(failure).__name__}: {failure}; the store is "
                                   "unreachable or refuses reads: retry once it is back")
    first = failures[0]
    return RuntimeError(
        f"cannot restore from {source}: {type(first).__name__}: {first}. Build the sharded state as it was when "
        "that checkpoint was saved (the same shapes, parameter names and groups), or train the changed model as a "
        "new job (a new checkpoint_uri)")


def _without_ddp_prefix(state: dict[str, Any]) -> dict[str, Any]:
    """An unsharded job that tracked its ``DistributedDataParallel`` wrapper saved every key under ``module.``;
    the sharded model's names have no such prefix."""
    if state and all(k.startswith("module.") for k in state):
        return {k[len("module."):]: v for k, v in state.items()}
    return state


def read_payload(load) -> Any:
    """A reader for :meth:`CheckpointStore.restore_latest`: ``load(path)`` of the payload; for a sharded
    checkpoint it also keeps the verified DCP files, which :meth:`CheckpointStore.read_checkpoint` fetched
    beside the payload into a folder it removes afterwards, in a folder of this rank's own (named in the
    payload, for :meth:`ShardedObjects.load`)."""
    def read(path: str) -> Any:
        payload = load(path)
        here = os.path.dirname(path)
        # only from the folder read_checkpoint made (a file:// payload read in place is the store's own file)
        if isinstance(payload, dict) and payload.get(DCP_KEY) and os.path.basename(here).startswith(FETCH_PREFIX):
            keep = tempfile.mkdtemp(prefix="airflow-spot-dcp-")
            for name in os.listdir(here):
                if name != os.path.basename(path):
                    shutil.move(os.path.join(here, name), os.path.join(keep, name))
            payload[_FOLDER_KEY] = keep
        return payload

    return read


def _host_copy_available() -> bool:
    """Whether this torch has DCP's staging helpers (private; a torch without them saves synchronously)."""
    try:
        from torch.distributed._state_dict_utils import _copy_state_dict, _create_cpu_state_dict  # noqa: F401
    except ImportError:
        return False
    return True


def _to_host(state: dict[str, Any], kept: tuple[tuple, dict[str, Any]] | None
             ) -> tuple[dict[str, Any], tuple[tuple, dict[str, Any]]]:
    """A copy of ``state`` in host memory that training cannot change: each DTensor's local shard copied to CPU
    (pinned when there is a GPU, for the copy's speed), its mesh and placements kept, so DCP plans and writes it as
    it would the live state. DCP's own staging helpers (those of ``dcp.async_save``).

    The buffers are kept for the next save (``kept``: the layout they were made for and the buffers) and copied
    into again while the state's layout is unchanged: allocating (and pinning) them anew each save costs more
    than the copy (``benchmarks/bench_sharded_staging.py``: 768 MB of FSDP2 + Adam state on CPU, 1.95 s against 0.19 s). Plain values (a learning rate) come from the live
    state each time. The copy would broadcast into a buffer of another shape rather than fail, so the layout is
    compared first; any change (an optimizer's first state) makes new buffers. One save is in flight at a time
    (the caller waited for the previous one), so no write still reads them. Returns the copy and what to keep."""
    from torch.distributed._state_dict_utils import _copy_state_dict, _create_cpu_state_dict

    layout = _layout(state)
    if kept is None or kept[0] != layout:
        kept = (layout, _create_cpu_state_dict(state, pin_memory=torch.cuda.is_available()))
    return _copy_state_dict(state, kept[1], non_blocking=False), kept


def _layout(obj: Any) -> tuple:
    """What the host buffers of ``obj`` depend on: its keys, and each tensor's kind, shape, dtype (and a DTensor's
    local shape and placements)."""
    if isinstance(obj, dict):
        return tuple((key, _layout(value)) for key, value in obj.items())
    if isinstance(obj, (list, tuple)):
        return (type(obj).__name__, *(_layout(v) for v in obj))
    if isinstance(obj, torch.Tensor):
        local = getattr(obj, "_local_tensor", None)
        placed = (tuple(local.shape), repr(obj.placements)) if local is not None else ()
        return (type(obj).__name__, tuple(obj.shape), str(obj.dtype), *placed)
    return (type(obj).__name__,)


def _copy_from(path: str):
    def write(f) -> None:
        with open(path, "rb") as src:
            while block := src.read(8 * 1024 * 1024):
                f.write(block)

    return write
