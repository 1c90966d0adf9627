"""Evaluation-only runs: ``bridge-train --eval-only`` loads a checkpoint and reports its
validation and test loss and perplexity, without training.

:func:`prepare_eval_only` turns a run's config into an evaluation of its checkpoint;
:func:`evaluate_checkpoint` runs it through the trainer's own setup and evaluation
(:func:`bridge.train.evaluate_and_print_results`), so the numbers go to the console, the
metrics file and every configured logger.

Which data:

* the run's own datasets (its ``dataset`` section): ``train.eval_iters`` batches of the
  validation split and of the test split. The validation batches are the ones the run
  evaluated at the checkpoint's iteration (when it evaluated there, the evaluation's start
  is taken back from the saved ``consumed_valid_samples``; otherwise the run's next ones),
  so the loss equals the one the run logged at that iteration, bit for bit on the same
  layout;
* a file (``--eval-data``): an SFT JSONL, ``{"text": ...}`` JSON lines or a text file, every
  token once (:mod:`bridge.train.data.eval_file`).
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bridge.config import (
    CheckpointConfig,
    ConfigContainer,
    ConfigError,
    GPTDatasetConfig,
    LoggerConfig,
    TrainingConfig,
)
from bridge.train.checkpointing.architecture import saved_run_config
from bridge.train.checks.preflight import check_config_before_launch
from bridge.train.data.datasets import train_valid_test_num_samples
from bridge.train.data.eval_file import WholeBatches, build_eval_file_dataset
from bridge.train.loop.pretrain import close_run, final_evaluation, setup
from bridge.train.loop.pretrain_mimo import MimoModelConfig
from bridge.train.loop.training import RunComponents
from bridge.train.models.family import build_family_datasets, default_forward_step, is_t5
from bridge.train.state import GlobalState

__all__ = ["EvalOnlyPlan", "evaluate_checkpoint", "prepare_eval_only"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class EvalOnlyPlan:
    """What an evaluation-only run evaluates besides its config.

    Attributes:
        eval_data: The file to evaluate instead of the run's datasets (``None``: those).
        dataset_kwargs: The run's SFT rendering settings, for an SFT JSONL ``eval_data``.
    """

    eval_data: str | None = None
    dataset_kwargs: dict[str, Any] | None = None


def prepare_eval_only(cfg: ConfigContainer, *, eval_data: str | None = None) -> EvalOnlyPlan:
    """Make ``cfg`` (a run's config) an evaluation of its checkpoint, in place.

    Sets ``train.skip_train``; unsets ``checkpoint.save`` and the save intervals (an
    evaluation writes nothing into a checkpoint directory); loads the model alone
    (``checkpoint.load_optim`` and ``load_rng`` off: evaluation needs neither, and a layout
    other than the saved one can then load it); writes perplexities
    (``logger.log_validation_ppl_to_tensorboard``). With ``eval_data`` the dataset section
    becomes mock data that is never built (the file is evaluated instead), so the run's data
    files need not exist.

    Returns:
        The plan to pass to :func:`evaluate_checkpoint`.

    Raises:
        ConfigError: No checkpoint to evaluate (``checkpoint.load`` and
            ``checkpoint.pretrained_checkpoint`` unset), a MIMO run, or ``eval_data`` for a T5
            model or a file that does not exist.
    """

    checkpoint = cfg.checkpoint or CheckpointConfig()
    if not (checkpoint.load or checkpoint.pretrained_checkpoint):
        raise ConfigError(
            "checkpoint.load",
            "--eval-only evaluates a checkpoint: set checkpoint.load=DIR (a checkpoint "
            "directory or one of its iter_* directories)",
        )

    if isinstance(cfg.model, MimoModelConfig):
        raise ConfigError("--eval-only", "is not supported for MIMO runs")
    checkpoint.save = None
    checkpoint.save_interval = None
    checkpoint.non_persistent_save_interval = None
    checkpoint.load_optim = False
    checkpoint.load_rng = False
    cfg.checkpoint = checkpoint
    cfg.train = cfg.train or TrainingConfig()
    cfg.train.skip_train = True
    cfg.logger = cfg.logger or LoggerConfig()
    cfg.logger.log_validation_ppl_to_tensorboard = True
    if eval_data is None:
        return EvalOnlyPlan()

    if is_t5(cfg.model):
        raise ConfigError(
            "--eval-data",
            "evaluates causal language models (GPT, Mamba) on a file; a T5 model is evaluated "
            "on its own T5 datasets (drop --eval-data)",
        )
    if not Path(eval_data).is_file():
        raise ConfigError("--eval-data", f"{eval_data} does not exist")
    kwargs = getattr(cfg.dataset, "dataset_kwargs", None)
    seq_length = int(getattr(cfg.model, "seq_length", 0) or 0)
    cfg.dataset = GPTDatasetConfig(
        mock=True,
        sequence_length=seq_length,
        num_workers=0,
        pin_memory=False,
        dataloader_type="single",
        random_seed=1234,
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=False,
        create_attention_mask=False,
    )
    return EvalOnlyPlan(str(eval_data), kwargs)


def _validation_start(train_state: Any, saved_train: Any) -> int:
    """Where the run's validation at ``train_state.step`` began in the validation split.

    The run evaluated before it saved when the iteration is a multiple of
    ``eval_interval``: its ``consumed_valid_samples`` then already counts that evaluation's
    ``eval_iters x global_batch_size`` samples.
    """
    consumed = int(train_state.consumed_valid_samples)
    interval = getattr(saved_train, "eval_interval", None)
    per_evaluation = int(getattr(saved_train, "eval_iters", 0) or 0) * int(
        getattr(saved_train, "global_batch_size", 0) or 0
    )
    step = int(train_state.step)
    if interval and step > 0 and step % int(interval) == 0 and consumed >= per_evaluation:
        return consumed - per_evaluation
    return consumed


def evaluate_checkpoint(
    cfg: ConfigContainer,
    plan: EvalOnlyPlan | None = None,
    *,
    forward_step_func: Any = None,
    metrics_file: str | Path | None = None,
    backend_settings: Any = None,
    report_settings: Any = None,
) -> dict[str, dict[str, float]]:
    """Load the checkpoint of ``cfg`` (prepared by :func:`prepare_eval_only`) and evaluate it.

    Every rank calls it (one process, or under ``torchrun`` in any layout the checkpoint
    loads into). The results are printed by the last rank and written to the metric writers
    (``lm loss validation``, ``lm loss validation ppl``, ``lm loss test``, ...) at the
    checkpoint's iteration.

    Args:
        cfg: The prepared config.
        plan: What :func:`prepare_eval_only` returned (default: the run's datasets).
        forward_step_func: The forward step (default: the model family's).
        metrics_file: Also write the metrics to this JSON-lines file (last rank).
        backend_settings: MLflow / Comet settings of bridge.logging.
        report_settings: Optional reports of bridge.logging.

    Returns:
        ``{"validation": {loss name: value}, "test": {...}}`` for the splits evaluated.

    Raises:
        ConfigError: The config cannot run, or no checkpoint was found to load.
    """

    check_config_before_launch(cfg)
    train = cfg.train
    assert train is not None  # prepare_eval_only sets it
    plan = plan or EvalOnlyPlan()
    step_func = forward_step_func or default_forward_step(cfg.model)
    state = GlobalState(cfg=cfg)

    def datasets(out: Any) -> tuple[Any, Any, Any]:
        """The run's own validation and test splits, or ``plan.eval_data``."""
        gbs = int(train.global_batch_size or 1)
        if plan.eval_data is None:
            # The saved run's evaluation settings say where its validation began.
            saved = train
            loaded = out.checkpointing_context.get("loaded_checkpoint")
            if loaded is not None:
                with contextlib.suppress(ConfigError, OSError, ValueError):
                    saved_run = saved_run_config(loaded)
                    saved = (saved_run.train if saved_run is not None else None) or train
            state.train_state.consumed_valid_samples = _validation_start(state.train_state, saved)
            try:
                sizes = train_valid_test_num_samples(train)
            except ValueError:  # no training length: only evaluation needs samples
                sizes = (0, int(train.eval_iters or 0) * gbs, int(train.eval_iters or 0) * gbs)
            return build_family_datasets(cfg.model, cfg.dataset, out.tokenizer, sizes)
        try:
            file_dataset = build_eval_file_dataset(
                plan.eval_data,
                out.tokenizer,
                int(getattr(cfg.model, "seq_length", 0)),
                dataset_kwargs=plan.dataset_kwargs,
            )
        except ValueError as exc:
            raise ConfigError("--eval-data", str(exc)) from None
        padded = WholeBatches(file_dataset, gbs)
        train.eval_iters = len(padded) // gbs
        state.train_state.consumed_valid_samples = 0
        logger.info(
            "evaluating %s: %d samples in %d global batches",
            plan.eval_data,
            len(file_dataset),
            train.eval_iters,
        )
        return None, padded, None

    clean = False
    try:
        out = setup(
            state,
            metrics_file=metrics_file,
            backend_settings=backend_settings,
            report_settings=report_settings,
            datasets=datasets,
        )
        if not out.checkpoint_loaded:
            raise ConfigError(
                "checkpoint.load",
                f"{cfg.checkpoint.load if cfg.checkpoint else None} holds no checkpoint to "
                "evaluate",
            )
        results = final_evaluation(out, RunComponents(state, step_func).evaluation)
        if not results:
            raise ConfigError(
                "train.eval_iters",
                "the run has no validation or test data to evaluate (set train.eval_iters > 0 "
                "and a dataset with a validation or test split, or pass --eval-data FILE)",
            )
        state.metric_writers.flush()
        clean = True
        return results
    finally:
        close_run(cfg.checkpoint, state.resiliency, state.metric_writers, clean)
