"""megatron-core's text generation controller with what ``bridge-generate`` adds to it.

:class:`GenerationController` is megatron-core's ``TextGenerationController`` (its static
batch path: prefill up to the shortest prompt, then one token per step through the KV cache
of a ``StaticInferenceContext``, longer prompts fed their own tokens until they start
generating) with three hooks on the methods that controller calls:

* ``prep_inference_input`` (once per batch): for rows the generator left-padded to the
  longest prompt, a mask hiding the padding and each token's position in its own prompt,
  so every prompt ends in the same slot and the "shortest prompt" is all of them: one
  prefill.

* ``sample_from_logits``: only the tokenizer's ids can be chosen. The output layer has
  ``padded_vocab_size`` columns (rounded up for tensor parallelism); the rows past the real
  vocabulary were never trained, so they are cut off before sampling, as Hugging Face's
  ``generate`` never sees them. With ``record_logits`` the (cut) logits of every step are
  kept, so callers can compare them with a full forward.
* ``update_generation_status``: besides megatron's end-of-document check, a completion whose
  text contains a stop string ends at the token that completed it; then each row's tokens so
  far go to the batch's listener (megatron streams through asyncio queues, ``AsyncStream``,
  for its server, from a thread of its own).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from megatron.core.inference.text_generation_controllers.text_generation_controller import (
    TextGenerationController,
)

from bridge.train.data.tokenizers import Tokenizer

__all__ = ["BatchState", "GenerationController", "TokenListener", "continuation_text"]

#: Called with ``(row, generated token ids so far, done)`` after every step.
TokenListener = Callable[[int, list[int], bool], None]


def continuation_text(tokenizer: Tokenizer, prompt_ids: Sequence[int], ids: Sequence[int]) -> str:
    """The text ``ids`` add after the prompt: the prompt and the new tokens decoded together,
    less the prompt's own text.

    Decoding the new tokens alone would lose what only the whole sequence decodes to: the
    space a SentencePiece token starts with, the separator the null tokenizer puts between
    ids, a character whose bytes the prompt began. When the prompt's text is not a prefix of
    the whole (a tokenizer that normalises across the boundary), the new tokens are
    decoded alone.
    """
    head = str(tokenizer.detokenize(list(prompt_ids)))
    whole = str(tokenizer.detokenize([*prompt_ids, *ids]))
    if whole.startswith(head):
        return whole[len(head) :]
    return str(tokenizer.detokenize(list(ids)))


@dataclass
class BatchState:
    """What the hooks need to know about the batch being generated.

    Attributes:
        prompts: Prompt token ids of each row, in batch order.
        stop: Stop strings (empty: none).
        record_logits: Keep every step's logits (``[rows, vocab]``, float32).
        listener: Receives the tokens of every row that generates.
        left_padding: Padding slots before each row's prompt (empty: none), see
            :meth:`GenerationController.prep_inference_input`.
        logits: The recorded logits, one tensor per step.
    """

    prompts: Sequence[Sequence[int]]
    stop: Sequence[str] = ()
    record_logits: bool = False
    listener: TokenListener | None = None
    left_padding: Sequence[int] = ()
    logits: list[torch.Tensor] = field(default_factory=list)


class GenerationController(TextGenerationController):
    """megatron-core's ``TextGenerationController`` limited to the real vocabulary, with
    stop strings and a token callback (see the module docstring).

    Args:
        inference_wrapped_model: megatron's ``GPTInferenceWrapper`` of the model.
        tokenizer: The checkpoint's tokenizer (``tokenize``, ``detokenize``, ``eod``).
        vocab_limit: Number of token ids that may be generated (the tokenizer's vocabulary,
            at most the model's unpadded ``vocab_size``).
    """

    def __init__(
        self, inference_wrapped_model: Any, tokenizer: Tokenizer, vocab_limit: int
    ) -> None:
        super().__init__(inference_wrapped_model, tokenizer)
        self.vocab_limit = int(vocab_limit)
        self.batch: BatchState | None = None

    def prep_inference_input(
        self,
        prompts_tokens: torch.Tensor,
        active_requests: Any,
        use_attention_mask: bool = False,
    ) -> dict[str, Any]:
        """megatron's inputs; for left-padded rows the padding mask (causal besides,
        ``[batch, 1, s, s]``, ``True`` = masked as in megatron) and each token's position in
        its own prompt (module docstring).

        megatron's loop slices the mask to ``[..., start:end, :end]`` at every step, so the
        padding stays hidden while the rows decode. Rotary embeddings ignore the position ids
        in megatron and follow the context's ``left_padding`` instead (:mod:`.rotary_cache`).
        """
        inference_input = super().prep_inference_input(
            prompts_tokens, active_requests, use_attention_mask
        )
        if self.batch is None or not any(self.batch.left_padding):
            return inference_input
        device = prompts_tokens.device
        padding = torch.tensor(list(self.batch.left_padding), device=device)
        slots = torch.arange(prompts_tokens.size(1), device=device)
        causal = slots[None, :] <= slots[:, None]
        keep = causal[None] & (slots[None, :] >= padding[:, None])[:, None, :]
        inference_input["attention_mask"] = ~keep[:, None]
        inference_input["position_ids"] = (slots[None, :] - padding[:, None]).clamp(min=0)
        return inference_input

    def sample_from_logits(
        self,
        last_token_logits: torch.Tensor,
        sampling_params: Any = None,
        vocab_size: int | None = None,
        **kwargs: Any,
    ) -> torch.Tensor:
        """megatron's sampling over the first ``vocab_limit`` logits."""
        limited = last_token_logits[:, : self.vocab_limit]
        if self.batch is not None and self.batch.record_logits:
            self.batch.logits.append(limited.detach().float().clone())
        return super().sample_from_logits(limited, sampling_params, self.vocab_limit, **kwargs)

    def update_generation_status(
        self,
        updated_prompts_tokens: torch.Tensor,
        generation_started: torch.Tensor,
        current_context_end_position: int,
        *args: Any,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """megatron's end-of-document check, then the stop strings, then the listener."""
        done, lengths = super().update_generation_status(
            updated_prompts_tokens,
            generation_started,
            current_context_end_position,
            *args,
            **kwargs,
        )
        batch = self.batch
        if batch is None or not (batch.stop or batch.listener):
            return done, lengths
        # The token just chosen is counted in ``lengths`` (megatron counts every token
        # of an unfinished row, not an end-of-document one): a stop ends the row with that
        # token included. One transfer each for the flags, lengths and tokens, not one per row.
        finished, started, counts = done.tolist(), generation_started.tolist(), lengths.tolist()
        padding = list(batch.left_padding) or [0] * len(batch.prompts)
        rows = updated_prompts_tokens[:, : current_context_end_position + 1].tolist()
        for row, prompt in enumerate(batch.prompts):
            if not started[row]:
                continue
            start = padding[row] + len(prompt)
            ids = rows[row][start : start + counts[row]]
            if not finished[row] and batch.stop:
                text = continuation_text(self.tokenizer, prompt, ids)
                finished[row] = done[row] = any(stop in text for stop in batch.stop)
            if batch.listener is not None:
                batch.listener(row, ids, bool(finished[row]))
        return done, lengths
