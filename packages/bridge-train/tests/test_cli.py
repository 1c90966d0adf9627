"""The ``bridge-train`` command: help, bad input, the default run, the mimo recipe.

Bad input goes through ``bridge.train.cli.main`` in this process (it fails before anything
distributed starts) and once through the real console script, to see the exit code and
that no traceback is printed. The default recipe runs once as a subprocess, shortened by
overrides; the mimo recipe runs on one forked rank.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from bridge.config import ConfigContainer
from bridge.train.cli import EXIT_CONFIG_ERROR, main, run
from bridge.train.metrics import read_metrics_file
from bridge.train.recipes import RECIPES, recipe_path
from core_utils.testing import run_distributed


def _console_script() -> list[str]:
    script = Path(sys.executable).with_name("bridge-train")
    return [str(script)] if script.exists() else [sys.executable, "-m", "bridge.train"]


def _fails_with(capsys: pytest.CaptureFixture[str], argv: list[str]) -> str:
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == EXIT_CONFIG_ERROR
    err = capsys.readouterr().err
    assert err.startswith("bridge-train: error: ") and "Traceback" not in err
    assert err.count("\n") == 1, err  # one line
    return err


def test_hang_timeout_options(capsys: pytest.CaptureFixture[str]) -> None:
    from bridge.resiliency import WatchdogTimeouts
    from bridge.train.cli import _hang_timeouts, build_parser

    parser = build_parser()

    def timeouts(*argv: str) -> object:
        return _hang_timeouts(parser.parse_intermixed_args(list(argv)), parser)

    assert timeouts() is None
    assert timeouts("--hang-timeout", "30") == 30.0
    assert timeouts(
        "--hang-timeout", "30", "--hang-setup-timeout", "600", "--hang-checkpoint-timeout", "90"
    ) == WatchdogTimeouts(step=30.0, setup=600.0, checkpointing=90.0)
    for argv, message in [
        (["--hang-setup-timeout", "5"], "--hang-setup-timeout needs --hang-timeout"),
        (["--hang-timeout", "0"], "expected a number of seconds > 0, got '0'"),
        (["--hang-timeout", "soon"], "expected a number of seconds, got 'soon'"),
        (["--eval-data", "x.jsonl"], "--eval-data needs --eval-only"),
        (["--eval-only", "checkpoint.load=/no/such/run"], "error: checkpoint.load: "),
    ]:
        with pytest.raises(SystemExit) as info:
            main(argv)
        assert info.value.code == 2
        assert message in capsys.readouterr().err


def test_help_lists_recipes_and_sections(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    for name in RECIPES:
        assert f"  {name} " in out
    for section in ("train", "model", "optimizer", "dataset", "checkpoint", "logger", "ft"):
        assert f"\n  {section} " in out
    assert "section.field=value" in out and "torchrun --nproc_per_node=2" in out


def test_recipes_load_and_validate() -> None:
    for name in ("tiny_gpt", "text_corpus", "tiny_hybrid", "tiny_t5"):
        cfg = ConfigContainer.from_yaml(recipe_path(name))
        cfg.validate(world_size=1)
        assert cfg.dist.distributed_backend == "gloo"  # CPU recipes say so explicitly


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (
            ["--recipe", "text_corpus", "dataset.blend=[[/no/such/corpus],null]"],
            "dataset.blend: dataset '/no/such/corpus' has no /no/such/corpus.bin",
        ),
        (
            ["model.tensor_model_parallel_size=3"],
            "model.tensor_model_parallel_size=3 does not divide model.num_attention_heads=4",
        ),
        (["profiling.use_nsys_profiler=true"], "profiling.use_nsys_profiler: "),
        (
            ["rerun_state_machine.rerun_mode=validate_results"],
            "rerun_state_machine.rerun_mode: 'validate_results' requires CUDA",
        ),
        (["--recipe", "tiny"], "--recipe: unknown recipe 'tiny'"),
        (["trian.train_iters=5"], "Did you mean 'train'?"),
        (["dist.distributed_backend=nccl"], "nccl' requires CUDA"),
        (
            # No tokenizer and no model.vocab_size: mock data has no vocabulary to draw from.
            ["tokenizer.tokenizer_type=null", "tokenizer.vocab_size=null"],
            "tokenizer.tokenizer_type: is not set and model.vocab_size is unknown; configure a "
            "tokenizer (e.g. tokenizer_type: ByteLevelTokenizer) or set model.vocab_size",
        ),
    ],
)
def test_bad_input_is_one_line_and_exit_code_2(
    capsys: pytest.CaptureFixture[str], argv: list[str], expected: str
) -> None:
    assert expected in _fails_with(capsys, ["--no-print-config", *argv])


def test_checkpoint_directory_holding_something_else(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    (tmp_path / "notes.txt").write_text("my notes")
    err = _fails_with(capsys, [f"checkpoint.save={tmp_path}"])
    assert "checkpoint.save: " in err and "notes.txt" in err
    assert (tmp_path / "notes.txt").read_text() == "my notes"  # untouched
    (tmp_path / "notes.txt").unlink()
    (tmp_path / "foreign").write_text("x")
    err = _fails_with(capsys, [f"checkpoint.load={tmp_path}"])
    assert "checkpoint.load: " in err and "foreign" in err


@pytest.mark.timeout(120)
def test_console_script_exit_code_without_traceback() -> None:
    proc = subprocess.run(
        [*_console_script(), "model.tensor_model_parallel_size=3"],
        capture_output=True,
        text=True,
        timeout=100,
    )
    assert proc.returncode == EXIT_CONFIG_ERROR, proc.stderr
    assert "Traceback" not in proc.stderr
    assert "bridge-train: error: model:" in proc.stderr
    assert "use a tensor_model_parallel_size in [1, 2, 4]" in proc.stderr.lower()


@pytest.mark.timeout(240)
def test_default_recipe_trains_prints_and_saves_its_config(tmp_path: Path) -> None:
    save = tmp_path / "run"
    proc = subprocess.run(
        [
            *_console_script(),
            "--metrics-file",
            str(tmp_path / "metrics.jsonl"),
            "train.train_iters=20",
            "train.eval_interval=10",
            f"checkpoint.save={save}",
        ],
        capture_output=True,
        text=True,
        timeout=220,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    # What the overrides changed (not the whole config), before training.
    assert "[bridge-train] resolved config:" not in out
    assert "  train.train_iters: 200 -> 20" in out
    assert f"  checkpoint.save: None -> '{save}'" in out
    assert f"[bridge-train] full resolved config: {save}/run_config.yaml" in out
    assert out.index("overrides (recipe -> this run)") < out.index("iteration       10/      20")
    # Third-party import notices are held back: nothing comes before the command's own line.
    before_own = proc.stderr.split("[bridge-train]")[0] + proc.stdout.split("[bridge-train]")[0]
    assert before_own.strip() == "", proc.stderr[:500]
    assert "iteration       20/      20" in out and "validation loss at iteration 10" in out
    # Saved beside the checkpoints, loadable, with the overrides applied.
    saved = ConfigContainer.from_yaml(save / "run_config.yaml")
    assert saved.train is not None and saved.train.train_iters == 20
    assert (save / "latest_checkpointed_iteration.txt").read_text().strip() == "20"
    assert "Starting job" in (save / "progress.txt").read_text()
    model = yaml.safe_load((save / "run_config.yaml").read_text())["model"]
    assert "no_sync_func" not in model and "ffn_hidden_size" not in model  # hooks, derived
    losses = [r["lm loss"] for r in read_metrics_file(tmp_path / "metrics.jsonl") if "lm loss" in r]
    assert len(losses) == 20 and losses[-1] < losses[0]


def _mimo_run(rank: int, world: int) -> int:
    overrides = ["train.train_iters=6", "logger.log_interval=3"]
    return run(["--recipe", "mimo", "--no-print-config", *overrides])


@pytest.mark.multiprocess
@pytest.mark.timeout(180)
@pytest.mark.parametrize("world", [1, 2])
def test_mimo_recipe_trains_with_bridge_mimo(capfd: pytest.CaptureFixture[str], world: int) -> None:
    assert run_distributed(_mimo_run, world, timeout=150) == [0] * world
    out = capfd.readouterr().out
    assert "text-only loss floor" in out
    # Colocated on one rank; with two, the encoder on rank 0 and the language model on rank 1.
    language = "range(0, 1)" if world == 1 else "range(1, 2)"
    assert f"'language': ModulePlacement(ranks={language}" in out
    assert "iteration      6 |" in out and "[bridge-train] mimo: 6 iterations" in out


def test_mimo_recipe_refuses_what_it_cannot_run(capsys: pytest.CaptureFixture[str]) -> None:
    # Checkpoint settings bridge-train cannot honour are refused for MIMO as for GPT.
    err = _fails_with(capsys, ["--recipe", "mimo", "checkpoint.ckpt_format=zarr"])
    assert "checkpoint.ckpt_format: 'zarr' is not supported" in err
    err = _fails_with(capsys, ["--recipe", "mimo", "scheduler.lr_warmup_fraction=1.0"])
    assert "scheduler: warmup (" in err and "must be shorter than the decay" in err
    err = _fails_with(capsys, ["--recipe", "mimo", "model.layout=split"])
    assert "model.layout: the split layout" in err and "got 1" in err


def _stop_early_then_finish(rank: int, world: int, save: str) -> list[int]:
    args = [
        "--no-print-config",
        "--requeue-exit-code=75",
        "train.train_iters=4",
        "train.exit_interval=2",
        "train.eval_interval=null",
        "train.eval_iters=0",
        "model.num_layers=1",
        f"checkpoint.save={save}",
    ]
    # The first launch stops at the exit interval (iteration 2) after saving: not finished.
    # The same command resumes and reaches train_iters: finished, 0, even though iteration
    # 4 is a multiple of the exit interval too.
    return [run(args), run(args)]


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_requeue_exit_code_marks_an_early_stop_and_not_a_finished_run(tmp_path: Path) -> None:
    (codes,) = run_distributed(_stop_early_then_finish, 1, str(tmp_path / "ckpt"), timeout=240)
    assert codes == [75, 0]
    assert (tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").read_text().strip() == "4"
    with pytest.raises(SystemExit) as info:
        main(["--requeue-exit-code=256"])
    assert info.value.code == 2
