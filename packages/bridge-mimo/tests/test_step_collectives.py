"""Every rank makes the same collectives, even when only some ranks' inputs change.

The FLOPs of a step are summed over the world, so whether a step is measured must be agreed
by all ranks: here the encoder ranks get images of a new resolution while the language-model
ranks see the same shapes as before (a rank-local decision would pair the encoder ranks'
FLOPs all-reduce with the language ranks' next collective: a hang or garbage). The early
stop of ``train_mimo`` is agreed the same way.
"""

from __future__ import annotations

import math
import warnings
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from megatron.core.transformer.spec_utils import ModuleSpec

import bridge.mimo as mimo
from core_utils.testing import run_distributed

FAN_IN = {"vision": {"ranks": range(0, 2), "dp": 2}, "language": {"ranks": range(2, 4), "tp": 2}}
# Native resolution of the synthetic images, then half of it: encoder-only shape changes.
RESOLUTIONS = [16, 8, 8, 16]


class PixelPoolEncoder(torch.nn.Module):
    """A per-pixel linear embedding pooled to a fixed token grid.

    Its FLOPs grow with the image resolution while its output (and so everything the
    language model sees) keeps one shape: forward and weight gradient each cost
    ``2 * pixels * channels * hidden`` multiply-adds (images need no gradient).
    """

    def __init__(self, in_channels: int, hidden_size: int, grid: int) -> None:
        super().__init__()
        self.pixel = torch.nn.Linear(in_channels, hidden_size)
        self.grid = grid

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        b, c, h, w = images.shape
        x = self.pixel(images.permute(0, 2, 3, 1).reshape(b, h * w, c))
        x = x.transpose(1, 2).reshape(b, -1, h, w)
        return F.adaptive_avg_pool2d(x, self.grid).flatten(2).transpose(1, 2)


class ElementwiseEncoder(torch.nn.Module):
    """An encoder without any matrix multiplication (the FLOP counter sees 0 FLOPs)."""

    def __init__(self, hidden_size: int, grid: int) -> None:
        super().__init__()
        self.scale = torch.nn.Parameter(torch.ones(hidden_size))
        self.shift = torch.nn.Parameter(torch.zeros(hidden_size))
        self.grid = grid

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        pooled = F.adaptive_avg_pool2d(images, self.grid).mean(dim=1)  # [b, g, g]
        return pooled.flatten(1).unsqueeze(-1) * self.scale + self.shift


def _build(harness: SimpleNamespace, encoder: ModuleSpec, projection: bool) -> SimpleNamespace:
    cfg = harness.CONFIG
    infra = mimo.build_megatron_mimo_infra(harness.make_layout(FAN_IN))
    specs = mimo.tiny_vlm_specs(cfg, infra)
    vision = specs["modality_submodules_spec"]["vision"]
    vision.submodules["encoders"] = {cfg.encoder_name: encoder}
    if not projection:
        vision.submodules["input_projections"] = []
    model = mimo.build_mimo_model(infra, init_seed=7, **specs)
    optimizer = mimo.build_multimodule_optimizer(model, infra, harness.sgd, clip_grad=1.0)
    step = mimo.MimoTrainStep(
        model,
        infra,
        optimizer,
        global_batch_size=harness.GLOBAL_BATCH,
        micro_batch_size=harness.MICRO_BATCH,
    )
    data = mimo.MimoDataLoader.for_infra(
        harness.make_dataset(),
        infra,
        global_batch_size=harness.GLOBAL_BATCH,
        micro_batch_size=harness.MICRO_BATCH,
        seed=5,
    )
    return SimpleNamespace(infra=infra, step=step, data=data)


def _at_resolution(batches: list[dict[str, Any]], size: int, encoder_rank: bool) -> list[Any]:
    """Encoder ranks: images at ``size``; language ranks: no images at all (they use none),
    so their batch shapes never change."""
    out = []
    for batch in batches:
        batch = dict(batch)
        if encoder_rank:
            inputs = batch["modality_inputs"]["vision"]["patch_encoder"]
            images = inputs["images"]
            if images.shape[-1] != size:
                images = F.adaptive_avg_pool2d(images, size)
            batch["modality_inputs"] = {"vision": {"patch_encoder": {"images": images}}}
        else:
            batch.pop("modality_inputs")
        out.append(batch)
    return out


