"""The samples section: completions generated at evaluation time during training."""

from __future__ import annotations

from dataclasses import dataclass, field

from bridge.config._checks import at_least
from bridge.config._codec import normalize_fields
from bridge.config._errors import field_error, section_error
from bridge.config._section import config_section


@config_section
@dataclass(kw_only=True)
class SamplesConfig:
    """Sample completions of a few prompts, generated at evaluation time while training.

    Every ``every_n_evaluations``-th validation, the model completes each prompt (on
    megatron-core's inference machinery, on every rank of the model-parallel group); rank 0
    prints the completions and the metric writers record them as a table (``tag``: the
    TensorBoard text dashboard, a W&B table, an MLflow artifact, a Comet asset). Training
    is unchanged by it: generation runs in eval mode with its own sampling generator, so
    the losses are the same with the section set or unset.
    """

    prompts: list[str] = field(default_factory=list)
    """The prompts (text, tokenized as the training data is; for the null tokenizer of mock
    data, whitespace-separated token ids). Required."""

    max_new_tokens: int = 32
    """Tokens to generate per prompt at most."""

    every_n_evaluations: int = 1
    """Generate at every this-many-th evaluation (``train.eval_interval`` sets how often
    evaluation runs)."""

    greedy: bool = True
    """Take the most likely token; false samples with ``temperature`` / ``top_k`` /
    ``top_p`` and ``seed``."""

    temperature: float = 1.0
    """Sampling temperature (> 0)."""

    top_k: int = 0
    """Sample among the ``top_k`` most likely tokens (0: all)."""

    top_p: float = 0.0
    """Sample among the most likely tokens whose probabilities sum to ``top_p`` (0: all)."""

    seed: int = 1234
    """Seed of the sampling generator (the same at every evaluation)."""

    stop: list[str] = field(default_factory=list)
    """Stop strings: a completion ends at the first."""

    chat: bool = False
    """Render each prompt as a user message the way chat finetuning data is rendered."""

    tag: str = "samples"
    """Name of the table in the metric writers."""

    def __post_init__(self) -> None:
        """Check the prompts, the lengths and the sampling settings."""
        normalize_fields(self)
        if not self.prompts or not all(isinstance(p, str) and p for p in self.prompts):
            raise field_error(
                self, "prompts", self.prompts, "a non-empty list of non-empty prompt strings"
            )
        at_least(self, "max_new_tokens", 1, allow_none=False)
        at_least(self, "every_n_evaluations", 1, allow_none=False)
        at_least(self, "top_k", 0, allow_none=False)
        if not self.temperature > 0:
            raise field_error(self, "temperature", self.temperature, "a number > 0")
        if not 0.0 <= self.top_p <= 1.0:
            raise field_error(self, "top_p", self.top_p, "a number in [0, 1]")
        if self.top_k and self.top_p:
            raise section_error(
                self, "top_k and top_p cannot both be set (the sampler filters by one of them)"
            )
        if self.greedy and (self.temperature != 1.0 or self.top_k or self.top_p):
            raise section_error(
                self,
                "greedy=true takes the most likely token; set greedy=false to use "
                "temperature, top_k or top_p",
            )
        if not self.tag:
            raise field_error(self, "tag", self.tag, "a non-empty name")
