"""``pretrain``: everything from a config to a trained, checkpointed model.

:func:`setup` builds the run in dependency order (config checked before any process group;
resiliency started before the checkpoint loads, so a signal arriving meanwhile is not lost;
datasets built after the load, so the iterators start at the loaded counters);
:func:`pretrain` trains, evaluates at the end and always closes, also after an error (async
saves finished, resiliency stopped, writers closed, megatron's globals released, process
group destroyed).
"""

from __future__ import annotations

import functools
import logging
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import yaml
from megatron.core import rerun_state_machine as rsm
from megatron.core.num_microbatches_calculator import destroy_num_microbatches_calculator
from megatron.core.rerun_state_machine import RerunDataIterator
from megatron.core.utils import get_model_config

from bridge.config import (
    CheckpointConfig,
    ConfigContainer,
    ModelConfigProtocol,
    TokenizerConfig,
    TokenizerConfigProtocol,
)
from bridge.logging import (
    BackendSettings,
    MetricWriters,
    ReportSettings,
    build_timers,
    scheduler_job,
    setup_logging,
    start_memory_history_recording,
)
from bridge.resiliency import RunResiliency, WatchdogTimeouts
from bridge.train.checkpointing.layout import one_lookup_per_launch
from bridge.train.checks.preflight import check_config_before_launch
from bridge.train.checks.resume import IDENTITY_SECTIONS, run_plan_notices
from bridge.train.checks.rules import vocabulary_is_known
from bridge.train.data.datasets import train_valid_test_num_samples
from bridge.train.data.loaders import build_train_valid_test_data_iterators
from bridge.train.data.tokenizers import NullTokenizer, Tokenizer, build_tokenizer
from bridge.train.data.validation_sets import ValidationSets
from bridge.train.engine.initialize import (
    destroy_distributed,
    seed_from_rng_config,
)
from bridge.train.engine.launch_env import adopt_launch_environment
from bridge.train.engine.megatron import Engine, build_engine
from bridge.train.loop.batch_size import ensure_num_microbatches_calculator
from bridge.train.loop.eval import Evaluation
from bridge.train.loop.progress_log import record_starting_job
from bridge.train.loop.run_config import save_run_config
from bridge.train.loop.run_ends import (
    build_run_metric_writers,
    checkpointing_context_for,
    load_run_checkpoint,
    run_teardown,
    run_teardown_steps,
)
from bridge.train.loop.run_length import run_is_done
from bridge.train.loop.step import data_parallel_size
from bridge.train.loop.training import RunComponents, run_training
from bridge.train.models.family import (
    build_family_datasets,
    default_forward_step,
    family_tokenizer,
)
from bridge.train.models.gpt_step import forward_step
from bridge.train.models.layout_init import layout_independent_seed
from bridge.train.peft.base import apply_peft
from bridge.train.state import ForwardStepCallable, GlobalState
from core_utils.callbacks import Callback, CallbackList
from core_utils.distributed import global_rank, global_world_size

__all__ = ["DatasetsFunction", "SetupOutput", "close_run", "final_evaluation", "pretrain", "setup"]

logger = logging.getLogger(__name__)


@dataclass
class SetupOutput:
    """What :func:`setup` built for :func:`bridge.train.train`.

    Attributes:
        state: The global state (config, counters, timers, writers, resiliency objects).
        engine: The engine the model was built with.
        model: Model chunks.
        optimizer: The megatron-contract optimizer.
        scheduler: megatron's ``OptimizerParamScheduler``.
        train_data_iterator: Training iterator (``None`` without a training split).
        valid_data_iterator: Validation iterator (``None`` without one).
        test_data_iterator: Test iterator (``None`` without one).
        checkpointing_context: The checkpointing context for save/load calls.
        tokenizer: The tokenizer the data and the model's vocabulary come from.
        checkpoint_loaded: Whether a checkpoint was loaded.
        datasets: ``(train, validation, test)`` datasets the iterators read.
    """

    state: GlobalState
    engine: Engine
    model: list[torch.nn.Module]
    optimizer: Any
    scheduler: Any
    train_data_iterator: Any = None
    valid_data_iterator: Any = None
    test_data_iterator: Any = None
    checkpointing_context: dict[str, Any] = field(default_factory=dict)
    tokenizer: Any = None
    checkpoint_loaded: bool = False
    datasets: tuple[Any, Any, Any] = (None, None, None)


#: Builds ``(train, validation, test)`` datasets from what :func:`setup` built before the
#: data (tokenizer, loaded train state), instead of the config's dataset section.
DatasetsFunction = Callable[[SetupOutput], tuple[Any, Any, Any]]