def _collectives(rank: int, world_size: int, harness: SimpleNamespace) -> dict[str, Any]:
    cfg = harness.CONFIG
    encoder_rank = rank < 2
    out: dict[str, Any] = {}

    # 1. Encoder-side shape changes: the run completes and the FLOPs follow the shapes.
    grid = cfg.image_size // cfg.patch_size
    pixel = ModuleSpec(
        module=PixelPoolEncoder,
        params={"in_channels": cfg.channels, "hidden_size": cfg.encoder_hidden_size, "grid": grid},
    )
    run = _build(harness, pixel, projection=True)
    out["flops"] = [
        run.step(_at_resolution(next(run.data), size, encoder_rank)).flops for size in RESOLUTIONS
    ]
    assert run.step.flops_meter is not None
    out["measured"] = run.step.flops_meter.measured_combinations

    # 2. The early stop is agreed: only rank 0 asks, every rank stops after iteration 2.
    records: list[mimo.MimoLogRecord] = []
    stopped = mimo.train_mimo(
        run.step,
        run.data,
        train_iters=6,
        log_fn=records.append,
        log_interval=5,
        should_stop=lambda iteration: rank == 0 and iteration == 2,
    )
    out["stop"] = (stopped.iteration, stopped.stopped_early, [r.iteration for r in records])
    run.step.close()
    run.infra.destroy()

    # 3. A module that runs no matmul: a one-time warning, 0 FLOPs, training goes on.
    elementwise = ModuleSpec(
        module=ElementwiseEncoder, params={"hidden_size": cfg.language_hidden_size, "grid": grid}
    )
    run = _build(harness, elementwise, projection=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        results = [
            run.step(_at_resolution(next(run.data), size, encoder_rank)) for size in RESOLUTIONS
        ]
    out["zero_flops"] = [r.flops for r in results]
    out["zero_losses"] = [r.loss for r in results]
    out["warnings"] = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    run.step.close()
    run.infra.destroy()
    return out


@pytest.mark.multiprocess
@pytest.mark.timeout(150)
def test_ranks_agree_on_flops_measurement_and_early_stop(harness: SimpleNamespace) -> None:
    results = run_distributed(_collectives, 4, harness, timeout=120)
    cfg = harness.CONFIG
    flops = results[0]["flops"]
    for out in results:
        # Job-wide numbers, identical on every rank (a rank-local decision would have made
        # the encoder ranks' FLOPs all-reduce meet the language ranks' next collective).
        assert out["flops"] == flops
        assert out["measured"] == 2  # (16, same) and (8, same): two combinations
    # The language model saw the same shapes in every step.
    assert len({f["language"] for f in flops}) == 1 and flops[0]["language"] > 0
    # Cached combinations give the FLOPs of their own shapes, not of the last measurement.
    assert flops[0] == flops[3] and flops[1] == flops[2]
    # Only the per-pixel embedding depends on the resolution: forward + weight gradient,
    # 2 * 2 * pixels * channels * hidden over the global batch.
    pixels = RESOLUTIONS[0] ** 2 - RESOLUTIONS[1] ** 2
    expected = 4 * harness.GLOBAL_BATCH * pixels * cfg.channels * cfg.encoder_hidden_size
    assert flops[0]["vision"] - flops[1]["vision"] == expected

    for out in results:
        assert out["stop"] == (2, True, [2])  # the partial logging window is logged

    for out in results:
        assert all(f["vision"] == 0 and f["language"] > 0 for f in out["zero_flops"])
        assert all(math.isfinite(loss) for loss in out["zero_losses"])
        # Two measured combinations, one warning.
        assert len(out["warnings"]) == 1, out["warnings"]
        assert "no FLOPs were counted for module(s) ['vision']" in out["warnings"][0]
