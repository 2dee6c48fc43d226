"""Staging a save: the copy training waits for. Host copies reuse their buffers; GPU tensors go through
page-locked host buffers, queued together and waited for once, and the staged copy is complete and
independent of the live state when ``stage()`` returns. The GPU tests need CUDA (run them on a GPU
machine: ``python -m pytest tests/training/test_staging.py``)."""
from __future__ import annotations

import pytest
import torch

from airflow_spot.training.session import SpotSession
from airflow_spot.training.state import Stager

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def test_host_staging_copies_and_reuses_its_buffers():
    live = {"w": torch.randn(1000), "nested": [torch.arange(10), (torch.ones(3),)], "step": 7}
    stager = Stager()
    first = stager.stage(live)
    assert torch.equal(first["w"], live["w"]) and first["step"] == 7
    assert first["w"].data_ptr() != live["w"].data_ptr()
    live["w"].add_(1.0)  # training goes on after staging: the staged copy must not move
    assert not torch.equal(first["w"], live["w"])
    second = stager.stage(live)
    assert second["w"].data_ptr() == first["w"].data_ptr()  # the same buffer, refilled
    assert torch.equal(second["w"], live["w"]) and torch.equal(second["nested"][0], torch.arange(10))


def test_a_tensor_that_changes_shape_gets_a_new_buffer():
    stager = Stager()
    stager.stage({"w": torch.zeros(4)})
    grown = stager.stage({"w": torch.ones(6)})
    assert torch.equal(grown["w"], torch.ones(6))


@cuda
def test_gpu_state_is_staged_through_pinned_buffers_and_complete_on_return():
    live = {"w": torch.randn(64, 1024, 1024, device="cuda"), "b": torch.randn(17, device="cuda", dtype=torch.bfloat16)}
    stager = Stager()
    for _ in range(3):
        torch.cuda.synchronize()
        live["w"].mul_(1.5).add_(0.25)  # queued kernels: the staged copy must see their result
        staged = stager.stage(live)
        # no synchronize here: stage() has waited for its own copies
        assert staged["w"].device.type == "cpu" and staged["w"].is_pinned() and staged["b"].is_pinned()
        assert torch.equal(staged["w"], live["w"].cpu()) and torch.equal(staged["b"], live["b"].cpu())
    live["w"].zero_()
    torch.cuda.synchronize()
    assert staged["w"].abs().sum() > 0  # independent of the live tensor


@cuda
def test_pinning_can_be_turned_off():
    staged = Stager(pin_memory=False).stage({"w": torch.randn(100, device="cuda")})
    assert not staged["w"].is_pinned()


@cuda
def test_a_gpu_model_saved_by_the_session_restores_bit_exact(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.ReLU(), torch.nn.Linear(256, 8)).cuda()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    with SpotSession(f"file://{tmp_path}/job", 10, notice_sources=[], heartbeat_seconds=3600) as spot:
        spot.track(model=model, optimizer=opt)
        for step in spot.steps():
            loss = model(torch.randn(32, 256, device="cuda")).square().mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
        saved = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
    fresh = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.ReLU(), torch.nn.Linear(256, 8)).cuda()
    fresh_opt = torch.optim.Adam(fresh.parameters(), lr=1e-3)
    with SpotSession(f"file://{tmp_path}/job", 10, notice_sources=[], heartbeat_seconds=3600) as spot:
        assert spot.track(model=fresh, optimizer=fresh_opt) == 10
    for k, v in fresh.state_dict().items():
        assert v.is_cuda and torch.equal(v.cpu(), saved[k]), k