def _build_tokenizer(
    tokenizer_cfg: TokenizerConfig | TokenizerConfigProtocol | None,
    model: ModelConfigProtocol | None,
) -> Tokenizer:
    if tokenizer_cfg is not None and tokenizer_cfg.tokenizer_type is not None:
        return build_tokenizer(tokenizer_cfg)
    # The preflight refused an unknown vocabulary before launch; setup() may be called alone.
    vocabulary_is_known(tokenizer_cfg, model)
    return NullTokenizer(int(getattr(model, "vocab_size", 0)))


def _progress(message: str) -> None:
    """Rank 0 says which setup step starts: together they take 15-25 s before iteration 1
    on a CPU, and a silent terminal looks hung."""
    if global_rank() == 0:
        logger.info(message)


def setup(
    state: GlobalState,
    *,
    metrics_file: str | Path | None = None,
    hang_timeout: float | WatchdogTimeouts | None = None,
    backend_settings: BackendSettings | None = None,
    report_settings: ReportSettings | None = None,
    datasets: DatasetsFunction | None = None,
) -> SetupOutput:
    """Initialise distributed training and build everything :func:`train` needs (also
    megatron's micro-batch calculator, which :func:`bridge.train.train_step` reads; the
    caller releases it, as ``pretrain`` does when it closes).

    The config must have passed :func:`check_config_before_launch`. Objects are attached
    to ``state`` as soon as they exist, so a caller's ``finally`` can close them even when
    setup fails half-way.

    Args:
        state: The global state to fill; ``state.cfg`` is the validated config.
        metrics_file: Also write every metric to this JSON-lines file (last rank).
        hang_timeout: Seconds (or per-phase timeouts) after which the built-in hang watchdog
            kills a rank that makes no progress (for ``torchrun --max-restarts``).
        backend_settings: MLflow / Comet settings of bridge.logging.
        report_settings: Optional reports of bridge.logging (throughput window, runtime,
            per-layer gradient norms).
        datasets: Builds the datasets instead of ``cfg.dataset`` (called after the
            checkpoint is loaded, before the iterators are positioned at the train state's
            counters; evaluation-only runs use it).

    Returns:
        The built pieces.
    """
    cfg = state.cfg
    train, logger_cfg, checkpoint = cfg.train, cfg.logger, cfg.checkpoint
    assert train is not None and logger_cfg is not None and checkpoint is not None
    assert cfg.model is not None and cfg.optimizer is not None and cfg.scheduler is not None
    setup_logging(logger_cfg)
    start_memory_history_recording(cfg.profiling)
    engine = build_engine()
    state.engine = engine
    engine.initialize_distributed(cfg.model, cfg.dist, cfg.rng)
    world = global_world_size()
    cfg.validate(world)
    ensure_num_microbatches_calculator(train, data_parallel_size())  # released by the caller
    state.timers = build_timers(logger_cfg)

    resiliency = state.start_resiliency(hang_timeout)
    # The config as plain data for the backends' run parameters (never fails), with the
    # SLURM job (``slurm_job``) when there is one.
    plain = yaml.safe_load(cfg.format_yaml())
    plain = plain if isinstance(plain, dict) else {}
    job = scheduler_job()
    if job is not None:
        plain["slurm_job"] = job.run_parameters()
    state.metric_writers = build_run_metric_writers(
        logger_cfg,
        run_config=plain,
        metrics_file=metrics_file,
        backend_settings=backend_settings,
        report_settings=report_settings,
    )

    tokenizer = family_tokenizer(
        cfg.dataset, cfg.tokenizer, _build_tokenizer(cfg.tokenizer, cfg.model)
    )
    apply_tokenizer = getattr(cfg.model, "apply_tokenizer", None)
    if apply_tokenizer is not None:
        apply_tokenizer(tokenizer)
    _progress(f"building the model and optimizer ({type(cfg.model).__name__}, world size {world})")
    model = engine.setup_model(
        cfg.model,
        cfg.ddp,
        pre_wrap_hooks=[] if cfg.peft is None else [functools.partial(apply_peft, cfg.peft)],
        data_parallel_random_init=cfg.rng.data_parallel_random_init,
        optimizer_config=cfg.optimizer,
        layout_independent_seed=layout_independent_seed(cfg.rng, cfg.model),
        align_grad_reduce=cfg.dist.align_grad_reduce,
    )

    get_model_config(model[0]).timers = state.timers
    optimizer, scheduler = engine.setup_optimizer(model, cfg.optimizer, cfg.scheduler, train)
    rerun = cfg.rerun_state_machine
    rsm.destroy_rerun_state_machine()
    rsm.initialize_rerun_state_machine(
        mode=rsm.RerunMode(rerun.rerun_mode),
        error_injector=rsm.RerunErrorInjector(
            error_injection_rate=rerun.error_injection_rate,
            error_injection_type=rsm.RerunDiagnostic(rerun.error_injection_type),
        ),
    )

    out = SetupOutput(
        state=state,
        engine=engine,
        model=model,
        optimizer=optimizer,
        scheduler=scheduler,
        checkpointing_context=checkpointing_context_for(checkpoint),
        tokenizer=tokenizer,
    )

    def reseed(iteration: int) -> int:
        # The saved generators are per rank of another layout: reseed from (seed,
        # iteration) rather than leave this layout's fresh-start state, whose dropout masks
        # a resume would otherwise replay from its first step on.
        seed_from_rng_config(cfg.rng, iteration)
        return int(cfg.rng.seed)

    load_run_checkpoint(
        checkpoint,
        state.train_state,
        model,
        optimizer,
        scheduler,
        out.checkpointing_context,
        reseed=reseed,
        model_config=cfg.model,
        peft=cfg.peft,
    )
    out.checkpoint_loaded = out.checkpointing_context.get("loaded_checkpoint") is not None
    state.loaded_iteration = state.train_state.step
    state.job_start_flops = state.train_state.floating_point_operations_so_far

    assert cfg.dataset is not None
    _progress(f"loading the data ({type(cfg.dataset).__name__})")
    if datasets is None:
        out.datasets = build_family_datasets(
            cfg.model, cfg.dataset, tokenizer, train_valid_test_num_samples(train)
        )
    else:
        out.datasets = datasets(out)
    iterators = build_train_valid_test_data_iterators(
        out.datasets, cfg.dataset, train, state.train_state
    )

    out.train_data_iterator, out.valid_data_iterator, out.test_data_iterator = (
        _rerun_iterator(it) for it in iterators
    )
    resiliency.fault_tolerance.on_setup_end(checkpoint_loaded=out.checkpoint_loaded)
    return out


