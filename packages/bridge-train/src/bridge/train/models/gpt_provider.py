"""``GPTModelProvider``: the GPT model config that builds its own megatron ``GPTModel``."""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any, ClassVar, Literal

import torch
from megatron.core import parallel_state
from megatron.core.models.gpt import GPTModel
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_config import TransformerConfig

from bridge.train.data.tokenizers import Tokenizer
from bridge.train.models.architecture import same_setting
from bridge.train.models.cpu_rotary import keep_rotary_on_cpu
from bridge.train.models.layer_specs import (
    LayerSpecBackend,
    build_gpt_layer_spec,
    resolve_layer_spec_backend,
)

__all__ = ["GPTModelProvider", "calculate_padded_vocab_size"]


def calculate_padded_vocab_size(
    vocab_size: int, make_vocab_size_divisible_by: int, tensor_model_parallel_size: int
) -> int:
    """Round ``vocab_size`` up to a multiple of ``make_vocab_size_divisible_by * TP``.

    This is megatron's padding: every tensor-parallel rank then holds an equal slice of the
    embedding and output layer, and the slices keep a GEMM-friendly size.

    Args:
        vocab_size: Tokenizer vocabulary size.
        make_vocab_size_divisible_by: Padding granularity per tensor-parallel rank.
        tensor_model_parallel_size: Tensor-parallel size.

    Returns:
        The padded vocabulary size (>= ``vocab_size``).

    Raises:
        ValueError: An argument is not positive.
    """
    for name, value in (
        ("vocab_size", vocab_size),
        ("make_vocab_size_divisible_by", make_vocab_size_divisible_by),
        ("tensor_model_parallel_size", tensor_model_parallel_size),
    ):
        if value is None or int(value) < 1:
            raise ValueError(f"calculate_padded_vocab_size: {name} must be >= 1, got {value!r}")
    multiple = make_vocab_size_divisible_by * tensor_model_parallel_size
    return int(math.ceil(vocab_size / multiple) * multiple)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


