"""The transformers backend on CUDA: it loads on the device context's GPU, its KV pool there,
and in deterministic mode a sequence's answer is the same alone and joining a running batch."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
pytest.importorskip("transformers")


def test_hf_backend_runs_on_cuda_and_is_batch_invariant_in_deterministic_mode(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # as deterministic mode sets it
    from monolith.device import DeviceContext
    from services.inference.model.backend import make_engine
    from services.inference.model.engine import GenerationRequest
    from services.inference.model.hf_backend import load_hf_backend
    from services.inference.model.interface import KV_CACHE_OWNER
    from spine.tools.model.make_tiny import make_tiny
    from tests.integration.test_hf_backend import joining_midway

    device = DeviceContext(device=torch.device("cuda"), budget_bytes=256 << 20)
    backend = load_hf_backend({"path": str(make_tiny(tmp_path / "tiny-llama"))}, device=device)
    assert backend.model.device.type == "cuda"
    engine = make_engine(backend, device, 4)
    assert device.usage()[KV_CACHE_OWNER] == 4 * backend.model.kv_bytes_per_slot(backend.max_context)
    requests = [GenerationRequest(prompt_ids=backend.encode(p), max_tokens=10, temperature=0.8, seed=3)
                for p in ("Hello, world!", "The model", "a", "What is the time?")]
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        alone = [engine.generate([req])[0].token_ids for req in requests]
        assert joining_midway(engine, requests, steps=1) == alone
    finally:
        torch.use_deterministic_algorithms(before)
        engine.close()
    assert device.usage()[KV_CACHE_OWNER] == 0
