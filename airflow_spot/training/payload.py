"""How a checkpoint's payload is written and read: ``torch.save`` / ``torch.load``, and for another job's
checkpoint (a warm start) torch's safe unpickler."""
from __future__ import annotations

from typing import Any

import torch


def save_payload(staged: Any, f) -> None:
    torch.save(staged, f)


def load_payload(path: str) -> Any:
    # The job's own checkpoint (verified by sha256 against its manifest): whoever may write the job's store
    # already decides what its instances run, and tracked objects' states may hold any picklable type.
    return torch.load(path, map_location="cpu", weights_only=False)


def _numpy_globals() -> list:
    """The numpy types an RNG state or an array in a state dict pickles as (numpy 1.x and 2.x)."""
    try:
        import numpy as np
    except ImportError:
        return []
    core = getattr(np, "_core", None) or np.core
    return [core.multiarray._reconstruct, core.multiarray.scalar, np.ndarray, np.dtype,
            *{type(np.dtype(t)) for t in (np.uint32, np.int64, np.float32, np.float64, np.bool_)}]


def load_foreign_payload(path: str) -> Any:
    """Another job's checkpoint (a warm start): loaded with torch's safe unpickler, which builds tensors,
    containers and numpy arrays but runs no code a payload names: the store may be another team's, or a
    downloaded checkpoint."""
    import collections
    import pickle

    allowed = [collections.Counter, collections.defaultdict, *_numpy_globals()]
    try:
        with torch.serialization.safe_globals(allowed):
            return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        raise ValueError(
            f"the warm start's checkpoint holds objects a safe load does not build ({str(exc).splitlines()[0]}); a "
            "warm start loads only tensors, containers and numpy arrays: save the weights to start from as plain "
            "state dicts") from None
