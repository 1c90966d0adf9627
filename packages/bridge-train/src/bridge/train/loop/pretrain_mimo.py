"""The ``mimo`` recipe: a vision-language MIMO model trained with bridge.mimo's loop.

``bridge-train --recipe mimo`` trains bridge.mimo's tiny vision-language model (a patch
encoder feeding a megatron GPT) on synthetic image-caption pairs whose captions name the
image's class, so the caption loss can only fall below the *text-only floor* (printed at the
start) when the language model uses the encoder. The run is built from its sections as
:func:`~bridge.train.loop.pretrain.pretrain` builds a GPT run (resiliency, metric writers,
the loop's standard components, checkpoints), with bridge.mimo's
:class:`~bridge.mimo.MimoLogger` as the metrics component and its
:class:`~bridge.mimo.MimoStepFunction` run by :func:`core_utils.loop.run_loop`.

Where each module runs (``model.layout``) is :func:`bridge.train.models.mimo.mimo_layout`'s
decision (see :mod:`bridge.train.models.mimo`).

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
implement (evaluation, ``train.skip_train``, the weight-hash check) is refused by the
launch checks (:mod:`bridge.train.checks.mimo`, which says why) instead of being ignored.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

import bridge.mimo as mimo
from bridge.config import ConfigContainer, ConfigError
from bridge.logging import setup_logging
from bridge.train.checkpointing.layout import one_lookup_per_launch
from bridge.train.checks.preflight import check_config_before_launch
from bridge.train.engine.initialize import (
    resume_seed,
    seed_process_generators,
    start_process_group,
)
from bridge.train.engine.launch_env import adopt_launch_environment
from bridge.train.engine.scheduler import build_optimizer_param_scheduler
from bridge.train.loop.components import close_components, loop_callback_list, standard_components
from bridge.train.loop.mimo_checkpoint import MimoCheckpointModel
from bridge.train.loop.profiling import profile_trace_dir
from bridge.train.loop.progress_log import record_starting_job
from bridge.train.loop.run_ends import (
    build_run_metric_writers,
    checkpointing_context_for,
    load_run_checkpoint,
    run_teardown,
    run_teardown_steps,
)
from bridge.train.loop.saving import CheckpointWriter
from bridge.train.loop.training import RunComponents
from bridge.train.models.layout_init import layout_independent_seed
from bridge.train.models.mimo import MimoModelConfig, build_mimo_recipe_model, mimo_layout
from bridge.train.state import GlobalState
from core_utils.callbacks import Callback, CallbackList
from core_utils.loop import LoopContext, run_loop

__all__ = ["check_mimo_config", "pretrain_mimo"]


#: The ``mimo`` recipe's launch checks are the trainer's one pass (the pass knows the recipe
#: by its model config and runs the rules of :mod:`bridge.train.checks.mimo`).
check_mimo_config = check_config_before_launch


@one_lookup_per_launch()  # the checks and the load resume the same checkpoint
def pretrain_mimo(
    cfg: ConfigContainer,
    *,
    metrics_file: str | Path | None = None,
    start_time: float | None = None,
    callbacks: Sequence[Callback] = (),
    requeue_exit_code: int = 0,
) -> int:
    """Train the ``mimo`` recipe (every rank calls it; see the module docstring).

    Args:
        cfg: The recipe's config (checked by the launch checks' one pass).
        metrics_file: Also write every metric record as JSON lines (last rank).
        start_time: ``time.time()`` at which the job started, for
            ``train.exit_duration_in_mins`` (default: when this call starts).
        callbacks: Training-loop callbacks (:class:`bridge.train.Callback`), run after
            ``cfg.callbacks``, both after the loop's components and before the checkpointer
            (as for GPT); they see the loop's ``LoopContext`` (``model`` is
            ``[MimoCheckpointModel]``, ``optimizer`` the ``MultiModuleOptimizer``).
        requeue_exit_code: Returned instead of 0 when an exit condition (exit signal,
            duration, interval) ended the run before its last iteration, after saving, so
            that a batch script or Kubernetes can requeue or restart it (as for GPT).

    Returns:
        The exit code: 0 (or ``requeue_exit_code`` when an exit condition ended the run
        early), as for GPT.

    Raises:
        ConfigError: See :func:`~bridge.train.checks.preflight.check_config_before_launch`.
        CheckpointError: A checkpoint cannot be loaded or saved (see docs/checkpoints.md).
    """
    start_time = time.time() if start_time is None else start_time
    user_callbacks = [*cfg.callbacks, *callbacks]
    CallbackList((), user_callbacks)  # refuse a non-callback before anything is built
    adopt_launch_environment()  # srun's tasks: before anything reads the world size
    check_config_before_launch(cfg)
    train, logger_cfg, opt_cfg, checkpoint = cfg.train, cfg.logger, cfg.optimizer, cfg.checkpoint
    model_cfg = cfg.model
    assert train is not None and logger_cfg is not None and opt_cfg is not None
    assert checkpoint is not None and isinstance(model_cfg, MimoModelConfig)
    setup_logging(logger_cfg)
    # The device choice and the experimental flag are the GPT path's; the launch checks
    # refused the ``dist`` settings the recipe does not apply (bridge.train.checks.mimo).
    owns_group = start_process_group(cfg.dist)
    # The reference's state object, for the user's callbacks (LoopContext.state); the run's
    # parts are built from their sections and hold what they use.
    state = GlobalState(cfg=cfg, start_time=start_time)
    infra = step = None
    components: list[Callback] = []
    clean = False
    try:
        rank, world = dist.get_rank(), dist.get_world_size()
        resiliency = state.start_resiliency()
        seed = cfg.rng.seed
        seed_process_generators(seed)  # a resume restores or reseeds them (see the load)
        layout = mimo_layout(model_cfg, world)
        # The module groups wait as long as the default group (dist.distributed_timeout_minutes).
        infra = mimo.build_megatron_mimo_infra(
            layout, timeout=timedelta(minutes=cfg.dist.distributed_timeout_minutes)
        )
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
        model = build_mimo_recipe_model(
            model_cfg, infra, seed, layout_independent_seed(cfg.rng, model_cfg)
        )
        chunk = MimoCheckpointModel(model, layout)
        if dist.get_backend() == "nccl":
            # The step keeps batches where the process group's backend works: gloo -> CPU.
            model.cuda()
        lr = float(opt_cfg.lr or 0.0)  # the launch checks made sure it is set
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
        assert cfg.scheduler is not None  # a required section of the recipe
        scheduler = build_optimizer_param_scheduler(optimizer, opt_cfg, cfg.scheduler, train)
        checkpointing_context = checkpointing_context_for(checkpoint)

        def reseed(iteration: int) -> int:
            # The saved generators are other ranks' (another module layout): reseed from
            # (seed, iteration), reproducibly, rather than keep the fresh start's streams,
            # which a resume would then replay from their first draw on.
            seed_process_generators(resume_seed(seed, iteration))
            return seed

        loaded = load_run_checkpoint(
            checkpoint,
            state.train_state,
            [chunk],
            optimizer,
            scheduler,
            checkpointing_context,
            reseed=reseed,
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
        progress_log = RunComponents(state).progress_log  # as for GPT
        record_starting_job(progress_log, writers, state.train_state.step)
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
        if exit_code == 0 and context.iteration < train_iters:
            exit_code = requeue_exit_code  # stopped early on purpose, after saving
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
