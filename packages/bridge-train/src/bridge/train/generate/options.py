"""How tokens are chosen: :class:`SamplingOptions`, checked before anything is built."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from megatron.core.inference.sampling_params import SamplingParams

from bridge.train.generate.errors import GenerationError

__all__ = ["SamplingOptions"]


@dataclass(frozen=True)
class SamplingOptions:
    """What to generate for each prompt, and how each next token is chosen.

    Greedy decoding (the default) takes the most likely token. Otherwise the logits are
    divided by ``temperature`` and sampled from, restricted to the ``top_k`` most likely
    tokens or to the smallest set whose probability reaches ``top_p`` (megatron-core's
    sampler applies one of the two, not both). ``seed`` makes sampling reproducible: the
    same seed, model, prompts and options give the same tokens.

    Attributes:
        max_new_tokens: Tokens to generate per prompt at most (``--max-new-tokens``).
        greedy: Take the most likely token (``--greedy``); the sampling fields must then
            keep their defaults.
        temperature: Softmax temperature (> 0) when sampling.
        top_k: Sample among the ``top_k`` most likely tokens (0: all).
        top_p: Sample among the most likely tokens whose probabilities sum to ``top_p``
            (0: all).
        seed: Seed of the sampling generator (``None``: 1234, megatron-core's default).
        stop: Strings that end a completion as soon as its text contains one; the
            completion's text ends before the stop string.
        stop_at_eod: End a completion at the tokenizer's end-of-document token.
    """

    max_new_tokens: int
    greedy: bool = True
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = field(default_factory=tuple)
    stop_at_eod: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise GenerationError(
                f"--max-new-tokens must be a whole number >= 1, got {self.max_new_tokens!r}"
            )
        if not (math.isfinite(self.temperature) and self.temperature > 0):
            raise GenerationError(f"--temperature must be > 0, got {self.temperature!r}")
        if self.top_k < 0:
            raise GenerationError(f"--top-k must be >= 0, got {self.top_k!r}")
        if not 0.0 <= self.top_p <= 1.0:
            raise GenerationError(f"--top-p must be in [0, 1], got {self.top_p!r}")
        if self.top_k > 0 and self.top_p > 0.0:
            raise GenerationError(
                "--top-k and --top-p cannot both be set: megatron-core's sampler filters by "
                "one of them; drop one"
            )
        if self.greedy and (self.temperature != 1.0 or self.top_k or self.top_p):
            raise GenerationError(
                "--greedy takes the most likely token; it cannot be combined with "
                "--temperature, --top-k or --top-p"
            )
        stops = tuple(self.stop)
        if any(not isinstance(s, str) or not s for s in stops):
            raise GenerationError("--stop needs a non-empty string")
        object.__setattr__(self, "stop", stops)

    @classmethod
    def sampling(cls, max_new_tokens: int, **fields: Any) -> SamplingOptions:
        """Options that sample (not greedy); ``fields`` are the other attributes
        (``temperature``, ``top_k``, ``top_p``, ``seed``, ``stop``, ``stop_at_eod``)."""
        return cls(max_new_tokens, greedy=False, **fields)

    def megatron_params(self) -> Any:
        """megatron-core's ``SamplingParams`` for these options."""

        params = SamplingParams(
            temperature=1.0 if self.greedy else float(self.temperature),
            top_k=1 if self.greedy else int(self.top_k),
            top_p=0.0 if self.greedy else float(self.top_p),
            num_tokens_to_generate=int(self.max_new_tokens),
        )
        # The static-batch controller reads this attribute (not a declared field) to keep
        # generating past the end-of-document token.
        params.add_attributes({"no_early_termination": not self.stop_at_eod})
        return params
