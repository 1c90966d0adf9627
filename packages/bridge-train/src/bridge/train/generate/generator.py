"""Text generation on a built megatron model: :class:`TextGenerator`.

Prompts go through megatron-core's inference machinery: the model is wrapped in its
``GPTInferenceWrapper`` with a ``StaticInferenceContext`` (the KV cache, sized for each
batch) and driven by its text generation controller's static-batch path
(:class:`~bridge.train.generate.controller.GenerationController`), the path megatron's
``StaticInferenceEngine(legacy=True)`` runs, under megatron's ``InferenceMode`` as that engine
runs it. Two changes make it fast on a CPU: keys enter the KV cache already rotated
(:mod:`~bridge.train.generate.rotary_cache`), and prompts of different lengths are
left-padded into one prefill (:class:`~bridge.train.generate.controller.GenerationController`).
Under tensor or pipeline parallelism every rank of the model-parallel group calls
:meth:`TextGenerator.generate` with the same prompts and options, and every rank gets the
same completions (the logits are gathered over the tensor-parallel group and broadcast from
the last pipeline stage before sampling).

megatron-core's dynamic engine (``DynamicInferenceEngine``, paged KV cache) is not used: its
attention runs flash-attention kernels, which need CUDA.
"""

from __future__ import annotations

import contextlib
import functools
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from megatron.core.distributed import DistributedDataParallel
from megatron.core.inference.contexts import StaticInferenceContext
from megatron.core.inference.inference_request import InferenceRequest, Status
from megatron.core.inference.model_inference_wrappers.gpt.gpt_inference_wrapper import (
    GPTInferenceWrapper,
)
from megatron.core.inference.utils import InferenceMode
from megatron.core.utils import unwrap_model

from bridge.train.data.tokenizers import Tokenizer
from bridge.train.engine._distributed_utils import unwrap_model_chunks
from bridge.train.generate.controller import (
    BatchState,
    GenerationController,
    continuation_text,
)
from bridge.train.generate.errors import GenerationError
from bridge.train.generate.options import SamplingOptions
from bridge.train.generate.rotary_cache import (
    caches_rotated_keys,
    rotate_keys_before_caching,
)
from core_utils import without_device_rewriting

__all__ = [
    "Completion",
    "TextCallback",
    "TextGenerator",
    "inference_mode_active",
]

#: Streaming: called with ``(prompt index, new text, done)`` as a completion grows.
TextCallback = Callable[[int, str, bool], None]


@dataclass
class Completion:
    """One prompt's result.

    Attributes:
        prompt: The prompt text (for token-id prompts, their detokenized text).
        prompt_token_ids: The prompt's token ids.
        token_ids: The generated token ids (without a final end-of-document token; with the
            token that completed a stop string).
        text: The generated text (what the new tokens add to the prompt's text, see
            :func:`~bridge.train.generate.controller.continuation_text`), ending before a
            stop string.
        finish_reason: ``"eod"`` (end-of-document token), ``"stop"`` (a stop string) or
            ``"length"`` (``max_new_tokens`` reached).
        logits: With ``return_logits``: the logits each generated token was chosen from,
            ``[len(token_ids), vocabulary]`` (float32), else ``None``.
    """

    prompt: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str
    logits: torch.Tensor | None = None


class _InferenceWrapper(GPTInferenceWrapper):
    """megatron's ``GPTInferenceWrapper`` whose forward steps run without the CUDA
    emulation's device rewriting (:func:`core_utils.without_device_rewriting`).

    On CPU every torch call of the thread otherwise pays the emulation's dispatch into
    Python, ~700 calls per decoding step of a small model. megatron's forward places its
    tensors on ``torch.cuda.current_device()`` (the CPU under the emulation), never on
    ``"cuda"`` by name; were one named there, it fails loudly instead of being rewritten.
    The controller's loop around the step keeps the emulation: it calls ``.cuda()`` itself.
    On a GPU nothing changes.
    """

    def run_one_forward_step(
        self, inference_input: dict[str, Any], recv_buffer_seq_len: int | None = None
    ) -> torch.Tensor:
        """megatron's forward step, with the device rewriting suspended."""
        with without_device_rewriting():
            return super().run_one_forward_step(inference_input, recv_buffer_seq_len)


@contextlib.contextmanager
def inference_mode_active() -> Iterator[None]:
    """Megatron's process-wide ``InferenceMode`` flag on for the block, then back as it was.

    ``InferenceMode.active()`` switches the flag off on exit even when the caller had it on
    (say, an evaluation that generates inside its own inference block), which would send the
    caller's later forwards down the training path.
    """
    was_active = InferenceMode.is_active()
    InferenceMode.set_active()
    try:
        yield
    finally:
        if not was_active:
            InferenceMode.unset_active()


def _cut_at_stop(text: str, stops: Sequence[str]) -> tuple[str, bool]:
    positions = [text.find(stop) for stop in stops]
    found = [p for p in positions if p >= 0]
    return (text[: min(found)], True) if found else (text, False)