def _rerun_iterator(iterator: Any) -> Any:
    """megatron's ``RerunDataIterator`` around a split's iterator (around each separate
    validation set's)."""
    if iterator is None:
        return None
    if isinstance(iterator, ValidationSets):
        return iterator.wrapped(RerunDataIterator)
    return RerunDataIterator(iterator)


def final_evaluation(out: SetupOutput, evaluation: Evaluation) -> dict[str, dict[str, float]]:
    """Validation (unless this job's loop just validated this iteration) and test at the end,
    each when the run has that split; also the evaluation-only run's.

    Returns:
        ``{"validation": {loss name: value}, "test": {...}}`` for the splits evaluated;
        separate validation sets give ``"validation <name>"`` entries instead of
        ``"validation"``.
    """
    train_state = out.state.train_state
    step = train_state.step
    validated = out.state.last_evaluated_iteration == step
    splits = [
        ("validation", out.valid_data_iterator, train_state.do_valid and not validated),
        ("test", out.test_data_iterator, train_state.do_test),
    ]
    results: dict[str, dict[str, float]] = {}
    for split, iterator, wanted in splits:
        if not wanted or iterator is None:
            continue
        prefix = f"iteration {step} on {split} set"
        if isinstance(iterator, ValidationSets):
            results.update(evaluation.evaluate_sets_and_log(prefix, iterator, out.model))
        else:
            results[split] = evaluation.evaluate_and_log(prefix, iterator, out.model, split=split)
    return results


def close_run(
    checkpoint: CheckpointConfig | None,
    resiliency: RunResiliency,
    metric_writers: MetricWriters,
    clean: bool,
) -> None:
    """Release everything :func:`setup` started; never raises (errors are logged).

    Args: as :func:`bridge.train.loop.run_ends.run_teardown_steps`, which gives the first
    steps; megatron's globals and the process group are released last.
    """
    steps = run_teardown_steps(checkpoint, resiliency, metric_writers, clean=clean)
    steps += [
        ("releasing the rerun state machine", rsm.destroy_rerun_state_machine),
        ("releasing the micro-batch calculator", destroy_num_microbatches_calculator),
        ("destroying the process group", destroy_distributed),
    ]
    run_teardown(steps, "pretrain")