@dataclass
class GPTModelProvider(TransformerConfig):
    """A megatron ``TransformerConfig`` with the GPT fields, able to build the model.

    Because it subclasses ``TransformerConfig`` it *is* the model config megatron's layers,
    schedules and optimizers read. The defaults describe a tiny model (2 layers, hidden 64,
    4 heads, sequence 64) that trains on a laptop CPU; every megatron field can be set.

    Fields derived by ``TransformerConfig.__post_init__`` when left unset
    (``ffn_hidden_size``, ``kv_channels``, ``num_query_groups``, ``init_method``,
    ``output_layer_init_method``, ...) are remembered in :attr:`derived_fields`; after
    changing fields of a constructed provider call :meth:`finalize` to derive them again.
    No default is a stored lambda: init methods are ``functools.partial`` of
    ``torch.nn.init.normal_`` built in ``__post_init__``, so a serialised config rebuilds
    the same model.

    Attributes:
        vocab_size: Tokenizer vocabulary size (unpadded). ``None`` until the trainer takes it
            from the tokenizer; :meth:`provide` refuses to build without it.
        seq_length: Maximum sequence length (learned position embeddings are this long).
        make_vocab_size_divisible_by: Pad the vocabulary to a multiple of this times the
            tensor-parallel size.
        should_pad_vocab: Pad the vocabulary as above (megatron's behaviour). When false
            ``vocab_size`` must already be divisible by the tensor-parallel size.
        share_embeddings_and_output_weights: Tie the output layer to the input embedding.
        position_embedding_type: ``"learned_absolute"``, ``"rope"``, ``"none"``, or ``"yarn"``
            (YaRN-scaled RoPE; only for providers with megatron's ``yarn_*`` fields, such as
            :class:`~bridge.train.models.gpt_oss_provider.GptOssModelProvider`).
        rotary_percent: Fraction of each head's dimensions rotated by RoPE.
        rotary_base: RoPE base period.
        rope_scaling: Apply Llama-3.1 style RoPE frequency scaling.
        rope_scaling_factor: RoPE scaling factor when ``rope_scaling``.
        seq_len_interpolation_factor: Linear RoPE interpolation factor (> 1) or ``None``.
        fp16_lm_cross_entropy: Compute the cross entropy in fp16 instead of fp32.
        parallel_output: Keep logits split across tensor-parallel ranks (the vocab-parallel
            cross entropy consumes them that way).
        scatter_embedding_sequence_parallel: Scatter embeddings along the sequence with
            sequence parallelism.
        layer_spec_backend: Which layer implementation to build: ``"auto"``, ``"portable"``
            (megatron local layers + torch SDPA attention; any device), ``"local"``
            (megatron local spec; CUDA) or ``"transformer_engine"`` (CUDA + ``te`` extra).
            See :mod:`bridge.train.models.layer_specs`.
        transformer_layer_spec: An explicit layer spec, or a callable
            ``(provider) -> spec`` (optionally ``(provider, vp_stage)``); overrides
            ``layer_spec_backend`` when set.
    """

    num_layers: int = 2
    hidden_size: int = 64
    num_attention_heads: int = 4

    vocab_size: int | None = None
    seq_length: int = 64
    make_vocab_size_divisible_by: int = 128
    should_pad_vocab: bool = True
    share_embeddings_and_output_weights: bool = True
    position_embedding_type: Literal["learned_absolute", "rope", "none", "yarn"] = (
        "learned_absolute"
    )
    rotary_percent: float = 1.0
    rotary_base: int = 10000
    rope_scaling: bool = False
    rope_scaling_factor: float = 8.0
    seq_len_interpolation_factor: float | None = None
    fp16_lm_cross_entropy: bool = False
    parallel_output: bool = True
    scatter_embedding_sequence_parallel: bool = True
    layer_spec_backend: LayerSpecBackend = "auto"
    transformer_layer_spec: ModuleSpec | Callable[..., Any] | None = None

    # The field holding the user's layer spec (it overrides layer_spec_backend).
    _user_spec_field: ClassVar[str] = "transformer_layer_spec"
    # (model name, why Transformer Engine's spec cannot build it) of a provider built only
    # from megatron's local modules; None: every backend.
    _local_modules_only: ClassVar[tuple[str, str] | None] = None
    # {field: (the one value this provider builds, why no other)}: other values are refused.
    _fixed_fields: ClassVar[dict[str, tuple[Any, str]]] = {}

    def __post_init__(self) -> None:
        """Validate the parallel layout and GPT fields, then run megatron's checks.

        ``pipeline_dtype`` left unset with more than one pipeline stage is derived from
        ``params_dtype``.

        Raises:
            ValueError: A size is not positive, a field of :attr:`_fixed_fields` holds another
                value, or a tensor-parallel size that does not divide the attention heads,
                query groups or FFN width (the message names the fields and the sizes that
                would work).
        """
        for name, (accepted, why) in self._fixed_fields.items():
            if getattr(self, name) != accepted:
                raise ValueError(
                    f"model.{name}={getattr(self, name)!r} is not supported {why}; set it to "
                    f"{accepted!r}"
                )
        self._check_gpt_fields()
        unset = {f.name for f in fields(TransformerConfig) if getattr(self, f.name) is None}
        if self.pipeline_model_parallel_size > 1 and "pipeline_dtype" in unset:
            # Activations cross stages in the parameters' dtype (as Megatron-LM derives it);
            # megatron-core would otherwise refuse every pipeline layout not naming a dtype.
            self.pipeline_dtype = self.params_dtype
        super().__post_init__()
        # Values megatron derived here; finalize() re-derives those still holding them.
        self._derived_values: dict[str, Any] = {
            name: getattr(self, name) for name in unset if getattr(self, name) is not None
        }

    def _check_positive(self, *names: str, optional: bool = False) -> None:
        """Refuse a field of ``names`` that is not a positive integer (or None if ``optional``)."""
        for name in names:
            value = getattr(self, name)
            if (value is not None or not optional) and (not isinstance(value, int) or value < 1):
                either = " or None" if optional else ""
                raise ValueError(f"model.{name} must be a positive integer{either}, got {value!r}")

    def _check_gpt_fields(self) -> None:
        self._check_positive(
            "num_layers",
            "hidden_size",
            "num_attention_heads",
            "seq_length",
            "make_vocab_size_divisible_by",
            "tensor_model_parallel_size",
        )
        self._check_positive("vocab_size", optional=True)
        if self.position_embedding_type not in ("learned_absolute", "rope", "none", "yarn"):
            raise ValueError(
                f"model.position_embedding_type={self.position_embedding_type!r} is not one of "
                "'learned_absolute', 'rope', 'none', 'yarn'"
            )
        if self.position_embedding_type == "yarn" and not hasattr(
            self, "yarn_rotary_scaling_factor"
        ):
            # megatron's GPTModel reads the YaRN parameters from yarn_* config fields.
            raise ValueError(
                f"model.position_embedding_type='yarn' needs megatron's yarn_* fields, which "
                f"{type(self).__name__} does not have; use a provider that has them "
                "(bridge.train.models.gpt_oss_provider.GptOssModelProvider)"
            )
        if self.kv_channels is None and self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"model.hidden_size={self.hidden_size} is not divisible by "
                f"model.num_attention_heads={self.num_attention_heads}; change one of them or "
                "set model.kv_channels explicitly"
            )
        tp = self.tensor_model_parallel_size
        heads = self.num_attention_heads
        if heads % tp:
            raise ValueError(
                f"model.tensor_model_parallel_size={tp} does not divide "
                f"model.num_attention_heads={heads}: every tensor-parallel rank needs whole "
                f"attention heads. Use a tensor_model_parallel_size in {_divisors(heads)} or "
                "change num_attention_heads."
            )
        groups = self.num_query_groups
        if groups is not None and groups % tp and tp % groups:
            raise ValueError(
                f"model.tensor_model_parallel_size={tp} and model.num_query_groups={groups}: "
                "the query groups must be a multiple or a divisor of the tensor-parallel size. "
                f"Use a tensor_model_parallel_size in {_divisors(groups)} or change "
                "num_query_groups."
            )
        ffn = self.ffn_hidden_size if self.ffn_hidden_size is not None else 4 * self.hidden_size
        if ffn % tp:
            raise ValueError(
                f"model.tensor_model_parallel_size={tp} does not divide model.ffn_hidden_size="
                f"{ffn}; change one of them"
            )
        if not self.should_pad_vocab and self.vocab_size is not None and self.vocab_size % tp:
            raise ValueError(
                f"model.vocab_size={self.vocab_size} is not divisible by "
                f"model.tensor_model_parallel_size={tp} and model.should_pad_vocab is False; "
                "set should_pad_vocab=True"
            )

    def finalize(self) -> GPTModelProvider:
        """Re-derive the derived fields and re-validate after fields were changed.

        Fields that ``__post_init__`` derived (see :attr:`derived_fields`) are reset to
        ``None`` and derived again from the current values, so changing ``hidden_size`` of a
        built provider also updates ``ffn_hidden_size``, ``kv_channels`` and the init methods.
        A derived field the user has since set to a different value keeps that value.

        Returns:
            ``self``.
        """
        for name in self.derived_fields:
            setattr(self, name, None)
        self.__post_init__()
        return self

    @property
    def derived_fields(self) -> frozenset[str]:
        """Fields ``__post_init__`` derived because they were left unset, and that still
        hold the derived value (a field set since then is the user's, not derived).

        ``bridge.config`` leaves these out of saved configs, so they are derived again on
        load (and follow an override of what they are derived from).
        """
        return frozenset(
            name
            for name, derived in getattr(self, "_derived_values", {}).items()
            if getattr(self, name) is derived or same_setting(getattr(self, name), derived)
        )

    def apply_tokenizer(self, tokenizer: Tokenizer) -> GPTModelProvider:
        """Take ``vocab_size`` from ``tokenizer`` when unset; check it fits otherwise.

        Args:
            tokenizer: Any object with ``vocab_size``.

        Returns:
            ``self``.

        Raises:
            ValueError: ``vocab_size`` is set but smaller than the tokenizer's (token ids
                would fall outside the embedding).
        """
        needed = int(tokenizer.vocab_size)
        if self.vocab_size is None:
            self.vocab_size = needed
        elif self.vocab_size < needed:
            raise ValueError(
                f"model.vocab_size={self.vocab_size} is smaller than the tokenizer's vocabulary "
                f"({needed}); unset model.vocab_size to take it from the tokenizer"
            )
        return self

    @property
    def padded_vocab_size(self) -> int:
        """The vocabulary size of the embedding and output layers (see ``should_pad_vocab``).

        Raises:
            ValueError: ``vocab_size`` is not set.
        """
        if self.vocab_size is None:
            raise ValueError(
                "model.vocab_size is not set: set it in the config, or let the trainer take it "
                "from the tokenizer before building the model"
            )
        if not self.should_pad_vocab:
            return self.vocab_size
        return calculate_padded_vocab_size(
            self.vocab_size, self.make_vocab_size_divisible_by, self.tensor_model_parallel_size
        )

    def resolved_layer_spec_backend(self) -> Literal["portable", "local", "transformer_engine"]:
        """The layer implementation :meth:`provide` builds on this machine.

        For a provider built only from megatron's local modules (:attr:`_local_modules_only`
        set), ``"auto"`` resolves to ``"local"`` on CUDA and ``"transformer_engine"`` is
        refused.

        Raises:
            ValueError: The requested backend cannot run here (see
                :func:`~bridge.train.models.layer_specs.resolve_layer_spec_backend`), or is
                Transformer Engine for such a provider.
        """
        local_only = self._local_modules_only
        if local_only is not None and self.layer_spec_backend == "transformer_engine":
            raise ValueError(
                f"model.layer_spec_backend='transformer_engine' is not supported for "
                f"{local_only[0]} ({local_only[1]}); use 'local' or 'auto'"
            )
        # Such a provider resolves "auto" as if Transformer Engine were not installed.
        return resolve_layer_spec_backend(
            self.layer_spec_backend, te_installed=False if local_only else None
        )

    def layer_spec(self, vp_stage: int | None = None) -> Any:
        """The layer spec :meth:`provide` uses: the user's (``transformer_layer_spec``, or the
        provider's own spec field: as given, or, when it is a callable, called with the provider and
        ``vp_stage`` when it takes one), else the provider's own for its backend.

        Args:
            vp_stage: Virtual pipeline stage.

        Returns:
            A megatron ``ModuleSpec`` or ``TransformerBlockSubmodules``.
        """
        spec = getattr(self, self._user_spec_field)
        if spec is None:
            return self._default_layer_spec(vp_stage)
        if isinstance(spec, ModuleSpec) or not callable(spec):
            return spec
        if "vp_stage" in inspect.signature(spec).parameters:
            return spec(self, vp_stage=vp_stage)
        return spec(self)

    def _default_layer_spec(self, vp_stage: int | None) -> Any:
        return build_gpt_layer_spec(self, self.resolved_layer_spec_backend(), vp_stage)

    def provide(
        self,
        pre_process: bool | None = None,
        post_process: bool | None = None,
        vp_stage: int | None = None,
    ) -> GPTModel:
        """Build the megatron model chunk for this rank (a ``GPTModel`` here).

        Needs megatron's parallel state (``bridge.train.engine.initialize.initialize_distributed`` or
        ``parallel_state.initialize_model_parallel``). Without CUDA the model is initialised
        on CPU (``use_cpu_initialization`` is set), which also makes tensor-parallel shards
        slices of the same full weights a single process would draw. The parameters are
        left on the CPU; the engine moves them to the training device. Unless the user gave
        the layer spec, ``transformer_impl`` is set to the layers the resolved backend
        builds (megatron's modules read it).

        Args:
            pre_process: Build the embedding (default: this rank runs the first pipeline
                stage).
            post_process: Build the output layer and loss (default: last pipeline stage).
            vp_stage: Virtual pipeline stage of this model chunk.

        Returns:
            The model chunk.

        Raises:
            ValueError: ``vocab_size`` is unset or the layer backend cannot run here.
            RuntimeError: Megatron's parallel state is not initialised, or its
                tensor-parallel size differs from ``tensor_model_parallel_size``.
        """
        vocab = self.padded_vocab_size
        name = type(self).__name__
        if not parallel_state.model_parallel_is_initialized():
            raise RuntimeError(
                f"{name}.provide() needs megatron's parallel state: call "
                "bridge.train.engine.initialize.initialize_distributed(...) (or megatron.core.parallel_state."
                "initialize_model_parallel) first"
            )
        tp = parallel_state.get_tensor_model_parallel_world_size()
        if tp != self.tensor_model_parallel_size:
            raise RuntimeError(
                f"model.tensor_model_parallel_size={self.tensor_model_parallel_size} but the "
                f"initialised tensor-parallel group has {tp} ranks; initialise the parallel "
                "state from this config"
            )
        if not torch.cuda.is_available():
            self.use_cpu_initialization = True
        if getattr(self, self._user_spec_field) is None:
            te = self.resolved_layer_spec_backend() == "transformer_engine"
            self.transformer_impl = "transformer_engine" if te else "local"
        if pre_process is None:
            pre_process = parallel_state.is_pipeline_first_stage(
                ignore_virtual=False, vp_stage=vp_stage
            )
        if post_process is None:
            post_process = parallel_state.is_pipeline_last_stage(
                ignore_virtual=False, vp_stage=vp_stage
            )
        model = self._build_model(
            vp_stage,
            config=self,
            vocab_size=vocab,
            pre_process=bool(pre_process),
            post_process=bool(post_process),
            fp16_lm_cross_entropy=self.fp16_lm_cross_entropy,
            parallel_output=self.parallel_output,
            share_embeddings_and_output_weights=self.share_embeddings_and_output_weights,
            position_embedding_type=self.position_embedding_type,
            rotary_percent=self.rotary_percent,
            seq_len_interpolation_factor=self.seq_len_interpolation_factor,
        )
        keep_rotary_on_cpu(model)  # a model without rotary embeddings has none to swap
        return model

    def _build_model(self, vp_stage: int | None, **common: Any) -> Any:
        """megatron's model, from ``common`` (the arguments its GPT, hybrid and T5 models
        share) and the ones of this provider's model."""
        return GPTModel(
            transformer_layer_spec=self.layer_spec(vp_stage),
            max_sequence_length=self.seq_length,
            rotary_base=self.rotary_base,
            rope_scaling=self.rope_scaling,
            rope_scaling_factor=self.rope_scaling_factor,
            scatter_embedding_sequence_parallel=self.scatter_embedding_sequence_parallel,
            vp_stage=vp_stage,
            **common,
        )
