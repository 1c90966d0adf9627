"""The loss conventions of the engine's schedule that the loop's loss reductions rely on.

megatron-core's ``forward_backward_no_pipelining`` (the engine's schedule without pipeline
parallelism; the pipelined schedules follow the same conventions and are compared with it in
tests/test_megatron_engine_layouts.py): how a loss function's 2- and 3-tuples are divided,
what ``finalize_model_grads_func`` receives, ``no_sync`` around all but the last micro-batch,
``grad_scale_func``, forward-only and non-loss data. A megatron-core upgrade that changes one
of them would silently change every loss the trainer reports.

These run in the test process, under core-utils' CUDA emulation (the schedule places its
token counter on ``"cuda"``), with a one-parameter model: no process group is needed
(finalisation is a recording function and the process groups are stand-ins).
"""

from __future__ import annotations

import contextlib
from types import SimpleNamespace

import pytest
import torch
from megatron.core.enums import ModelType
from megatron.core.pipeline_parallel.schedules import forward_backward_no_pipelining
from megatron.core.transformer.transformer_config import TransformerConfig

from core_utils import cuda_emulation

PG = SimpleNamespace(tp=None, cp=SimpleNamespace(size=lambda: 1))


@pytest.fixture(autouse=True)
def _emulated_cuda():
    with cuda_emulation():
        yield


class OneWeight(torch.nn.Module):
    def __init__(self, **config) -> None:
        super().__init__()
        self.config = TransformerConfig(
            num_layers=1, hidden_size=4, num_attention_heads=1, **config
        )
        self.model_type = ModelType.encoder_or_decoder
        self.w = torch.nn.Parameter(torch.tensor(2.0))

    def set_input_tensor(self, tensor) -> None:
        del tensor

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.w


# micro-batches: values and a mask of the tokens that count
BATCHES = [
    (torch.tensor([1.0, 2.0, 3.0]), torch.tensor([1.0, 1.0, 0.0])),
    (torch.tensor([4.0, 5.0, 6.0]), torch.tensor([1.0, 1.0, 1.0])),
]


def _three_tuple_step(data_iterator, model):
    x, mask = next(data_iterator)
    out = model(x)

    def loss_func(output, non_loss_data=False):
        if non_loss_data:
            return {"max": output.max().detach()}
        loss = (output * mask).sum()
        tokens = mask.sum().to(torch.int)
        return loss, tokens, {"lm loss": torch.stack([loss.detach(), tokens.float()])}

    return out, loss_func


def _two_tuple_step(data_iterator, model):
    x, mask = next(data_iterator)
    out = model(x)

    def loss_func(output):
        loss = (output * mask).sum() / mask.sum()
        return loss, {"lm loss": loss.detach()}

    return out, loss_func


def _run(model, step, **kwargs):
    return forward_backward_no_pipelining(
        forward_step_func=step,
        data_iterator=iter(BATCHES),
        model=[model],
        num_microbatches=len(BATCHES),
        seq_length=3,
        micro_batch_size=1,
        pg_collection=PG,
        **kwargs,
    )


def test_three_tuple_loss_is_divided_by_tokens_and_microbatches() -> None:
    model = OneWeight()
    reported = _run(model, _three_tuple_step)
    # d/dw of sum_i (sum(x_i * w * m_i) / n_i) / M
    expected = ((1 + 2) / 2 + (4 + 5 + 6) / 3) / 2
    assert model.w.grad is not None
    assert model.w.grad.item() == pytest.approx(expected)
    assert [r["lm loss"].tolist() for r in reported] == [[6.0, 2.0], [30.0, 3.0]]


def test_two_tuple_loss_is_divided_by_microbatches() -> None:
    model = OneWeight()
    reported = _run(model, _two_tuple_step)
    expected = ((1 + 2) / 2 + (4 + 5 + 6) / 3) / 2
    assert model.w.grad is not None
    assert model.w.grad.item() == pytest.approx(expected)
    # megatron divides the loss in place; a report made with ``detach()`` shares that
    # storage, so it arrives divided by the number of micro-batches, exactly as in megatron.
    assert [r["lm loss"].item() for r in reported] == pytest.approx([3.0 / 2, 10.0 / 2])


def test_per_token_loss_is_not_divided_and_finalize_gets_the_token_count() -> None:
    calls = []
    model = OneWeight(calculate_per_token_loss=True)
    model.config.finalize_model_grads_func = lambda chunks, num_tokens, **kw: calls.append(
        (chunks, num_tokens, kw)
    )
    _run(model, _three_tuple_step)
    assert model.w.grad is not None
    assert model.w.grad.item() == pytest.approx(1 + 2 + 4 + 5 + 6)
    ((chunks, num_tokens, kwargs),) = calls
    assert chunks == [model] and int(num_tokens) == 5
    assert kwargs["pg_collection"] is PG and kwargs["force_all_reduce"] is False


def test_finalize_gets_no_token_count_without_per_token_loss() -> None:
    calls = []
    model = OneWeight()
    model.config.finalize_model_grads_func = lambda chunks, num_tokens, **kw: calls.append(
        num_tokens
    )
    _run(model, _three_tuple_step)
    assert calls == [None]


def test_all_but_the_last_microbatch_run_inside_no_sync() -> None:
    inside = []
    state = {"in_no_sync": False}

    @contextlib.contextmanager
    def no_sync():
        state["in_no_sync"] = True
        try:
            yield
        finally:
            state["in_no_sync"] = False

    def step(data_iterator, model):
        inside.append(state["in_no_sync"])
        return _three_tuple_step(data_iterator, model)

    model = OneWeight()
    model.config.no_sync_func = no_sync
    _run(model, step)
    assert inside == [True, False]


def test_grad_scale_func_scales_the_loss_before_backward() -> None:
    model = OneWeight()
    model.config.grad_scale_func = lambda loss: loss * 8.0
    _run(model, _three_tuple_step)
    assert model.w.grad is not None
    assert model.w.grad.item() == pytest.approx(8.0 * ((1 + 2) / 2 + (4 + 5 + 6) / 3) / 2)


def test_forward_only_computes_no_gradient_and_skips_finalize() -> None:
    calls = []
    model = OneWeight()
    model.config.finalize_model_grads_func = lambda *a, **k: calls.append(a)
    reported = _run(model, _three_tuple_step, forward_only=True)
    assert model.w.grad is None and calls == []
    assert len(reported) == 2


def test_collect_non_loss_data_returns_what_the_loss_function_gives() -> None:
    model = OneWeight()
    collected = _run(model, _three_tuple_step, forward_only=True, collect_non_loss_data=True)
    assert [c["max"].item() for c in collected] == [6.0, 12.0]


def test_several_model_chunks_are_refused_without_a_pipeline() -> None:
    model = OneWeight()
    with pytest.raises(AssertionError, match=r"does not support model chunking"):
        forward_backward_no_pipelining(
            forward_step_func=_three_tuple_step,
            data_iterator=iter(BATCHES),
            model=[model, model],
            num_microbatches=1,
            seq_length=3,
            micro_batch_size=1,
            pg_collection=PG,
        )