class _TextStream:
    """Turns growing token lists into printable text deltas.

    Text is held back while it may still turn into a stop string, and while the last token
    ends inside a multi-byte character (decoded as U+FFFD), so what is printed never has to
    be taken back.
    """

    def __init__(
        self,
        decode: Callable[[list[int]], str],
        stops: Sequence[str],
        emit: Callable[[str, bool], None],
    ) -> None:
        self._decode = decode
        self._stops = tuple(stops)
        self._hold = max((len(s) for s in self._stops), default=1) - 1
        self._emit = emit
        self._printed = 0
        self._done = False

    def update(self, token_ids: list[int], done: bool) -> None:
        if self._done:
            return
        text, stopped = _cut_at_stop(self._decode(token_ids), self._stops)
        done = done or stopped
        end = len(text)
        if not done:
            end = max(self._printed, end - self._hold)
            while end > self._printed and text[end - 1] == "\ufffd":
                end -= 1
        if end > self._printed or done:
            self._emit(text[self._printed : end], done)
            self._printed = end
        self._done = done


class TextGenerator:
    """Generates text from a megatron GPT model with megatron-core's inference machinery.

    Args:
        model: The model (one chunk, or a list holding one; a data-parallel wrapper is
            taken off). It is put in eval mode by every :meth:`generate` call and left so.
        tokenizer: The tokenizer the model was trained with (``tokenize``, ``detokenize``,
            ``eod``, ``vocab_size``).
        max_sequence_length: Longest prompt plus completion the model takes (its
            ``seq_length``: learned position embeddings have no more rows).
        max_batch_size: Prompts generated together at most; more are done in turn.
        vocab_limit: Token ids that may be generated (default: the tokenizer's vocabulary).

    Attributes:
        pads_prompts: Whether prompts of different lengths are left-padded into one prefill
            (every attention layer caches rotated keys and positions are not a learned
            table); otherwise megatron's static path feeds longer prompts token by token.
    """

    def __init__(
        self,
        model: Any,
        tokenizer: Tokenizer,
        *,
        max_sequence_length: int,
        max_batch_size: int = 8,
        vocab_limit: int | None = None,
    ) -> None:

        if max_batch_size < 1:
            raise GenerationError(f"--batch-size must be >= 1, got {max_batch_size}")
        chunks = unwrap_model_chunks(model)
        if len(chunks) != 1:
            raise GenerationError(
                "model.virtual_pipeline_model_parallel_size: generation needs one model chunk "
                f"per rank, got {len(chunks)}; megatron-core's inference does not run "
                "interleaved pipelines"
            )
        # The data-parallel wrapper comes off; megatron's Float16Module stays (it casts
        # inputs and outputs).
        self.module = unwrap_model(chunks[0], (DistributedDataParallel,))
        self.tokenizer = tokenizer
        self.max_sequence_length = int(max_sequence_length)
        self.max_batch_size = int(max_batch_size)
        self.vocab_limit = int(tokenizer.vocab_size if vocab_limit is None else vocab_limit)
        self.wrapper = _InferenceWrapper(
            self.module, StaticInferenceContext(1, self.max_sequence_length)
        )
        self.controller = GenerationController(self.wrapper, tokenizer, self.vocab_limit)
        # Prompts of different lengths are left-padded into one prefill where every
        # attention layer can rotate each row by its own positions. Not with learned
        # absolute positions (GPT-2): there the KV-cached logits of the tiny test model sit
        # at the 1e-5 bound's edge in fp32 on megatron's own path (9.8e-6 batched, 2.0e-5
        # for one prompt alone), and left-padded they measured 1.1e-5; that path keeps
        # megatron's token-by-token prefill until it is shown within the bound.
        self.pads_prompts = caches_rotated_keys(self.module) and (
            getattr(unwrap_model(self.module), "position_embedding_type", None)
            != "learned_absolute"
        )

    def _prompt_ids(
        self, index: int, prompt: str | Sequence[int], max_new_tokens: int
    ) -> tuple[str, list[int]]:
        if isinstance(prompt, str):
            try:
                ids = [int(i) for i in self.tokenizer.tokenize(prompt)]
            except ValueError as exc:
                raise GenerationError(
                    f"prompt {index + 1} cannot be tokenized by the checkpoint's "
                    f"{type(self.tokenizer).__name__} ({exc})"
                    + (
                        "; the null tokenizer of mock data reads whitespace-separated token ids"
                        if type(self.tokenizer).__name__ == "NullTokenizer"
                        else ""
                    )
                ) from None
            text = prompt
        else:
            ids = [int(i) for i in prompt]
            text = self.tokenizer.detokenize(ids)
        if not ids:
            raise GenerationError(
                f"prompt {index + 1} is empty (no tokens); give at least one token"
            )
        bad = [i for i in ids if not 0 <= i < self.vocab_limit]
        if bad:
            raise GenerationError(
                f"prompt {index + 1} has token id {bad[0]}, outside the model's vocabulary "
                f"(0..{self.vocab_limit - 1})"
            )
        if len(ids) >= self.max_sequence_length:
            raise GenerationError(
                f"prompt {index + 1} has {len(ids)} tokens, longer than the model's context "
                f"of {self.max_sequence_length} (model.seq_length) with room for new "
                "tokens; shorten the prompt"
            )
        if len(ids) + max_new_tokens > self.max_sequence_length:
            raise GenerationError(
                f"prompt {index + 1} ({len(ids)} tokens) + --max-new-tokens {max_new_tokens} "
                f"exceeds the model's context of {self.max_sequence_length} tokens "
                f"(model.seq_length); use --max-new-tokens "
                f"{self.max_sequence_length - len(ids)} or less"
            )
        return text, ids

    def generate(
        self,
        prompts: Sequence[str | Sequence[int]],
        options: SamplingOptions,
        *,
        on_text: TextCallback | None = None,
        return_logits: bool = False,
    ) -> list[Completion]:
        """Complete every prompt; collective over the model-parallel group.

        Args:
            prompts: Texts (tokenized with the tokenizer, nothing added) or token ids.
            options: Length, sampling and stopping.
            on_text: Streaming: called with ``(prompt index, new text, done)`` after every
                step, in order, for every prompt of the batch.
            return_logits: Keep the logits of every generated token (:attr:`Completion.logits`).

        Returns:
            One completion per prompt, in order.

        Raises:
            GenerationError: An empty prompt, a token outside the vocabulary, or a prompt that
                with ``max_new_tokens`` does not fit the model's context.
        """
        prepared = [self._prompt_ids(i, p, options.max_new_tokens) for i, p in enumerate(prompts)]
        # Without a seed: 1234, megatron-core's inference_sampling_seed default.
        self.controller.sampling_rng.manual_seed(1234 if options.seed is None else options.seed)
        results: list[Completion] = []
        for first in range(0, len(prepared), self.max_batch_size):
            batch = prepared[first : first + self.max_batch_size]
            results += self._generate_batch(first, batch, options, on_text, return_logits)
        return results

    def _generate_batch(
        self,
        first: int,
        batch: list[tuple[str, list[int]]],
        options: SamplingOptions,
        on_text: TextCallback | None,
        return_logits: bool,
    ) -> list[Completion]:

        params = options.megatron_params()
        lengths = [len(ids) for _, ids in batch]
        longest = max(lengths)
        # megatron's static path prefills up to the shortest prompt and then feeds longer
        # prompts one token per step; left padding (masked, see the controller's
        # prep_inference_input) puts every prompt's end in the same slot: one prefill.
        padding = [longest - n if self.pads_prompts else 0 for n in lengths]
        requests: OrderedDict[int, Any] = OrderedDict()
        for offset, (text, ids) in enumerate(batch):
            requests[first + offset] = InferenceRequest(
                request_id=first + offset,
                prompt=text,
                sampling_params=params,
                # The padding slots hold the prompt's first token; they are masked.
                prompt_tokens=[ids[0]] * padding[offset] + list(ids),
                status=Status.ACTIVE_BUT_NOT_GENERATING_TOKENS,
            )
        texts = [
            _TextStream(
                functools.partial(continuation_text, self.tokenizer, ids),
                options.stop,
                functools.partial(on_text, first + offset),
            )
            for offset, (_, ids) in enumerate(batch)
            if on_text is not None
        ]
        state = BatchState(
            [ids for _, ids in batch],
            options.stop,
            return_logits,
            (lambda row, ids, done: texts[row].update(ids, done)) if texts else None,
            left_padding=padding if any(padding) else (),
        )
        # A KV cache sized for this batch: megatron allocates it at the first forward. With
        # left padding, row r's token in slot i is at position i - left_padding[r] of its
        # prompt: what its rotary embedding follows (rotary_cache).
        slots = min(self.max_sequence_length, longest + options.max_new_tokens)
        context = StaticInferenceContext(len(batch), slots)
        context.left_padding = torch.tensor(padding) if any(padding) else None
        self.wrapper.inference_context = context
        self.controller.batch = state
        try:
            # InferenceMode: what megatron's StaticInferenceEngine switches on around this
            # controller (the output layer then runs on the last position only).
            with rotate_keys_before_caching(self.module), inference_mode_active():
                done = self.controller.generate_all_output_tokens_static_batch(requests)
        finally:
            self.controller.batch = None
            # The cache's memory is released with the context.
            self.wrapper.inference_context = StaticInferenceContext(1, self.max_sequence_length)
        completions = []
        shortest = min(lengths)
        for row, request in enumerate(done.values()):
            ids = [int(t) for t in request.generated_tokens.tolist()]
            raw = continuation_text(self.tokenizer, batch[row][1], ids)
            text, stopped = _cut_at_stop(raw, options.stop)
            reason = "stop" if stopped else "eod" if len(ids) < options.max_new_tokens else "length"
            logits = None
            if return_logits:
                start = 0 if any(padding) else lengths[row] - shortest
                steps = state.logits[start : start + len(ids)]
                logits = torch.stack([step[row] for step in steps]) if steps else None
            if texts:  # the rest of the text, and the end
                texts[row].update(ids, True)
            completions.append(
                Completion(
                    prompt=batch[row][0],
                    prompt_token_ids=list(batch[row][1]),
                    token_ids=ids,
                    text=text,
                    finish_reason=reason,
                    logits=logits,
                )
            )
        return completions
