"""report_l2_norm_grad on one process: which parameters count, and how often."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from bridge.logging import report_l2_norm_grad


def _with_grads[M: torch.nn.Module](module: M, seed: int = 0) -> M:
    generator = torch.Generator().manual_seed(seed)
    for p in module.parameters():
        p.grad = torch.randn(p.shape, generator=generator)
    return module


def _norm(*tensors: torch.Tensor) -> float:
    return math.sqrt(sum(float(t.double().pow(2).sum()) for t in tensors))


def test_global_and_per_parameter_norms(kit: Any) -> None:
    model = _with_grads(kit.TinyModel())
    report = report_l2_norm_grad([model])
    grads = {name: p.grad for name, p in model.named_parameters()}
    assert report["l2_norm/grad/global"] == pytest.approx(_norm(*grads.values()), rel=1e-6)
    for name, grad in grads.items():
        assert report[f"l2_norm/grad/{name}"] == pytest.approx(_norm(grad), rel=1e-6)
    assert len(report) == len(grads) + 1
    # A bare module works like a one-chunk list.
    assert report_l2_norm_grad(model) == report


def test_main_grad_wins_and_frozen_or_gradless_parameters_are_left_out(kit: Any) -> None:
    model = _with_grads(kit.TinyModel())
    model.fc1.weight.main_grad = torch.full_like(model.fc1.weight, 2.0)
    model.fc2.bias.requires_grad_(False)
    model.fc2.weight.grad = None
    report = report_l2_norm_grad(model)
    assert report["l2_norm/grad/fc1.weight"] == pytest.approx(2.0 * math.sqrt(16 * 8))
    assert "l2_norm/grad/fc2.bias" not in report and "l2_norm/grad/fc2.weight" not in report
    expected = _norm(model.fc1.weight.main_grad, model.fc1.bias.grad)
    assert report["l2_norm/grad/global"] == pytest.approx(expected, rel=1e-6)


def test_shared_parameters_and_repeated_chunks_count_once(kit: Any) -> None:
    first = _with_grads(kit.TinyModel(), seed=1)
    second = _with_grads(kit.TinyModel(), seed=2)
    second.fc2.weight.shared = True  # a tied copy
    report = report_l2_norm_grad([first, second, first])
    counted = [p.grad for p in first.parameters()] + [
        p.grad for n, p in second.named_parameters() if n != "fc2.weight"
    ]
    assert report["l2_norm/grad/global"] == pytest.approx(_norm(*counted), rel=1e-6)
    # Chunks are told apart by prefix; the shared copy still gets its own entry.
    assert report["l2_norm/grad/chunk1.fc2.weight"] == pytest.approx(_norm(second.fc2.weight.grad))
    assert "l2_norm/grad/chunk0.fc1.weight" in report
    assert not [k for k in report if k.startswith("l2_norm/grad/chunk2.")]


def test_a_model_without_gradients_reports_zero(kit: Any) -> None:
    assert report_l2_norm_grad(kit.TinyModel()) == {"l2_norm/grad/global": 0.0}
