"""Config-time checks of what the engine can run here, before any process group exists.

megatron-core accepts some settings that then fail deep inside a step, or, worse, train
without an error on wrong tensors. :func:`check_engine_config` refuses them while the run is
still a configuration, each with one line naming the field and the fix
(:class:`bridge.config.ConfigError`, which the ``bridge-train`` command turns into exit code
2):

* **Pipeline p2p mode** (any device). With ``pipeline_model_parallel_size == 2``
  and a virtual pipeline, a rank's previous and next pipeline stage are the same rank.
  megatron's interleaved schedule then posts, in one ``batch_isend_irecv``, a send and a
  receive to that rank for each direction; point-to-point operations to one peer are matched
  in posting order, so the activation sent forward arrives as the gradient expected from the
  backward direction and vice versa. Training continues on swapped tensors (measured: loss
  off by 0.6 after 5 steps). Megatron-LM's argument parser forbids the combination;
  megatron-core does not check it. ``overlap_p2p_comm=True`` (separate, ordered send/recv
  calls) or ``batch_p2p_comm=False`` (megatron orders unbatched send/recv by rank parity
  and uses two communicators for a 2-rank pipeline group) are correct. With more than two
  pipeline stages the previous and next stage differ and batching is correct; without a
  virtual pipeline no rank sends both ways in one batch. The run is refused rather than
  switched to another mode, because ``batch_p2p_comm=True`` is indistinguishable from a
  deliberate choice and the fix is one field.
* **Exclusive p2p settings**: ``overlap_p2p_comm`` with ``batch_p2p_comm``, and
  ``overlap_p2p_comm`` without a virtual pipeline (both raise inside megatron's schedules
  at the first step).
* **Without CUDA** (megatron-core's engine on CPU, through core-utils' CUDA emulation): features
  whose kernels exist only on GPUs: fp8/fp4, CUDA graphs, Transformer Engine layer specs
  and fusions, context parallelism (Transformer Engine attention), tensor-parallel
  communication overlap (userbuffers), activation offloading (CUDA streams), gradient
  accumulation fusion (an Apex CUDA extension), megatron FSDP and the precision-aware
  optimizer (Transformer Engine's fused Adam); and what the CPU layer spec cannot build:
  MoE layers with linear biases (megatron-core 0.19's local experts add the bias in place
  to a view). Sequence parallelism runs: the portable layer spec then uses norms that
  allow it (:class:`bridge.train.models.layer_specs.SequenceParallelTorchNorm`).
"""

from __future__ import annotations

from typing import Any

import torch

from bridge.config import (
    ConfigError,
    DDPConfigProtocol,
    ModelConfigProtocol,
    OptimizerConfigProtocol,
)

__all__ = ["check_engine_config", "check_pipeline_p2p"]


def check_pipeline_p2p(model_config: ModelConfigProtocol) -> None:
    """Refuse pipeline point-to-point settings that megatron-core runs wrongly or not at all.

    Args:
        model_config: The model config (``pipeline_model_parallel_size``,
            ``virtual_pipeline_model_parallel_size``, ``batch_p2p_comm``,
            ``overlap_p2p_comm``).

    Raises:
        ConfigError: See the module docstring; the message names the fields and the fix.
    """
    pp = int(getattr(model_config, "pipeline_model_parallel_size", None) or 1)
    vp = getattr(model_config, "virtual_pipeline_model_parallel_size", None)
    batched = bool(getattr(model_config, "batch_p2p_comm", False))
    overlap = bool(getattr(model_config, "overlap_p2p_comm", False))
    if pp < 2:
        return
    if overlap and batched:
        raise ConfigError(
            "model.overlap_p2p_comm",
            "overlap_p2p_comm=True and batch_p2p_comm=True exclude each other (megatron's "
            "schedule raises); set model.batch_p2p_comm=False to overlap p2p communication",
        )
    if vp is None:
        if overlap:
            raise ConfigError(
                "model.overlap_p2p_comm",
                "overlap_p2p_comm=True needs the interleaved schedule "
                "(model.virtual_pipeline_model_parallel_size); set overlap_p2p_comm=False",
            )
        return
    if pp == 2 and batched:
        raise ConfigError(
            "model.batch_p2p_comm",
            "batch_p2p_comm=True with pipeline_model_parallel_size=2 and "
            f"virtual_pipeline_model_parallel_size={vp} trains on swapped activations and "
            "gradients (both neighbours are the same rank and batched sends to it are matched "
            "in posting order); set model.overlap_p2p_comm=True and model.batch_p2p_comm=False "
            "(or only batch_p2p_comm=False)",
        )


