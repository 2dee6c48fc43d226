"""Capturing and restoring training state: staging to host memory and every RNG in the process."""
from __future__ import annotations

import contextlib
import copy
import random
from collections.abc import Iterator
from typing import Any

import torch


class Stager:
    """Copies state to host memory into buffers it keeps between saves.

    Staging is the only part of a save that training waits for: after it returns, the live tensors may
    change while the copy is written in the background (``state_dict()`` results share storage with the
    live parameters and optimizer buffers, hence the copy). Reusing the buffers of the previous save
    turns staging into a plain memory copy: allocating fresh pages costs a page fault per 4 KiB, several
    times the copy itself. Only one staged copy may be in use at a time (one write in flight).

    GPU tensors are staged into page-locked (pinned) host buffers: the copy engine then moves them at full
    link speed, without the driver's own bounce through a pinned buffer that a pageable destination
    costs, and all of one save's copies are queued at once and waited for once
    (``benchmarks/bench_gpu_staging.py``). ``pin_memory=False`` turns that off; where
    the host cannot pin more memory, the buffer falls back to pageable memory.
    """

    def __init__(self, pin_memory: bool = True) -> None:
        self.pin_memory = pin_memory
        self._buffers: dict[tuple, torch.Tensor] = {}
        self._depth = 0
        self._pending: set[torch.device] = set()  # GPUs with copies queued in this stage() call

    def stage(self, obj: Any, path: tuple = ()) -> Any:
        if self._depth:
            return self._stage(obj, path)
        self._depth += 1
        try:
            with _single_threaded():
                staged = self._stage(obj, path)
            for device in self._pending:  # the copies were queued on each GPU's current stream
                torch.cuda.current_stream(device).synchronize()
            return staged
        finally:
            self._pending.clear()
            self._depth -= 1

    def _stage(self, obj: Any, path: tuple) -> Any:
        if isinstance(obj, torch.Tensor):
            src = obj.detach()
            buf = self._buffers.get(path)
            if buf is None or buf.shape != src.shape or buf.dtype != src.dtype or src.is_sparse:
                buf = self._pinned_like(src)
                if buf is None:
                    buf = src.to("cpu", copy=True)
                    if not src.is_sparse:
                        self._buffers[path] = buf
                    return buf
                self._buffers[path] = buf
            if src.is_cuda and buf.is_pinned():
                self._pending.add(src.device)
                return buf.copy_(src, non_blocking=True)
            return buf.copy_(src)
        if isinstance(obj, dict):
            if type(obj) is dict:
                return {k: self._stage(v, path + (k,)) for k, v in obj.items()}
            # a subclass (OrderedDict with a module's _metadata, Counter, defaultdict): a shallow copy keeps
            # its type, its attributes and its default factory, whatever its constructor takes
            out = copy.copy(obj)
            for k, v in obj.items():
                out[k] = self._stage(v, path + (k,))
            return out
        if isinstance(obj, list):
            return [self._stage(v, path + (i,)) for i, v in enumerate(obj)]
        if isinstance(obj, tuple) and not hasattr(obj, "_fields"):
            return tuple(self._stage(v, path + (i,)) for i, v in enumerate(obj))
        return copy.deepcopy(obj)

    def _pinned_like(self, src: torch.Tensor) -> torch.Tensor | None:
        """A page-locked host buffer for a dense GPU tensor, or None (then a plain host copy is made)."""
        if not (src.is_cuda and self.pin_memory) or src.is_sparse:
            return None
        try:
            return torch.empty(src.shape, dtype=src.dtype, device="cpu", pin_memory=True)
        except RuntimeError:  # the host cannot lock more memory: a pageable copy still works
            return None


@contextlib.contextmanager
def _single_threaded() -> Iterator[None]:
    """Host-to-host copies on one intra-op thread.

    A memory copy is bandwidth-bound: one thread nearly saturates it, while torch's parallel copy waits
    at a barrier for its slowest thread, so on a busy machine the stall grows several-fold (measured: a
    500 MB stage took 0.065 s on one thread against 0.19 s on two, with the other core loaded).
    """
    threads = torch.get_num_threads()
    if threads == 1:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def stage(obj: Any) -> Any:
    """A deep copy with every tensor copied to fresh host memory (see :class:`Stager` to reuse buffers)."""
    return Stager().stage(obj)


def capture_rng() -> dict[str, Any]:
    """RNG states of python, numpy (when installed) and torch (CPU, and CUDA when present)."""
    state: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
    try:
        import numpy as np

        state["numpy"] = np.random.get_state()
    except ImportError:
        pass
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if "numpy" in state:
        import numpy as np

        np.random.set_state(state["numpy"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
