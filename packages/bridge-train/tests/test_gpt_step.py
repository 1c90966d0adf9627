"""GPT forward step and masked token-mean loss, in megatron's conventions."""

from __future__ import annotations

import pytest
import torch

from bridge.train import GlobalState, forward_step
from bridge.train.models.gpt_step import get_batch, masked_next_token_loss
from core_utils import Timers
from core_utils.testing import run_distributed


def _batch(b: int = 2, s: int = 8) -> dict[str, torch.Tensor]:
    tokens = torch.arange(b * s).reshape(b, s)
    return {
        "tokens": tokens,
        "labels": tokens + 1,
        "loss_mask": torch.ones(b, s),
        "position_ids": torch.arange(s).expand(b, s),
    }


class PerTokenLoss(torch.nn.Module):
    """Stands in for GPTModel(..., labels=...): returns a per-token loss [b, s]."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = torch.nn.Parameter(torch.tensor(0.5))
        self.seen: dict = {}

    def forward(self, tokens, position_ids, attention_mask, labels=None, loss_mask=None):
        self.seen = {"attention_mask": attention_mask, "loss_mask": loss_mask, "labels": labels}
        return (labels - tokens).float() * self.scale


def test_masked_loss_returns_sum_tokens_and_report() -> None:
    losses = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [0.0, 1.0, 1.0]])
    loss, num_tokens, report = masked_next_token_loss(mask, losses)
    assert loss.item() == 1 + 2 + 5 + 6 and num_tokens.item() == 4 and num_tokens.dtype == torch.int
    assert report["lm loss"].tolist() == [14.0, 4.0]


def test_forward_step_runs_the_model_and_times_the_batch_fetch() -> None:
    timers = Timers(log_level=2, log_option="max")
    state = GlobalState(timers=timers)
    model = PerTokenLoss()
    output, loss_func = forward_step(state, iter([_batch()]), model)
    assert output.shape == (2, 8) and torch.allclose(output, torch.full((2, 8), 0.5))
    assert model.seen["attention_mask"] is None and model.seen["loss_mask"] is not None
    loss, num_tokens, _ = loss_func(output)
    assert loss.item() == pytest.approx(8.0) and num_tokens.item() == 16
    assert timers("batch-generator").elapsed(reset=False) >= 0.0
    # without a state (called directly)
    output, _ = forward_step(None, iter([_batch()]), model)
    assert output.shape == (2, 8)


def test_bad_batches_are_explained() -> None:
    model = PerTokenLoss()
    with pytest.raises(ValueError, match=r"missing \['loss_mask'\]"):
        forward_step(None, iter([{k: v for k, v in _batch().items() if k != "loss_mask"}]), model)
    with pytest.raises(ValueError, match="needs a data iterator"):
        get_batch(None)
    with pytest.raises(NotImplementedError, match="return_schedule_plan"):
        forward_step(None, iter([_batch()]), model, return_schedule_plan=True)


def _context_parallel_batch(rank: int, world: int) -> dict:
    from megatron.core import parallel_state

    parallel_state.initialize_model_parallel(context_parallel_size=2)
    try:
        batch = get_batch(iter([_batch(b=1, s=8)]))
        return {k: v.tolist() for k, v in batch.items() if v is not None}
    finally:
        parallel_state.destroy_model_parallel()


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_context_parallel_ranks_get_their_sequence_chunks() -> None:
    r0, r1 = run_distributed(_context_parallel_batch, 2, timeout=100)
    # 8 tokens in 4 chunks of 2: rank 0 keeps chunks 0 and 3, rank 1 keeps 1 and 2
    assert r0["tokens"] == [[0, 1, 6, 7]] and r1["tokens"] == [[2, 3, 4, 5]]
    assert r0["labels"] == [[1, 2, 7, 8]] and r1["position_ids"] == [[2, 3, 4, 5]]