# (field, value that is fine, why it cannot run on CPU) for the model config.
_CPU_UNSUPPORTED_MODEL_FIELDS: tuple[tuple[str, Any, str], ...] = (
    ("fp8", None, "fp8 needs Transformer Engine kernels on a GPU; set model.fp8=null on CPU"),
    ("fp4", None, "fp4 needs Transformer Engine kernels on a GPU; set model.fp4=null on CPU"),
    (
        "enable_cuda_graph",
        False,
        "CUDA graphs need a GPU; set model.enable_cuda_graph=false on CPU",
    ),
    (
        "external_cuda_graph",
        False,
        "CUDA graphs need a GPU; set model.external_cuda_graph=false on CPU",
    ),
    (
        "cuda_graph_impl",
        "none",
        "CUDA graphs need a GPU; set model.cuda_graph_impl='none' on CPU",
    ),
    (
        "gradient_accumulation_fusion",
        False,
        "it needs Apex's fused_weight_gradient_mlp_cuda extension (GPU); set "
        "model.gradient_accumulation_fusion=false on CPU",
    ),
    (
        "tp_comm_overlap",
        False,
        "tensor-parallel communication overlap needs Transformer Engine userbuffers on GPUs; "
        "set model.tp_comm_overlap=false on CPU",
    ),
    (
        "cpu_offloading",
        False,
        "activation offloading copies between GPU and host memory on CUDA streams; set "
        "model.cpu_offloading=false on CPU",
    ),
)


def _check_megatron_on_cpu(
    model_config: ModelConfigProtocol,
    ddp_config: DDPConfigProtocol | None,
    optimizer_config: OptimizerConfigProtocol | None,
) -> None:
    for name, fine, reason in _CPU_UNSUPPORTED_MODEL_FIELDS:
        value = getattr(model_config, name, fine)
        if value is not None and value != fine:
            raise ConfigError(f"model.{name}", f"got {value!r}: {reason}")
    cp = int(getattr(model_config, "context_parallel_size", None) or 1)
    if cp > 1:
        raise ConfigError(
            "model.context_parallel_size",
            f"got {cp}: context parallelism needs Transformer Engine attention on GPUs; set "
            "model.context_parallel_size=1 on CPU",
        )
    resolve = getattr(model_config, "resolved_layer_spec_backend", None)
    if callable(resolve) and getattr(model_config, "transformer_layer_spec", None) is None:
        try:
            resolve()
        except ValueError as exc:
            # "model.x='y' requires ..." -> "'y' requires ..." (the location is separate).
            head, sep, rest = str(exc).partition("=")
            detail = rest if sep and head.startswith("model.") and " " not in head else str(exc)
            raise ConfigError("model.layer_spec_backend", detail) from None
    if getattr(ddp_config, "use_megatron_fsdp", False):
        raise ConfigError(
            "ddp.use_megatron_fsdp",
            "megatron FSDP allocates its buffers on the GPU; set ddp.use_megatron_fsdp=false "
            "on CPU (optimizer.use_distributed_optimizer shards the optimizer state instead)",
        )
    if getattr(optimizer_config, "use_precision_aware_optimizer", False):
        raise ConfigError(
            "optimizer.use_precision_aware_optimizer",
            "it needs Transformer Engine's fused Adam on a GPU; set "
            "optimizer.use_precision_aware_optimizer=false on CPU",
        )
    if getattr(optimizer_config, "optimizer_cpu_offload", False):
        raise ConfigError(
            "optimizer.optimizer_cpu_offload",
            "offloading the optimizer from GPU to host needs a GPU; on CPU the optimizer "
            "already runs on the host: set optimizer.optimizer_cpu_offload=false",
        )


def check_engine_config(
    model_config: ModelConfigProtocol,
    ddp_config: DDPConfigProtocol | None = None,
    optimizer_config: OptimizerConfigProtocol | None = None,
    cuda_available: bool | None = None,
) -> None:
    """Refuse what the engine cannot run correctly on this machine (see the module docstring).

    Called by the launch checks (``bridge-train`` exits with code 2) before any process
    group, model or dataset exists; pure attribute reads, no collective.

    Args:
        model_config: The model config (``GPTModelProvider`` / megatron
            ``TransformerConfig``).
        ddp_config: The ``ddp`` section, if any.
        optimizer_config: The ``optimizer`` section, if any.
        cuda_available: Override CUDA detection (default ``torch.cuda.is_available()``).

    Raises:
        ConfigError: The first problem found; its location is the field to change.
    """
    check_pipeline_p2p(model_config)
    cuda = torch.cuda.is_available() if cuda_available is None else cuda_available
    if not cuda:
        _check_megatron_on_cpu(model_config, ddp_config, optimizer_config)