@one_lookup_per_launch()  # the checks and the load resume the same checkpoint
def pretrain(
    config: ConfigContainer,
    forward_step_func: ForwardStepCallable = forward_step,
    *,
    metrics_file: str | Path | None = None,
    hang_timeout: float | WatchdogTimeouts | None = None,
    backend_settings: BackendSettings | None = None,
    report_settings: ReportSettings | None = None,
    process_non_loss_data_func: Callable[..., Any] | None = None,
    non_loss_data_func: Callable[..., Any] | None = None,
    callbacks: Sequence[Callback] = (),
    requeue_exit_code: int = 0,
) -> int:
    """Train a model as ``config`` says, from scratch or from its last checkpoint.

    The config is checked before anything distributed exists
    (:func:`~bridge.train.checks.preflight.check_config_before_launch`); then :func:`setup`,
    :func:`bridge.train.train`, the validation and test evaluation at the end, and the close
    (see the module docstring), also when something fails. Every rank calls it (under
    ``torchrun``, or bare for one process).

    Args:
        config: The run's configuration (validated and completed in place).
        forward_step_func: ``(data_iterator, model)`` or ``(state, data_iterator, model)``
            returning ``(output, loss_func)``; default: the model family's step (GPT and
            Mamba: :func:`bridge.train.forward_step`; T5:
            :func:`bridge.train.models.t5_step.t5_forward_step`).
        metrics_file: Also write every metric to this JSON-lines file (last rank).
        hang_timeout: Seconds (or :class:`bridge.resiliency.WatchdogTimeouts`) after which
            the built-in watchdog kills a rank that stopped making progress, so that
            ``torchrun --max-restarts`` restarts the job.
        backend_settings: MLflow / Comet settings (bridge.logging).
        report_settings: Extra reports of bridge.logging.
        process_non_loss_data_func: See :func:`bridge.train.evaluate`.
        non_loss_data_func: See :func:`bridge.train.evaluate`.
        callbacks: Training-loop callbacks (:class:`bridge.train.Callback`), run after the
            loop's components and after ``config.callbacks``, in this order.
        requeue_exit_code: Returned instead of 0 when training stopped before its end on
            purpose (exit signal, ``train.exit_duration_in_mins``, ``train.exit_interval``)
            after saving a checkpoint, so that a batch script or Kubernetes can requeue or
            restart the job (``bridge-train --requeue-exit-code``; docs/clusters.md).

    Returns:
        The process exit code: 0 when training finished or stopped on purpose (signal,
        duration, interval; ``requeue_exit_code`` for the latter when given), else the
        rerun state machine's code.

    Raises:
        bridge.config.ConfigError: The config cannot run here (raised before any process
            group exists).
        TypeError: An entry of ``callbacks`` is not a :class:`bridge.train.Callback`.
        core_utils.CallbackError: A callback raised (names the callback, hook and iteration).
    """
    CallbackList((), callbacks)  # refuse a non-callback before anything is built
    adopt_launch_environment()  # srun's tasks: before anything reads the world size
    check_config_before_launch(config)
    if forward_step_func is forward_step:  # the default: the model family's own step
        forward_step_func = default_forward_step(config.model)
    state = GlobalState(cfg=config)
    clean = False
    try:
        out = setup(
            state,
            metrics_file=metrics_file,
            hang_timeout=hang_timeout,
            backend_settings=backend_settings,
            report_settings=report_settings,
        )
        assert config.train is not None and config.checkpoint is not None
        notices = run_plan_notices(
            config.checkpoint,
            config.train,
            {name: getattr(config, name) for name in IDENTITY_SECTIONS},
            loaded=out.checkpointing_context.get("loaded_checkpoint"),
            iteration=state.train_state.step,
            done=run_is_done(config.train, state.train_state),
            after_load=True,
        )
        for notice in notices if global_rank() == 0 else ():
            logger.warning(notice)  # nothing to train, unused pretrained weights
        components = RunComponents(
            state,
            forward_step_func,
            out.checkpointing_context,
            process_non_loss_data_func,
            non_loss_data_func,
            callbacks=callbacks,
            tokenizer=out.tokenizer,
        )
        record_starting_job(components.progress_log, state.metric_writers, state.train_state.step)
        save_run_config(config.checkpoint.save, config.to_yaml_text)
        exit_code = 0
        if not config.train.skip_train and not run_is_done(config.train, state.train_state):
            exit_code = run_training(
                components,
                out.model,
                out.optimizer,
                out.scheduler,
                out.train_data_iterator,
                out.valid_data_iterator,
            )
        if exit_code == 0 and (
            config.train.skip_train or run_is_done(config.train, state.train_state)
        ):
            final_evaluation(out, components.evaluation)
        elif exit_code == 0:
            exit_code = requeue_exit_code  # stopped early on purpose, after saving
        state.metric_writers.flush()
        clean = True
        return exit_code
    finally:
        close_run(config.checkpoint, state.resiliency, state.metric_writers, clean)
        sys.stdout.flush()
