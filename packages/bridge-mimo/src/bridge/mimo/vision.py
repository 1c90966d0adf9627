"""A small ViT-style image encoder built from megatron-core layers, runnable on CPU.

:class:`PatchEncoder` cuts images into square patches, embeds each patch linearly, adds a
learned position embedding and runs a megatron-core ``TransformerBlock`` with bidirectional
attention (megatron's ViT layer spec with the SDPA core attention of
``core_utils.portable_attention``, so it runs on CPU and GPU, with tensor parallelism over
the module's group). Its output is ``[batch, patches, hidden]``: one embedding per patch,
grouped by image, which is what a MIMO vision submodule passes on (after a projection to
the language model's width).
"""

from __future__ import annotations

from typing import Any

import torch
from megatron.core.models.vision.vit_layer_specs import get_vit_layer_with_local_spec
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_block import TransformerBlock
from megatron.core.transformer.transformer_config import TransformerConfig

from core_utils.portable_attention import with_sdpa_core_attention

__all__ = ["PatchEncoder", "ProjectionMLP"]


class PatchEncoder(MegatronModule):
    """Patch embedding + bidirectional megatron transformer layers.

    Args:
        config: Transformer config of the encoder (``num_layers``, ``hidden_size``,
            ``num_attention_heads``, ``tensor_model_parallel_size``, ...).
        image_size: Height and width of the (square) input images.
        patch_size: Side of a square patch; must divide ``image_size``.
        in_channels: Channels of the input images.
        pg_collection: Process groups of the module (tensor parallelism); ``None`` uses
            megatron's global parallel state.

    Raises:
        ValueError: ``patch_size`` does not divide ``image_size``.
    """

    def __init__(
        self,
        config: TransformerConfig,
        image_size: int,
        patch_size: int,
        in_channels: int = 3,
        pg_collection: ProcessGroupCollection | None = None,
    ) -> None:
        super().__init__(config=config)
        if patch_size < 1 or image_size % patch_size:
            raise ValueError(f"patch_size={patch_size} must divide image_size={image_size}")
        self.image_size = image_size
        self.patch_size = patch_size
        self.in_channels = in_channels
        self.num_patches = (image_size // patch_size) ** 2
        self.patch_embedding = torch.nn.Linear(
            in_channels * patch_size * patch_size, config.hidden_size
        )
        self.position_embedding = torch.nn.Parameter(
            torch.randn(self.num_patches, config.hidden_size) * config.init_method_std
        )
        self.transformer = TransformerBlock(
            config=config,
            spec=with_sdpa_core_attention(get_vit_layer_with_local_spec()),
            post_layer_norm=True,
            pg_collection=pg_collection,
        )

    def patchify(self, images: torch.Tensor) -> torch.Tensor:
        """``[b, c, H, W]`` images -> ``[b, patches, c * p * p]`` (row-major patches).

        Raises:
            ValueError: The images do not have the configured shape.
        """
        expected = (self.in_channels, self.image_size, self.image_size)
        if images.dim() != 4 or tuple(images.shape[1:]) != expected:
            raise ValueError(
                f"PatchEncoder expects images of shape [batch, {', '.join(map(str, expected))}], "
                f"got {tuple(images.shape)}"
            )
        b, c, _, _ = images.shape
        p = self.patch_size
        n = self.image_size // p
        patches = images.reshape(b, c, n, p, n, p).permute(0, 2, 4, 1, 3, 5)
        return patches.reshape(b, n * n, c * p * p)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        """Encode images; returns ``[batch, patches, hidden]``."""
        tokens = self.patch_embedding(self.patchify(images).to(self.patch_embedding.weight.dtype))
        tokens = tokens + self.position_embedding
        hidden = self.transformer(tokens.transpose(0, 1).contiguous(), attention_mask=None)
        return hidden.transpose(0, 1)


class ProjectionMLP(torch.nn.Module):
    """Two-layer MLP mapping encoder embeddings to the language model's width.

    Args:
        input_size: Encoder hidden size.
        output_size: Language-model hidden size.
        hidden_size: Width of the middle layer (default: ``output_size``).
    """

    def __init__(self, input_size: int, output_size: int, hidden_size: int | None = None) -> None:
        super().__init__()
        width = hidden_size or output_size
        self.fc1 = torch.nn.Linear(input_size, width)
        self.fc2 = torch.nn.Linear(width, output_size)
        # The module's tensor-parallel group (set by build_mimo_model): the projection is
        # replicated over it, and checkpoints must know which copy is the main one.
        self.tp_group: torch.distributed.ProcessGroup | None = None

    def sharded_state_dict(
        self,
        prefix: str = "",
        sharded_offsets: tuple[tuple[int, int, int], ...] = (),
        metadata: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        """The weights as megatron ``ShardedTensor`` s replicated over the TP and DP groups.

        megatron's default for a plain module would take tensor-parallel rank 0 on every
        rank when it is given no group, so every TP rank would claim the main copy.
        """
        from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

        dp_cp_group = (metadata or {}).get("dp_cp_group")
        return make_sharded_tensors_for_checkpoint(
            self.state_dict(prefix="", keep_vars=True),
            prefix,
            {},
            sharded_offsets,
            tp_group=self.tp_group,
            dp_cp_group=dp_cp_group,
        )

    def forward(self, embeddings: torch.Tensor) -> torch.Tensor:
        """Project ``[..., input_size]`` to ``[..., output_size]``."""
        return self.fc2(torch.nn.functional.gelu(self.fc1(embeddings)))
