"""A hybrid (Mamba + attention + MLP) stack spec that runs on any device, CPU included.

megatron-core 0.19's hybrid stack spec is built from Transformer Engine modules, its
``HybridStack`` builds its final norm with Transformer Engine, and its ``MambaMixer`` needs
the ``mamba-ssm`` / ``causal-conv1d`` CUDA kernels (and allocates on
``torch.cuda.current_device()``). The portable spec keeps megatron's ``HybridModel``,
``MambaLayer``, ``TransformerLayer`` and ``MLPLayer`` and swaps in:

* :class:`PortableMambaMixer`: the Mamba-2 mixer with the same parameters, names, shapes
  and checkpoint layout as megatron's ``MambaMixer``, computing the scan and the short
  convolution with :mod:`bridge.train.models.ssd_torch`;
* megatron's local linear layers and norms, and SDPA core attention (as the portable GPT
  spec does);
* :class:`PortableHybridStack`: megatron's stack with a torch final norm.

Tensor parallelism works as in megatron's mixer (``in_proj`` column-parallel, ``out_proj``
row-parallel, heads and groups split over the ranks; the gated norm is per group, so no
communication). The mixer draws its parameters as full (unsplit) tensors on the CPU
generator and keeps this rank's part of each of ``z, x, B, C, dt``, so every
tensor-parallel size starts from the same model. Not supported: context parallelism,
sequence packing, inference caches (training only).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.models.hybrid.hybrid_block import HybridStack, HybridStackSubmodules
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.ssm.mamba_layer import MambaLayer, MambaLayerSubmodules
from megatron.core.ssm.mamba_mixer import MambaMixer, MambaMixerSubmodules
from megatron.core.ssm.mlp_layer import MLPLayer
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec, build_module
from megatron.core.transformer.torch_norm import WrappedTorchNorm
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.transformer_layer import TransformerLayer, TransformerLayerSubmodules
from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

from bridge.train.models.layout_init import mamba_init_rule
from bridge.train.models.ssd_torch import causal_depthwise_conv1d, ssd_chunked_scan
from core_utils.portable_attention import with_sdpa_core_attention

__all__ = [
    "GatedGroupRMSNorm",
    "PortableHybridStack",
    "PortableMambaMixer",
    "build_portable_hybrid_stack_spec",
]


class GatedGroupRMSNorm(torch.nn.Module):
    """``rmsnorm(y * silu(z))`` over groups of ``group_size`` channels (Mamba-2's output norm).

    The same computation as mamba-ssm's ``RMSNormGated(norm_before_gate=False)``; the weight
    is split over tensor-parallel ranks along its only axis.
    """

    def __init__(
        self, size: int, group_size: int, eps: float, dtype: torch.dtype, tp_group: Any
    ) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(size, dtype=dtype))
        self.group_size = group_size
        self.eps = eps
        self.tp_group = tp_group
        set_tensor_model_parallel_attributes(self.weight, True, 0, 1)

    def forward(self, y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """Gate ``y`` [..., size] with ``silu(z)`` and normalise per group."""
        gated = (y.float() * F.silu(z.float())).unflatten(-1, (-1, self.group_size))
        normed = gated * torch.rsqrt(gated.pow(2).mean(-1, keepdim=True) + self.eps)
        return (normed.flatten(-2) * self.weight.float()).to(y.dtype)

    def sharded_state_dict(
        self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None
    ) -> Any:
        """The weight, split along axis 0 over tensor-parallel ranks (as megatron's norm)."""
        assert metadata is not None
        return make_sharded_tensors_for_checkpoint(
            self.state_dict(prefix="", keep_vars=True),
            prefix,
            {"weight": 0},
            sharded_offsets,
            tp_group=self.tp_group,
            dp_cp_group=metadata["dp_cp_group"],
        )


def _rank_parts(full: torch.Tensor, sizes: list[int], rank: int, world: int) -> torch.Tensor:
    """This rank's share of each consecutive part of ``full`` (split along dim 0)."""
    parts = torch.split(full, sizes, dim=0)
    return torch.cat([part.chunk(world, dim=0)[rank] for part in parts], dim=0)


class PortableMambaMixer(MegatronModule):
    """megatron's Mamba-2 mixer (training path) in torch, for any device.

    Accepts the constructor arguments of megatron's ``MambaMixer`` (which megatron's
    ``MambaLayer`` passes) and has its parameters (``in_proj``, ``conv1d_weight``,
    ``conv1d_bias``, ``dt_bias``, ``A_log``, ``D``, ``norm.weight``, ``out_proj``) and its
    sharded checkpoint layout (megatron's keys; loading into megatron's mixer on GPU is
    untested here).

    Raises:
        ValueError: Context parallelism / sequence parallelism is on, or a mixer option
            megatron's defaults do not have.
    """

    def __init__(
        self,
        config: TransformerConfig,
        submodules: MambaMixerSubmodules,
        d_model: int,
        d_conv: int = 4,
        conv_init: float | None = None,
        expand: int = 2,
        A_init_range: tuple[float, float] = (1, 16),
        D_has_hdim: bool = False,
        rmsnorm: bool = True,
        norm_before_gate: bool = False,
        dt_min: float = 0.001,
        dt_max: float = 0.1,
        # dt_init, dt_scale: accepted and unused, as by megatron's mixer (no config field
        # sets them); pp_layer_offset: megatron's mixer uses it only for inference.
        dt_init: str = "random",
        dt_scale: float = 1.0,
        dt_init_floor: float = 1e-4,
        bias: bool = False,
        conv_bias: bool = True,
        chunk_size: int = 128,
        layer_number: int | None = None,
        pg_collection: ProcessGroupCollection | None = None,
        pp_layer_offset: int = 0,
        name: str | None = None,
    ) -> None:
        super().__init__(config)
        if pg_collection is None:
            raise ValueError("PortableMambaMixer needs pg_collection (megatron passes it)")
        if bias or not conv_bias or norm_before_gate or not rmsnorm:
            raise ValueError(
                "PortableMambaMixer supports megatron's Mamba-2 mixer defaults only "
                "(bias=False, conv_bias=True, rmsnorm=True, norm_before_gate=False)"
            )
        if config.context_parallel_size != 1 or config.sequence_parallel:
            raise ValueError(
                "the portable Mamba mixer supports neither context nor sequence parallelism; "
                "set model.context_parallel_size=1 and model.sequence_parallel=False (or use "
                "megatron's mixer with mamba-ssm on GPU: model.layer_spec_backend="
                "'transformer_engine')"
            )
        self.d_model = d_model
        self.d_conv = d_conv
        # The init settings, kept as megatron's mixer keeps conv_init (layout-independent
        # initialisation draws these parameters again from them).
        self.conv_init = conv_init
        self.dt_min, self.dt_max, self.dt_init_floor = dt_min, dt_max, dt_init_floor
        self.A_init_range = A_init_range
        self.chunk_size = chunk_size
        self.layer_number = layer_number
        self.D_has_hdim = D_has_hdim
        self.d_state = config.mamba_state_dim
        self.headdim = config.mamba_head_dim
        self.ngroups = config.mamba_num_groups
        if config.mamba_num_heads is not None:
            self.nheads = config.mamba_num_heads
            self.d_inner = self.nheads * self.headdim
        else:
            self.d_inner = int(expand * d_model)
            self.nheads = self.d_inner // self.headdim
        # The sizes divide (heads by groups, both by the tensor-parallel size, the width by
        # the head size): MambaProvider refuses them otherwise, naming the fields.
        self.tp_group = pg_collection.tp
        tp_size, tp_rank = self.tp_group.size(), self.tp_group.rank()
        self.nheads_local_tp = self.nheads // tp_size
        self.d_inner_local_tp = self.d_inner // tp_size
        self.ngroups_local_tp = self.ngroups // tp_size

        group_state = self.ngroups * self.d_state
        in_proj_parts = [self.d_inner, self.d_inner, group_state, group_state, self.nheads]
        self.in_proj = build_module(
            submodules.in_proj,
            d_model,
            sum(in_proj_parts),
            config=config,
            init_method=config.init_method,
            gather_output=False,
            bias=False,
            skip_bias_add=False,
            is_expert=False,
            tp_comm_buffer_name="fc1",
            tp_group=self.tp_group,
        )
        # partition_sizes: the per-rank blocks of the packed components (megatron's
        # resharding reads it).
        self.in_proj.weight.partition_sizes = [part // tp_size for part in in_proj_parts]
        dtype = config.params_dtype
        conv_parts = [self.d_inner, group_state, group_state]
        local_conv_parts = [part // tp_size for part in conv_parts]
        conv_dim_local = sum(local_conv_parts)
        self.conv1d_weight = torch.nn.Parameter(torch.empty(conv_dim_local, 1, d_conv, dtype=dtype))
        self.conv1d_bias = torch.nn.Parameter(torch.empty(conv_dim_local, dtype=dtype))
        self.dt_bias = torch.nn.Parameter(torch.empty(self.nheads_local_tp, dtype=dtype))
        self.A_log = torch.nn.Parameter(torch.empty(self.nheads_local_tp, dtype=torch.float32))
        self.D = torch.nn.Parameter(
            torch.ones(self.d_inner_local_tp if D_has_hdim else self.nheads_local_tp)
        )
        for param in (self.conv1d_weight, self.conv1d_bias, self.dt_bias, self.A_log, self.D):
            set_tensor_model_parallel_attributes(param, True, 0, 1)
        self.conv1d_weight.partition_sizes = local_conv_parts  # type: ignore[attr-defined]
        self.conv1d_bias.partition_sizes = local_conv_parts  # type: ignore[attr-defined]

        if config.perform_initialization:
            # Full tensors on the CPU generator, then this rank's part of each component:
            # the same model for every tensor-parallel size (megatron's mixer draws per rank).
            # The mixer's own parameters follow megatron's rules (layout_init says them).
            with torch.no_grad():
                weight = torch.empty(sum(in_proj_parts), d_model, dtype=torch.float32)
                config.init_method(weight)
                self.in_proj.weight.copy_(_rank_parts(weight, in_proj_parts, tp_rank, tp_size))
                for name, parts in (
                    ("conv1d_weight", conv_parts),
                    ("conv1d_bias", conv_parts),
                    ("dt_bias", [self.nheads]),
                    ("A_log", [self.nheads]),
                ):
                    param = getattr(self, name)
                    full = torch.empty(sum(parts), *param.shape[1:])
                    draw = mamba_init_rule(self, name)
                    assert callable(draw)  # a constant only for D, which is not drawn
                    draw(full)
                    param.copy_(_rank_parts(full, parts, tp_rank, tp_size))

        self.norm = GatedGroupRMSNorm(
            self.d_inner_local_tp,
            group_size=self.d_inner_local_tp // self.ngroups_local_tp,
            eps=1e-5,
            dtype=dtype,
            tp_group=self.tp_group,
        )
        self.out_proj = build_module(
            submodules.out_proj,
            self.d_inner,
            d_model,
            config=config,
            init_method=config.output_layer_init_method,
            bias=False,
            input_is_parallel=True,
            skip_bias_add=True,
            is_expert=False,
            tp_comm_buffer_name="fc2",
            tp_group=self.tp_group,
        )

    def forward(
        self,
        hidden_states: torch.Tensor,
        inference_context: Any = None,
        *,
        inference_params: Any = None,
        packed_seq_params: Any = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Mix ``hidden_states`` ``[seq, batch, hidden]`` along the sequence.

        Returns:
            ``(output, bias)`` as megatron's mixer (``bias`` is ``None``).

        Raises:
            NotImplementedError: An inference context or packed sequences are given.
        """
        if inference_context is not None or inference_params is not None:
            raise NotImplementedError("PortableMambaMixer runs the training path only")
        if packed_seq_params is not None:
            raise NotImplementedError("PortableMambaMixer does not support packed sequences")
        zxbcdt, _ = self.in_proj(hidden_states)
        zxbcdt = zxbcdt.transpose(0, 1)  # [b, l, d]
        group_state = self.ngroups_local_tp * self.d_state
        z, xbc, dt = torch.split(
            zxbcdt,
            [self.d_inner_local_tp, self.d_inner_local_tp + 2 * group_state, self.nheads_local_tp],
            dim=-1,
        )
        xbc = F.silu(
            causal_depthwise_conv1d(xbc.transpose(1, 2), self.conv1d_weight, self.conv1d_bias)
        ).transpose(1, 2)
        x, B, C = torch.split(xbc, [self.d_inner_local_tp, group_state, group_state], dim=-1)
        batch, length, _ = x.shape
        D = self.D.view(self.nheads_local_tp, self.headdim) if self.D_has_hdim else self.D
        y = ssd_chunked_scan(
            x.reshape(batch, length, self.nheads_local_tp, self.headdim),
            F.softplus(dt.float() + self.dt_bias.float()),
            -torch.exp(self.A_log.float()),
            B.reshape(batch, length, self.ngroups_local_tp, self.d_state),
            C.reshape(batch, length, self.ngroups_local_tp, self.d_state),
            self.chunk_size,
            D=D,
        ).reshape(batch, length, self.d_inner_local_tp)
        y = self.norm(y, z).transpose(0, 1).contiguous()  # [l, b, d]
        return self.out_proj(y)

    # megatron's layout: in_proj split into z/x/B/C/dt, conv1d into x/B/C (the attributes it
    # reads exist here under the same names).
    sharded_state_dict = MambaMixer.sharded_state_dict


class PortableHybridStack(HybridStack):
    """megatron's ``HybridStack`` with a torch final norm instead of Transformer Engine's."""

    def __init__(self, config: TransformerConfig, *args: Any, **kwargs: Any) -> None:
        post_layer_norm = kwargs.pop("post_layer_norm", True)
        super().__init__(config, *args, post_layer_norm=False, **kwargs)
        self.post_layer_norm = post_layer_norm
        if self.post_process and post_layer_norm:
            self.final_norm = WrappedTorchNorm(
                config=config, hidden_size=config.hidden_size, eps=config.layernorm_epsilon
            )


def build_portable_hybrid_stack_spec(config: TransformerConfig) -> ModuleSpec:
    """The hybrid stack spec of the portable backend (see the module docstring).

    Attention (``*``), MLP (``-``) and Mamba (``M``) layers are supported; the other
    symbols of megatron's patterns (MoE, MLA, DSA, GDN) are left unbuilt and refused by
    :class:`bridge.train.MambaProvider` at config time.

    Args:
        config: The model config (its ``normalization`` picks the norms).

    Returns:
        A ``ModuleSpec`` for megatron's ``HybridModel(hybrid_stack_spec=...)``.
    """

    gpt = with_sdpa_core_attention(
        get_gpt_layer_local_spec(normalization=config.normalization, qk_layernorm=False)
    ).submodules
    norm = gpt.input_layernorm
    mamba_layer = ModuleSpec(
        module=MambaLayer,
        submodules=MambaLayerSubmodules(
            norm=norm,
            mixer=ModuleSpec(
                module=PortableMambaMixer,
                submodules=MambaMixerSubmodules(
                    in_proj=ColumnParallelLinear, out_proj=RowParallelLinear
                ),
            ),
            mamba_bda=get_bias_dropout_add,
            # Transformer Engine fuses the norm into in_proj; keep its checkpoint keys.
            sharded_state_dict_keys_map={"norm.": "mixer.in_proj.layer_norm_"},
        ),
    )
    attention_layer = ModuleSpec(
        module=TransformerLayer,
        submodules=TransformerLayerSubmodules(
            input_layernorm=norm,
            self_attention=gpt.self_attention,
            self_attn_bda=get_bias_dropout_add,
            sharded_state_dict_keys_map={
                "input_layernorm.": "self_attention.linear_qkv.layer_norm_"
            },
        ),
    )
    mlp_layer = ModuleSpec(
        module=MLPLayer,
        submodules=TransformerLayerSubmodules(
            pre_mlp_layernorm=gpt.pre_mlp_layernorm,
            mlp=gpt.mlp,
            mlp_bda=get_bias_dropout_add,
            sharded_state_dict_keys_map={"pre_mlp_layernorm.": "mlp.linear_fc1.layer_norm_"},
        ),
    )
    return ModuleSpec(
        module=PortableHybridStack,
        submodules=HybridStackSubmodules(
            mamba_layer=mamba_layer, attention_layer=attention_layer, mlp_layer=mlp_layer
        ),
    )
