"""Capturing and restoring training state: staging to host memory and every RNG in the process."""
from __future__ import annotations

import copy
import random
from typing import Any

import torch


def stage(obj: Any) -> Any:
    """A deep copy with every tensor copied to host memory.

    This is the only part of a save that training waits for: after it returns, the live tensors may
    change while the copy is written in the background. ``state_dict()`` results share storage with the
    live parameters and optimizer buffers, hence the copy.
    """
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return type(obj)((k, stage(v)) for k, v in obj.items()) if type(obj) is not dict else {
            k: stage(v) for k, v in obj.items()
        }
    if isinstance(obj, list):
        return [stage(v) for v in obj]
    if isinstance(obj, tuple) and not hasattr(obj, "_fields"):
        return tuple(stage(v) for v in obj)
    return copy.deepcopy(obj)


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
