"""The samples component: completions of a few prompts at evaluation time (``samples``).

After every ``samples.every_n_evaluations``-th validation, every rank generates the
completions with :class:`bridge.train.generate.TextGenerator` (megatron-core's inference
controller and KV cache, on the training model itself): the ranks of a model-parallel group
generate together, and data-parallel replicas, holding the same weights, generate the same
completions on their own, so no rank waits for another and nothing is sent between
replicas. Rank 0 prints them; the metric writers (the last rank's) record them as a table at
the iteration (TensorBoard text, W&B table, MLflow and Comet artifacts).

Training is unchanged by it: the model generates in eval mode (no dropout) and is put back
in training mode; sampling draws from the controller's own generator, never from the
training RNG; the data iterators are not touched. A run without the section builds no
component and pays nothing.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from bridge.config import ConfigError
from bridge.train.data.tokenizers import Tokenizer
from bridge.train.generate.errors import GenerationError
from bridge.train.generate.generator import TextGenerator
from bridge.train.generate.options import SamplingOptions
from bridge.train.generate.prompts import PromptSpec, render_prompts
from bridge.train.loop.forward_pre_hooks import disable_forward_pre_hook, enable_forward_pre_hook
from core_utils.callbacks import Callback
from core_utils.distributed import global_rank

if TYPE_CHECKING:
    from core_utils.loop import LoopContext

__all__ = ["GenerationSamples"]


class GenerationSamples(Callback):
    """Generates and reports sample completions after validation (see the module docstring).

    Args:
        section: The ``samples`` config section (``bridge.config.SamplesConfig``).
        tokenizer: The run's tokenizer.
        seq_length: The model's context (``model.seq_length``).
        toggle_forward_pre_hooks: Disable forward pre-hooks while generating (the distributed
            optimizer's overlapped parameter gather), as around evaluation.
        metric_writers: Where the completions are recorded as a table (``None``: printed
            only).
    """

    def __init__(
        self,
        section: Any,
        tokenizer: Tokenizer,
        seq_length: int,
        *,
        toggle_forward_pre_hooks: bool = False,
        metric_writers: Any = None,
    ) -> None:
        self.section = section
        self.tokenizer = tokenizer
        self.seq_length = int(seq_length)
        self.toggle = toggle_forward_pre_hooks
        self.metric_writers = metric_writers
        self.evaluations = 0
        sampling = () if section.greedy else ("temperature", "top_k", "top_p", "seed")
        self.options = SamplingOptions(
            section.max_new_tokens,
            greedy=section.greedy,
            stop=tuple(section.stop),
            **{name: getattr(section, name) for name in sampling},
        )
        self.prompts: list[Any] = []

    def on_train_start(self, context: LoopContext) -> None:
        """Tokenize the prompts and check they fit the context, before the first step."""
        try:
            rendered = render_prompts(
                [PromptSpec(p) for p in self.section.prompts],
                self.tokenizer,
                chat=self.section.chat,
            )
            for index, prompt in enumerate(rendered):
                ids = self.tokenizer.tokenize(prompt) if isinstance(prompt, str) else prompt
                if len(ids) + self.options.max_new_tokens > self.seq_length:
                    raise GenerationError(
                        f"prompt {index + 1} has {len(ids)} tokens; with max_new_tokens "
                        f"{self.options.max_new_tokens} that exceeds model.seq_length "
                        f"{self.seq_length}"
                    )
        except (GenerationError, ValueError) as exc:
            raise ConfigError("samples", str(exc)) from None
        self.prompts = rendered

    def on_validation_end(self, context: LoopContext) -> None:
        """Generate on every ``every_n_evaluations``-th validation; print and record."""
        self.evaluations += 1
        if self.evaluations % int(self.section.every_n_evaluations):
            return
        completions = self.generate(context.model)
        iteration = context.iteration
        rows = [
            [self.section.prompts[i], completion.text] for i, completion in enumerate(completions)
        ]
        if global_rank() == 0:
            lines = [f"  [{n}] {prompt!r} -> {text!r}" for n, (prompt, text) in enumerate(rows, 1)]
            print("\n".join([f" samples at iteration {iteration}:", *lines]), flush=True)
        writers = self.metric_writers
        if writers is not None and writers.enabled:
            writers.log_table(self.section.tag, ["prompt", "completion"], rows, iteration)

    def generate(self, model: list[Any]) -> list[Any]:
        """The completions of the prompts by ``model`` (collective over its model-parallel
        group); the model is back in training mode afterwards."""
        if self.toggle:
            disable_forward_pre_hook(model)
        try:
            generator = TextGenerator(
                model,
                self.tokenizer,
                max_sequence_length=self.seq_length,
                max_batch_size=len(self.prompts),
            )
            return generator.generate(self.prompts, self.options)
        finally:
            for chunk in model:
                chunk.train()
            if self.toggle:
                enable_forward_pre_hook(model)
