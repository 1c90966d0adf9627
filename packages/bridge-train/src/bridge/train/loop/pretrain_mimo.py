"""The ``mimo`` recipe: a vision-language MIMO model trained with bridge.mimo's loop.

``bridge-train --recipe mimo`` trains bridge.mimo's tiny vision-language model (a patch
encoder feeding a megatron GPT) on synthetic image-caption pairs whose captions name the
image's class, so the caption loss can only fall below the *text-only floor* (printed at the
start) when the language model uses the encoder. The run is built the way
:func:`~bridge.train.loop.pretrain.pretrain` builds a GPT run: resiliency from its sections
(:class:`bridge.resiliency.RunResiliency`), metric writers from ``logger``, the loop's
components from their sections (:func:`~bridge.train.loop.components.standard_components`)
with bridge.mimo's :class:`~bridge.mimo.MimoLogger` as the metrics component (console line,
TensorBoard / W&B / ... metric writers, ``--metrics-file``) and
:class:`~bridge.train.loop.saving.CheckpointWriter` as the save, and bridge.mimo's
:class:`~bridge.mimo.MimoStepFunction` run by the stack's one loop,
:func:`core_utils.loop.run_loop`.

Where each module runs (``model.layout``):

* ``auto`` (default): one rank: both modules colocated; an even number ``W >= 2`` of ranks:
  the vision encoder data-parallel on ranks ``0 .. W/2-1`` and the language model on ranks
  ``W/2 .. W-1`` (tensor parallel 2 when ``model.language_parallel=tp`` and ``W/2`` is even,
  else data parallel);
* ``colocated``: both modules on every rank, data parallel over all of them;
* ``split``: the non-colocated layout above (needs an even world size).

The cross-module data path (``model.communicator``) is ``auto`` by default: megatron-core's
BridgeCommunicator when the job runs on CUDA and the layout fits it, torch.distributed
point-to-point otherwise; the choice is printed at the start.

The ``train``, ``optimizer`` (AdamW: ``lr``, ``weight_decay``, ``adam_beta1/2``,
``adam_eps``, ``clip_grad``), ``scheduler``, ``logger``, ``rng``, ``dist`` and
``checkpoint``, ``profiling``, ``ft``, ``straggler`` and ``nvrx_straggler`` sections work as
for the GPT recipes: checkpoints are saved and resumed with bridge-train's checkpoint
functions (see :mod:`bridge.train.loop.mimo_checkpoint`), ``train.exit_interval`` /
``train.exit_duration_in_mins`` / ``train.exit_signal_handler`` end the run early (saving
first when ``checkpoint.save`` is set) as they do there. What this recipe does not
implement is refused by :func:`check_mimo_config` instead of being ignored: evaluation
(``train.eval_interval`` with ``train.eval_iters > 0``: the synthetic data has no
validation split), ``train.skip_train`` and the weight-hash check across data-parallel
replicas (``train.check_weight_hash_across_dp_replicas_interval``: MIMO modules have their
own data-parallel groups, which megatron's check does not know).
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, Literal

import torch

from bridge.config import ConfigContainer, ConfigError, DistributedInitConfig
from core_utils.callbacks import Callback
from core_utils.distributed import global_world_size

__all__ = ["MimoModelConfig", "check_mimo_config", "mimo_layout", "pretrain_mimo"]


@dataclass(kw_only=True)
class MimoModelConfig:
    """Model and layout of the ``mimo`` recipe (satisfies ``ModelConfigProtocol``).

    The protocol's sizes (``num_layers``, ``hidden_size``, ``num_attention_heads``,
    ``seq_length``) describe the language model. Per-module parallelism comes from
    ``layout`` / ``language_parallel``; the container-wide parallel sizes must stay 1.
    """

    num_layers: int = 2
    """Language-model transformer layers."""

    hidden_size: int = 64
    """Language-model width."""

    num_attention_heads: int = 4
    """Language-model attention heads."""

    seq_length: int = 24
    """Language-model sequence length (image tokens plus caption)."""

    vocab_size: int = 32
    """Language-model vocabulary size."""

    encoder_hidden_size: int = 64
    """Vision-encoder width."""

    encoder_layers: int = 2
    """Vision-encoder transformer layers."""

    encoder_heads: int = 4
    """Vision-encoder attention heads."""

    image_size: int = 16
    """Side of the square synthetic images."""

    patch_size: int = 4
    """Side of a patch (one image token per patch)."""

    channels: int = 3
    """Image channels."""

    num_classes: int = 8
    """Image classes of the synthetic data (each has a two-token name in the caption)."""

    num_samples: int = 4096
    """Size of the synthetic dataset (epochs are reshuffled)."""

    layout: Literal["auto", "colocated", "split"] = "auto"
    """Where the modules run (see the module docstring)."""

    language_parallel: Literal["tp", "dp"] = "tp"
    """Parallelism of the language model in the split layout: tensor parallel 2 (when its
    rank count is even) or data parallel."""

    communicator: Literal["auto", "p2p", "megatron"] = "auto"
    """Cross-module data path: ``auto`` (megatron-core's BridgeCommunicator when the job runs
    on CUDA and the layout fits it, else ``p2p``), ``p2p`` (torch.distributed point-to-point;
    CPU and GPU) or ``megatron`` (megatron-core's; CUDA only)."""

    tensor_model_parallel_size: int = 1
    """Must be 1: per-module tensor parallelism comes from ``language_parallel``."""

    pipeline_model_parallel_size: int = 1
    """Must be 1 (bridge.mimo does not pipeline)."""

    virtual_pipeline_model_parallel_size: int | None = None
    """Must be unset."""

    context_parallel_size: int = 1
    """Must be 1."""

    expert_model_parallel_size: int = 1
    """Must be 1."""

    params_dtype: torch.dtype = torch.float32
    """Parameter dtype (fp32; the tiny VLM is trained in full precision)."""

    bf16: bool = False
    """Must be false."""

    fp16: bool = False
    """Must be false."""

    def __post_init__(self) -> None:
        """Check the sizes and that the container-wide parallel settings are unused."""
        for name in (
            "num_layers",
            "hidden_size",
            "num_attention_heads",
            "seq_length",
            "vocab_size",
            "encoder_hidden_size",
            "encoder_layers",
            "encoder_heads",
            "image_size",
            "patch_size",
            "channels",
            "num_classes",
            "num_samples",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"model.{name} must be a positive integer, got {value!r}")
        for name in (
            "tensor_model_parallel_size",
            "pipeline_model_parallel_size",
            "context_parallel_size",
            "expert_model_parallel_size",
        ):
            if getattr(self, name) != 1:
                raise ValueError(
                    f"model.{name}={getattr(self, name)}: the mimo recipe sets parallelism per "
                    "module; use model.layout and model.language_parallel instead"
                )
        if self.virtual_pipeline_model_parallel_size is not None:
            raise ValueError("model.virtual_pipeline_model_parallel_size must be unset")
        if self.bf16 or self.fp16 or self.params_dtype != torch.float32:
            raise ValueError("the mimo recipe trains in fp32: unset model.bf16 / model.fp16")
        if self.image_size % self.patch_size:
            raise ValueError(
                f"model.image_size={self.image_size} is not a multiple of "
                f"model.patch_size={self.patch_size}"
            )

    def tiny_vlm_config(self) -> Any:
        """bridge.mimo's ``TinyVLMConfig`` with these sizes."""
        import bridge.mimo as mimo

        return mimo.TinyVLMConfig(
            vocab_size=self.vocab_size,
            seq_length=self.seq_length,
            language_hidden_size=self.hidden_size,
            language_layers=self.num_layers,
            language_heads=self.num_attention_heads,
            encoder_hidden_size=self.encoder_hidden_size,
            encoder_layers=self.encoder_layers,
            encoder_heads=self.encoder_heads,
            image_size=self.image_size,
            patch_size=self.patch_size,
            channels=self.channels,
        )


def mimo_layout(model: MimoModelConfig, world_size: int) -> Any:
    """The ``bridge.mimo.MimoLayout`` of ``model.layout`` for ``world_size`` ranks.

    Raises:
        ConfigError: The layout cannot be built for this world size.
    """
    import bridge.mimo as mimo

    kind = model.layout
    if kind == "auto":
        kind = "colocated" if world_size == 1 else "split"
    if kind == "colocated":
        ranks = range(world_size)
        return mimo.MimoLayout(
            {
                "vision": mimo.ModulePlacement(ranks=ranks, dp=world_size),
                "language": mimo.ModulePlacement(ranks=ranks, dp=world_size),
            }
        )
    if world_size < 2 or world_size % 2:
        raise ConfigError(
            "model.layout",
            f"the split layout puts the encoder and the language model on half of the ranks "
            f"each and needs an even world size >= 2, got {world_size}; use "
            "model.layout=colocated or launch an even number of ranks",
        )
    half = world_size // 2
    tp = 2 if model.language_parallel == "tp" and half % 2 == 0 else 1
    return mimo.MimoLayout(
        {
            "vision": mimo.ModulePlacement(ranks=range(0, half), dp=half),
            "language": mimo.ModulePlacement(ranks=range(half, world_size), tp=tp),
        }
    )


def _refuse_unsupported_train_settings(cfg: ConfigContainer) -> None:
    """Refuse ``train`` settings the mimo loop does not implement (never ignore them)."""
    train = cfg.train
    assert train is not None
    if train.eval_interval is not None and train.eval_iters > 0:
        raise ConfigError(
            "train.eval_interval",
            f"got {train.eval_interval} with train.eval_iters={train.eval_iters}; the MIMO "
            "recipe does not support evaluation: set train.eval_interval=null (or "
            "train.eval_iters=0)",
        )
    if train.skip_train:
        raise ConfigError(
            "train.skip_train",
            "got true; the MIMO recipe does not support it (it only trains): set "
            "train.skip_train=false",
        )
    interval = train.check_weight_hash_across_dp_replicas_interval
    if interval:
        raise ConfigError(
            "train.check_weight_hash_across_dp_replicas_interval",
            f"got {interval}; the MIMO recipe's modules have data-parallel groups of their "
            "own, which megatron's weight-hash check does not know: unset it",
        )


def check_mimo_config(cfg: ConfigContainer, world_size: int | None = None) -> None:
    """Check a ``mimo`` recipe config before anything distributed starts.

    Raises:
        ConfigError: A missing section or length, evaluation or ``skip_train`` (not
            supported by this recipe), an unsupported checkpoint setting, batch sizes that
            do not fit the layout, or a layout that does not fit the world.
    """
    for name in ("train", "optimizer", "scheduler", "logger", "checkpoint"):
        if getattr(cfg, name) is None:
            raise ConfigError(name, "required section is missing")
    assert cfg.train is not None and cfg.checkpoint is not None and cfg.optimizer is not None
    if not isinstance(cfg.model, MimoModelConfig):
        raise ConfigError(
            "model._target_",
            "the mimo recipe needs bridge.train.loop.pretrain_mimo.MimoModelConfig",
        )
    if cfg.train.train_iters is None or cfg.train.train_iters < 1:
        raise ConfigError("train.train_iters", "set how many iterations to train (>= 1)")
    gbs, mbs = cfg.train.global_batch_size, cfg.train.micro_batch_size
    if gbs is None or mbs is None:
        raise ConfigError(
            "train.global_batch_size",
            "the mimo recipe needs train.global_batch_size and train.micro_batch_size (both "
            "count samples over all replicas of a module)",
        )
    from bridge.train.checkpointing.context import check_checkpoint_config

    check_checkpoint_config(cfg.checkpoint)
    _refuse_unsupported_train_settings(cfg)
    if cfg.optimizer.lr is None:
        raise ConfigError("optimizer.lr", "is required")
    world = world_size if world_size is not None else global_world_size(launcher_fallback=True)
    layout = mimo_layout(cfg.model, world)
    try:
        layout.validate(world)
        layout.validate_batch_sizes(gbs, mbs)
        cfg.model.tiny_vlm_config()
    except ValueError as exc:
        raise ConfigError("train", str(exc)) from None
    from bridge.train.engine.initialize import resolve_distributed_backend
    from bridge.train.engine.scheduler import scheduler_steps

    try:
        scheduler_steps(cfg.scheduler, cfg.train)
    except ValueError as exc:
        raise ConfigError("scheduler", str(exc).removeprefix("scheduler: ")) from None
    try:
        resolve_distributed_backend(cfg.dist)
    except ValueError as exc:
        raise ConfigError("dist.distributed_backend", str(exc)) from None


def _init_process_group(dist_config: DistributedInitConfig) -> bool:
    """Initialise torch.distributed (restart-safe); True if this call created it."""
    import torch.distributed as dist

    if dist.is_initialized():
        return False
    from bridge.resiliency import init_process_group
    from bridge.train.engine.initialize import resolve_distributed_backend

    backend = resolve_distributed_backend(dist_config)
    timeout = timedelta(minutes=dist_config.distributed_timeout_minutes)
    if "MASTER_ADDR" not in os.environ:
        from core_utils.testing import find_free_port

        dist.init_process_group(
            backend,
            init_method=f"tcp://127.0.0.1:{find_free_port()}",
            rank=0,
            world_size=1,
            timeout=timeout,
        )
    else:
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        init_process_group(backend, timeout=timeout)
    return True


def pretrain_mimo(
    cfg: ConfigContainer,
    *,
    metrics_file: str | Path | None = None,
    start_time: float | None = None,
    callbacks: Sequence[Callback] = (),
) -> int:
    """Train the ``mimo`` recipe (every rank calls it; see the module docstring).

    Args:
        cfg: The recipe's config (checked by :func:`check_mimo_config`).
        metrics_file: Also write every metric record as JSON lines (last rank).
        start_time: ``time.time()`` at which the job started, for
            ``train.exit_duration_in_mins`` (default: when this call starts).
        callbacks: Training-loop callbacks (:class:`bridge.train.Callback`), run after
            ``cfg.callbacks``, both after the loop's components and before the checkpointer
            (as for GPT); they see the loop's ``LoopContext`` (``model`` is
            ``[MimoCheckpointModel]``, ``optimizer`` the ``MultiModuleOptimizer``).

    Returns:
        The exit code: 0, also after an exit condition (exit signal, duration, interval)
        ended the run, as for GPT.

    Raises:
        ConfigError: See :func:`check_mimo_config`.
        CheckpointError: A checkpoint cannot be loaded or saved (see docs/checkpoints.md).
    """
    import torch.distributed as dist

    import bridge.mimo as mimo
    from bridge.logging import setup_logging
    from bridge.resiliency import RunResiliency
    from bridge.train.engine.scheduler import build_optimizer_param_scheduler
    from bridge.train.loop.components import (
        close_components,
        loop_callback_list,
        standard_components,
    )
    from bridge.train.loop.mimo_checkpoint import MimoCheckpointModel, load_mimo_checkpoint
    from bridge.train.loop.profiling import profile_trace_dir
    from bridge.train.loop.progress_log import ProgressLog
    from bridge.train.loop.run_ends import (
        build_run_metric_writers,
        checkpointing_context_for,
        run_teardown,
        run_teardown_steps,
    )
    from bridge.train.loop.saving import CheckpointWriter
    from bridge.train.state import GlobalState
    from core_utils.callbacks import CallbackList
    from core_utils.loop import LoopContext, run_loop

    start_time = time.time() if start_time is None else start_time
    user_callbacks = [*cfg.callbacks, *callbacks]
    CallbackList((), user_callbacks)  # refuse a non-callback before anything is built
    check_mimo_config(cfg)
    train, logger_cfg, opt_cfg, checkpoint = cfg.train, cfg.logger, cfg.optimizer, cfg.checkpoint
    model_cfg = cfg.model
    assert train is not None and logger_cfg is not None and opt_cfg is not None
    assert checkpoint is not None and isinstance(model_cfg, MimoModelConfig)
    setup_logging(logger_cfg)
    owns_group = _init_process_group(cfg.dist)
    # The reference's state object, for the user's callbacks (LoopContext.state); the run's
    # parts are built from their sections and hold what they use.
    state = GlobalState(cfg=cfg, start_time=start_time)
    infra = step = None
    components: list[Callback] = []
    clean = False
    try:
        rank, world = dist.get_rank(), dist.get_world_size()
        resiliency = RunResiliency.build(
            ft=cfg.ft,
            straggler=cfg.straggler,
            nvrx_straggler=cfg.nvrx_straggler,
            train=train,
            checkpoint_dir=checkpoint.save,
            async_save=checkpoint.async_save,
            start_time=start_time,
        )
        state.adopt_resiliency(resiliency)
        resiliency.start_setup()
        seed = cfg.rng.seed
        torch.manual_seed(seed)
        layout = mimo_layout(model_cfg, world)
        infra = mimo.build_megatron_mimo_infra(layout)
        vlm = model_cfg.tiny_vlm_config()
        dataset = mimo.SyntheticImageCaptionDataset(
            model_cfg.num_samples,
            image_tokens=vlm.image_tokens,
            seq_length=vlm.seq_length,
            num_classes=model_cfg.num_classes,
            image_size=vlm.image_size,
            channels=vlm.channels,
            seed=seed,
        )
        if dataset.vocab_size > vlm.vocab_size:
            raise ConfigError(
                "model.vocab_size",
                f"got {vlm.vocab_size}; the synthetic captions need {dataset.vocab_size} ids",
            )
        model = mimo.build_mimo_model(infra, init_seed=seed, **mimo.tiny_vlm_specs(vlm, infra))
        if dist.get_backend() == "nccl":
            # The step keeps batches where the process group's backend works: gloo -> CPU.
            model.cuda()
        lr = float(opt_cfg.lr or 0.0)  # check_mimo_config made sure it is set
        optimizer = mimo.build_multimodule_optimizer(
            model,
            infra,
            lambda name, params: torch.optim.AdamW(
                params,
                lr=lr,
                weight_decay=opt_cfg.weight_decay,
                betas=(opt_cfg.adam_beta1, opt_cfg.adam_beta2),
                eps=opt_cfg.adam_eps,
            ),
            clip_grad=opt_cfg.clip_grad,
        )
        scheduler = build_optimizer_param_scheduler(optimizer, opt_cfg, cfg.scheduler, train)
        chunk = MimoCheckpointModel(model, layout)
        checkpointing_context = checkpointing_context_for(checkpoint)
        loaded = 0
        if checkpointing_context:
            loaded = load_mimo_checkpoint(
                checkpoint,
                state.train_state,
                chunk,
                optimizer,
                scheduler,
                checkpointing_context,
                model_config=model_cfg,
            )
        state.loaded_iteration = loaded
        state.job_start_flops = state.train_state.floating_point_operations_so_far
        resiliency.fault_tolerance.on_setup_end(checkpoint_loaded=loaded > 0)
        gbs, mbs = int(train.global_batch_size or 0), int(train.micro_batch_size or 0)
        step = mimo.MimoTrainStep(
            model,
            infra,
            optimizer,
            global_batch_size=gbs,
            micro_batch_size=mbs,
            communicator=model_cfg.communicator,
        )
        # A resumed run continues the sample order where the checkpoint left it.
        data = mimo.MimoDataLoader.for_infra(
            dataset,
            infra,
            global_batch_size=gbs,
            micro_batch_size=mbs,
            seed=seed,
            consumed_samples=state.train_state.consumed_train_samples,
        )
        last = rank == world - 1
        state.metric_writers = build_run_metric_writers(logger_cfg, metrics_file=metrics_file)
        if rank == 0:
            print(
                f"[bridge-train] mimo layout: {layout}\n[bridge-train] mimo communicator: "
                f"{step.communicator_choice.describe()}\n[bridge-train] text-only loss floor "
                f"(a model ignoring the images): {dataset.text_only_loss_floor():.4f}",
                flush=True,
            )
            if loaded:
                print(
                    f"[bridge-train] mimo: resumed at iteration {loaded} (consumed samples "
                    f"{data.consumed_samples})",
                    flush=True,
                )
        writers = state.metric_writers

        def log(record: mimo.MimoLogRecord) -> None:
            if last:
                print(record.format(), flush=True)
            writers.log_metrics(record.as_metrics(), record.iteration)

        train_iters = int(train.train_iters or 0)
        progress_log = ProgressLog.from_config(
            logger_cfg,
            checkpoint,
            seq_length=model_cfg.seq_length,
            start_time=start_time,
            job_start_flops=state.job_start_flops,
        )
        if progress_log is not None:
            progress_log.starting_job()
        step_function = mimo.MimoStepFunction(step, data, scheduler)
        components = standard_components(
            metrics=mimo.MimoLogger(step_function, log, logger_cfg.log_interval, train_iters),
            train=train,
            log_interval=logger_cfg.log_interval,
            checkpoint=checkpoint,
            save=CheckpointWriter(
                checkpoint,
                cfg,
                checkpointing_context,
                metric_writers=writers,
                fault_tolerance=resiliency.fault_tolerance,
                progress_log=progress_log,
            ),
            resiliency=resiliency,
            profiling=cfg.profiling,
            profile_trace_dir=profile_trace_dir(logger_cfg, checkpoint),
        )
        context = LoopContext(
            state.train_state,
            [chunk],
            optimizer,
            scheduler,
            data,
            callbacks=loop_callback_list(components, user_callbacks),
            state=state,
        )
        exit_code = run_loop(context, step_function, lambda c: c.iteration >= train_iters)
        # The loop's Checkpointer printed why it stopped early (rank 0).
        if last and step_function.losses:
            print(
                f"[bridge-train] mimo: {context.iteration} iterations, final loss "
                f"{step_function.losses[-1]:.4f} (text-only floor "
                f"{dataset.text_only_loss_floor():.4f})",
                flush=True,
            )
        writers.flush()
        clean = exit_code == 0
        return exit_code
    finally:
        close_components(components)
        run_teardown(
            run_teardown_steps(checkpoint, state.resiliency, state.metric_writers, clean=clean),
            "mimo",
        )
        if step is not None:
            step.close()
        if infra is not None:
            infra.destroy()
        if owns_group and dist.is_initialized():
            dist.destroy_process_group()
