"""``T5ModelProvider``: encoder-decoder models (megatron-core ``T5Model``).

The layer implementation follows ``layer_spec_backend`` as for GPT
(:mod:`bridge.train.models.layer_specs`): ``"portable"`` builds megatron's local T5
encoder and decoder layers with SDPA core attention for the encoder's padding-masked
self-attention, the decoder's causal self-attention and its cross-attention
(:class:`core_utils.portable_attention.SDPACoreAttention`), and a torch final norm;
``"local"`` keeps megatron's ``DotProductAttention`` (CUDA); ``"transformer_engine"`` is
refused (the T5 forward step builds megatron's local ``[b, 1, q, k]`` masks).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any, ClassVar

from megatron.core.models.T5 import T5Model, t5_spec
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

from bridge.train.models.gpt_provider import GPTModelProvider
from core_utils.portable_attention import with_sdpa_core_attention

__all__ = ["T5ModelProvider"]


@dataclass
class T5ModelProvider(GPTModelProvider):
    """A T5 (encoder-decoder) config that builds megatron-core's ``T5Model``.

    ``num_layers`` is the decoder depth, ``encoder_num_layers`` the encoder depth (``None``:
    the same); ``seq_length`` is the encoder's sequence length and ``seq_length_dec`` the
    decoder's. Defaults describe a tiny model that trains on a laptop CPU.

    Attributes:
        encoder_num_layers: Encoder layers (``None``: ``num_layers``).
        seq_length_dec: Decoder sequence length.
        max_position_embeddings: Length of the learned position table (``None``: the longer
            of the two sequence lengths).
    """

    encoder_num_layers: int | None = None
    seq_length_dec: int = 32
    max_position_embeddings: int | None = None
    _local_modules_only: ClassVar[tuple[str, str] | None] = (
        "T5 models",
        "the T5 forward step builds megatron's local attention masks",
    )
    _fixed_fields: ClassVar[dict[str, tuple[Any, str]]] = {
        "pipeline_model_parallel_size": (
            1,
            "for T5 models (megatron core's T5 pipeline split is not wired; use tensor or "
            "data parallelism)",
        ),
        "rope_scaling": (False, "by megatron's T5Model (it does not read it)"),
        "rotary_base": (10000, "by megatron's T5Model (it does not read it)"),
    }

    def __post_init__(self) -> None:
        """Validate the encoder-decoder fields, then the GPT and megatron checks.

        Raises:
            ValueError: A size is not positive, or the position table is shorter than a
                sequence.
        """
        self._check_positive("seq_length_dec")
        self._check_positive("encoder_num_layers", "max_position_embeddings", optional=True)
        longest = max(self.seq_length, self.seq_length_dec)
        if self.max_position_embeddings is not None and self.max_position_embeddings < longest:
            raise ValueError(
                f"model.max_position_embeddings={self.max_position_embeddings} is shorter than "
                f"the longest sequence ({longest}: seq_length / seq_length_dec)"
            )
        super().__post_init__()

    @property
    def encoder_layers(self) -> int:
        """Number of encoder layers."""
        return self.encoder_num_layers if self.encoder_num_layers is not None else self.num_layers

    @property
    def position_table_length(self) -> int:
        """Length of the learned position embedding table."""
        return self.max_position_embeddings or max(self.seq_length, self.seq_length_dec)

    def _default_layer_spec(self, vp_stage: int | None) -> Any:
        """``(encoder_block_spec, decoder_block_spec)`` of the resolved backend."""
        encoder = t5_spec.encoder_model_with_local_spec()
        decoder = t5_spec.decoder_model_with_local_spec()
        if self.resolved_layer_spec_backend() == "portable":
            encoder, decoder = (with_sdpa_core_attention(spec) for spec in (encoder, decoder))
        # megatron's local block specs end in a Transformer Engine norm; use the local one.
        return (
            TransformerBlockSubmodules([encoder] * self.encoder_layers, layer_norm=t5_spec.LNImpl),
            TransformerBlockSubmodules([decoder] * self.num_layers, layer_norm=t5_spec.LNImpl),
        )

    def _build_model(self, vp_stage: int | None, **common: Any) -> Any:
        """megatron's ``T5Model``; the encoder's config differs only in its depth."""
        encoder_spec, decoder_spec = self.layer_spec(vp_stage)
        encoder_config = copy.deepcopy(self)
        encoder_config.num_layers = self.encoder_layers
        return T5Model(
            encoder_config=encoder_config,
            transformer_encoder_layer_spec=encoder_spec,
            transformer_decoder_layer_spec=decoder_spec,
            max_sequence_length=self.position_table_length,
            **common,
        )
