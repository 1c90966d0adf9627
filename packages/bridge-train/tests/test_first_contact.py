"""A new user's first minute with ``bridge-train``: fast answers, nothing accepted silently.

* Start-up: ``--help``, ``--version`` and every mistake of the YAML/override layer answer
  without importing torch or megatron-core (checked in one fresh interpreter).
* Bad values, paths and launch environments: exit code 2, one line naming the field or
  file and the fix, no traceback (in this process: they fail before anything starts).
* Forgiving defaults: the built-in recipes validate for any ``train.train_iters >= 1``;
  the documented extend-a-run command resumes and keeps the learning rate continuous.
* Signals: Ctrl-C and a burst of SIGTERMs end with one line and 130 / 143.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import textwrap
import time
import warnings
from pathlib import Path

import pytest

from bridge.config import ConfigContainer, ConfigError
from bridge.train.checks.launch import shared_store_restart_notice
from bridge.train.cli import EXIT_CONFIG_ERROR, EXIT_INTERRUPTED, main, run
from bridge.train.engine.launch_env import launch_environment
from bridge.train.recipes import RECIPES, recipe_path

_NO_TORCH_PROBE = textwrap.dedent(
    """
    import contextlib, io, json, sys
    from bridge.train.cli import main
    results = []
    for argv in json.loads(sys.argv[1]):
        out, err = io.StringIO(), io.StringIO()
        code = None
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                main(argv)
            except SystemExit as exc:
                code = exc.code
        heavy = sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "megatron"))
        results.append([code, out.getvalue(), err.getvalue(), heavy[:3]])
    print(json.dumps(results))
    """
)


def _fails_with(capsys: pytest.CaptureFixture[str], argv: list[str]) -> str:
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == EXIT_CONFIG_ERROR
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if not line.startswith("[bridge-train] ")]
    assert len(lines) == 1 and lines[0].startswith("bridge-train: error: "), err
    assert "Traceback" not in err
    return lines[0]


@pytest.mark.timeout(120)
def test_help_version_and_input_errors_import_neither_torch_nor_megatron(tmp_path: Path) -> None:
    bad_yaml = tmp_path / "bad.yaml"
    bad_yaml.write_text("train:\n  train_iters: [1\n")
    duplicate = tmp_path / "duplicate.yaml"
    duplicate.write_text(
        recipe_path("tiny_gpt").read_text().replace("train:\n", "train:\n  micro_batch_size: 2\n")
    )
    cases = [
        (["--help"], 0, "section.field=value"),
        (["--version"], 0, "megatron-core 0.19.2"),
        (["trian.train_iters=5"], 2, "trian: unknown section of ConfigContainer. Did you mean"),
        (["train.train_itres=5"], 2, "train.train_itres: unknown field"),
        (["train.micro_batch_size=four"], 2, "train.micro_batch_size: got 'four'"),
        (["--config", str(tmp_path / "missing.yaml")], 2, "missing.yaml: config file does not"),
        (["--config", str(bad_yaml)], 2, "bad.yaml: invalid YAML (line 3"),
        (["--config", str(duplicate)], 2, "duplicate key 'micro_batch_size'"),
        (["train.train_iters=5", "train.train_iters=6"], 2, "train.train_iters: is given twice"),
        (["scheduler.lr_decay_steps=5"], 2, "set scheduler.lr_decay_iters"),
        (["data_parallel_size=2"], 2, "data_parallel_size: got 2; it is computed by validate()"),
        (["dataset.split=a,b"], 2, "dataset.split: got 'a,b'"),
    ]
    proc = subprocess.run(
        [sys.executable, "-c", _NO_TORCH_PROBE, json.dumps([argv for argv, _, _ in cases])],
        capture_output=True,
        text=True,
        timeout=110,
        env={k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK")},
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    results = json.loads(proc.stdout.splitlines()[-1])
    for (argv, expected_code, expected), (code, out, err, heavy) in zip(
        cases, results, strict=True
    ):
        assert code == expected_code, (argv, err)
        assert expected in (out if code == 0 else err), (argv, out, err)
        assert heavy == [], (argv, heavy)
        assert "Traceback" not in err and "Warning" not in err, (argv, err)
        if code:
            assert err.count("\n") == 1, err


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["optimizer.lr=inf"], "optimizer.lr: got inf; expected a number >= 0 (NaN"),
        (["optimizer.lr=nan"], "optimizer.lr: got nan"),
        (["optimizer.lr=-0.1"], "optimizer.lr: got -0.1; expected a number >= 0"),
        (
            ["optimizer.adam_beta1=1.5"],
            "optimizer.adam_beta1: got 1.5; expected a number in [0, 1)",
        ),
        (["optimizer.adam_eps=0"], "optimizer.adam_eps: got 0"),
        (["optimizer.min_lr=1.0"], "optimizer.min_lr: got 1.0, above optimizer.lr"),
        (
            ["scheduler.lr_warmup_init=1.0"],
            "scheduler.lr_warmup_init: got 1.0, above optimizer.lr",
        ),
        (["optimizer.lr=null"], "optimizer.lr: is required"),
        (
            ["optimizer.optimizer=adamw"],
            "optimizer.optimizer: got 'adamw'; megatron-core builds 'adam'",
        ),
        (
            ["model.hidden_dropout=1.5"],
            "model.hidden_dropout: got 1.5; expected a number in [0, 1]",
        ),
        (["model.attention_dropout=-1"], "model.attention_dropout: got -1"),
        (["checkpoint.load=/no/such/run"], "checkpoint.load: '/no/such/run' does not exist"),
        (["dataset.split=1,0,0"], "train.eval_iters: is 2, so the run evaluates, but"),
        (["dataset.data_sharding=false"], "dataset.data_sharding: false is not supported"),
        (
            [
                "comm_overlap._target_=bridge.train.engine.comm_overlap.CommOverlapConfig",
                "comm_overlap.overlap_param_gather=true",
            ],
            "comm_overlap.overlap_param_gather: got true; the parameter all-gather exists only",
        ),
        (["train.train_iters=100000000000000000000000"], "train.train_iters: got 1000000000000"),
        (
            [
                "train.train_iters=null",
                "train.train_samples=64",
                "train.rampup_batch_size=[2,2,16]",
                "train.decrease_batch_size_if_needed=true",
            ],
            "train.rampup_batch_size: cannot be combined with train.decrease_batch_size_if_needed",
        ),
        (
            ["tokenizer.tokenizer_type=SentencePieceTokenizer", "tokenizer.tokenizer_model=x"],
            "tokenizer.tokenizer_model: 'x' does not exist or is not a file",
        ),
        (
            [
                "tokenizer.tokenizer_type=GPT2BPETokenizer",
                "tokenizer.vocab_file=v",
                "tokenizer.merge_file=m",
            ],
            "tokenizer.vocab_file: 'v' does not exist or is not a file",
        ),
    ],
)
def test_values_accepted_silently_before_are_refused(
    capsys: pytest.CaptureFixture[str], argv: list[str], expected: str
) -> None:
    line = _fails_with(capsys, ["--dry-run", *argv])
    assert expected in line, line


def test_unwritable_outputs_are_refused_before_training(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("mine")
    line = _fails_with(capsys, ["--metrics-file", str(blocker / "m.jsonl")])
    assert "--metrics-file: " in line and "is a file, not a directory" in line
    line = _fails_with(capsys, ["--metrics-file", str(tmp_path)])
    assert "is a directory; give a file path" in line
    line = _fails_with(capsys, ["--dry-run", f"logger.tensorboard_dir={blocker}/tb"])
    assert line.startswith("bridge-train: error: logger.tensorboard_dir: ")
    line = _fails_with(capsys, ["--dry-run", f"checkpoint.save={blocker}/run"])
    assert "checkpoint.save" in line
    if os.path.isdir("/proc/1") and not os.access("/proc/1", os.W_OK):
        line = _fails_with(capsys, ["--dry-run", "logger.tensorboard_dir=/proc/1/tb"])
        assert "choose a writable path" in line
    assert blocker.read_text() == "mine"


def test_stale_distributed_environment_is_refused(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in ("WORLD_SIZE", "RANK", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("RANK", "0")
    line = _fails_with(capsys, [])
    assert "WORLD_SIZE: environment variable is 4 but this is not a torchrun launch" in line
    assert "MASTER_ADDR, MASTER_PORT are not set" in line and "--nproc_per_node=4" in line
    monkeypatch.setenv("WORLD_SIZE", "two")
    assert "WORLD_SIZE: environment variable holds 'two'" in _fails_with(capsys, [])
    with pytest.raises(ConfigError, match=r"RANK: environment variable is 7, outside \[0, WORLD"):
        launch_environment({"WORLD_SIZE": "4", "RANK": "7"})


def test_launch_environment_rule() -> None:
    agent = {"TORCHELASTIC_RUN_ID": "x", "WORLD_SIZE": "2", "RANK": "1"}
    launch_environment(agent)  # torchrun: its agent provides the rendezvous
    manual = {"WORLD_SIZE": "2", "RANK": "1", "MASTER_ADDR": "n0", "MASTER_PORT": "29500"}
    launch_environment(manual)  # another launcher exporting every variable
    launch_environment({"WORLD_SIZE": "1", "RANK": "0"})
    launch_environment({})
    with pytest.raises(ConfigError, match="RANK is not set"):
        launch_environment({"WORLD_SIZE": "2", "MASTER_ADDR": "n0", "MASTER_PORT": "1"})


def test_several_nodes_with_a_shared_rendezvous_store_are_warned_once(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # What torchrun --nnodes=2 --nproc-per-node=2 --max-restarts=2 gives rank 0 by default.
    agent = {
        "TORCHELASTIC_RUN_ID": "x",
        "WORLD_SIZE": "4",
        "RANK": "0",
        "GROUP_WORLD_SIZE": "2",
        "TORCHELASTIC_MAX_RESTARTS": "2",
        "TORCHELASTIC_USE_AGENT_STORE": "True",
    }
    for name, value in agent.items():
        monkeypatch.setenv(name, value)
    assert run(["--dry-run", "train.micro_batch_size=2"]) == 0
    warnings = [line for line in capsys.readouterr().err.splitlines() if "rendezvous" in line]
    assert warnings == [
        "[bridge-train] warning: torchrun runs 2 nodes with --max-restarts=2 and one rendezvous "
        "store shared by all rounds (torch's default): a node started to replace a lost one, "
        "or one returning to an elastic --nnodes=MIN:MAX job, cannot join it (the agents fail "
        "after 60 s); start every agent with "
        "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 (docs/resiliency.md, 'Several nodes')"
    ]
    monkeypatch.setenv("RANK", "1")
    assert run(["--dry-run", "train.micro_batch_size=2"]) == 0
    assert "rendezvous" not in capsys.readouterr().err  # rank 0 only
    # Not affected: a store per round, one node, or no restarts.
    for change in (
        {"TORCHELASTIC_USE_AGENT_STORE": "False"},
        {"GROUP_WORLD_SIZE": "1"},
        {"TORCHELASTIC_MAX_RESTARTS": "0"},
    ):
        assert shared_store_restart_notice({**agent, **change}) is None, change
    assert shared_store_restart_notice({}) is None


def test_dry_run_prints_the_plan_and_print_config_a_loadable_config(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    assert run(["--dry-run", "train.train_iters=7", "train.global_batch_size=16"]) == 0
    out = capsys.readouterr().out
    assert "  train.train_iters: 200 -> 7" in out
    assert "parallel layout: tensor 1, pipeline 1, context 1, data 1" in out
    assert "micro 4 x 4 micro-batches x data 1 = global 16; train_iters 7" in out
    assert "nothing was trained" in out and "iteration" not in out
    assert run(["--print-config", "train.train_iters=7"]) == 0
    printed = capsys.readouterr().out
    saved = tmp_path / "printed.yaml"
    saved.write_text(printed)
    loaded = ConfigContainer.from_yaml(saved)  # the printed config is a recipe
    assert loaded.train is not None and loaded.train.train_iters == 7
    loaded.validate(world_size=1)


@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_recipes_validate_for_any_train_iters(recipe: str) -> None:
    from bridge.config import load_config

    for iters in (1, 2, 5, 19, 10_000):
        cfg = load_config(recipe_path(recipe), [f"train.train_iters={iters}"])
        cfg.validate(world_size=1)
        assert cfg.scheduler is not None and cfg.scheduler.lr_warmup_steps is not None
        assert cfg.scheduler.lr_decay_steps is not None
        assert cfg.scheduler.lr_warmup_steps < cfg.scheduler.lr_decay_steps
    # An override of another warm-up field replaces the recipe's fraction.
    cfg = load_config(recipe_path(recipe), ["scheduler.lr_warmup_iters=2", "train.train_iters=9"])
    cfg.validate(world_size=1)
    assert cfg.scheduler is not None and cfg.scheduler.lr_warmup_fraction is None
    assert cfg.train is not None and cfg.train.global_batch_size is not None
    assert cfg.scheduler.lr_warmup_steps == 2 * cfg.train.global_batch_size


@pytest.mark.timeout(300)
def test_documented_extend_a_run_command_resumes_and_keeps_the_schedule(
    caplog: pytest.LogCaptureFixture, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # docs/quickstart.md: bridge-train checkpoint.save=runs/a, then the same with more iters.
    monkeypatch.chdir(tmp_path)
    common = ["--metrics-file", "m.jsonl", "checkpoint.save=runs/a", "logger.log_interval=1"]
    assert run([*common, "train.train_iters=4", "train.eval_iters=0"]) == 0
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="bridge.train"):
        assert run([*common, "train.train_iters=6", "train.eval_iters=0"]) == 0
    assert "checkpoint of iteration 4" in caplog.text
    assert "keeping the checkpoint's schedule" in caplog.text
    assert (tmp_path / "runs/a/latest_checkpointed_iteration.txt").read_text().strip() == "6"
    records = [json.loads(line) for line in Path("m.jsonl").read_text().splitlines()]
    rates = [r["learning-rate"] for r in records if "learning-rate" in r]
    assert rates[-1] == pytest.approx(3.0e-4)  # min_lr: the 4-iteration decay had ended


def test_held_notices_hold_third_party_warnings_only() -> None:
    from bridge.config.notices import held_notices

    with warnings.catch_warnings(record=True) as outer:
        warnings.simplefilter("always")
        with held_notices() as held:
            warnings.warn_explicit(
                "Transformer Engine and Apex are not installed.",
                UserWarning,
                "/venv/site-packages/megatron/core/optimizer/__init__.py",
                25,
            )
            warnings.warn_explicit("mine", UserWarning, "/src/bridge/train/x.py", 1)
    assert [str(w.message) for w in outer] == ["mine"]
    assert len(held.lines) == 1 and "Transformer Engine" in held.lines[0]
    summary = held.summary()
    assert summary is not None and "Transformer Engine/Apex not installed" in summary


def test_ctrl_c_ends_with_one_line(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import bridge.train.cli as cli

    def interrupted(argv: object) -> int:
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(5)
        return 0

    monkeypatch.setattr(cli, "run", interrupted)
    before = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        with pytest.raises(SystemExit) as info:
            main([])
        # The process is on its way out: further signals of a burst stay ignored.
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_IGN
    finally:
        # main() is a process entry point; this test process continues, and the processes
        # later tests fork from it must see the default handlers.
        for sig, handler in before.items():
            signal.signal(sig, handler)
    assert info.value.code == EXIT_INTERRUPTED
    err = capsys.readouterr().err
    assert err == "bridge-train: stopped by SIGINT (Ctrl-C)\n"


def test_sigterm_while_a_config_target_imports_is_not_reported_as_a_config_error(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    # The import of a `_target_` module (megatron-core, for the built-in providers) can take
    # many seconds; a scheduler's SIGTERM then lands inside it.
    (tmp_path / "h14_slow_provider.py").write_text(
        "import os, signal, time\nos.kill(os.getpid(), signal.SIGTERM)\ntime.sleep(5)\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    before = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        with pytest.raises(SystemExit) as info:
            main(["--dry-run", "model._target_=h14_slow_provider.Provider"])
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)
        sys.modules.pop("h14_slow_provider", None)
    assert info.value.code == 143
    assert capsys.readouterr().err == "bridge-train: stopped by SIGTERM\n"


@pytest.mark.timeout(240)
def test_a_burst_of_sigterms_during_training_ends_with_one_line(tmp_path: Path) -> None:
    script = Path(sys.executable).with_name("bridge-train")
    command = [str(script)] if script.exists() else [sys.executable, "-m", "bridge.train"]
    proc = subprocess.Popen(
        [*command, "train.train_iters=100000", "logger.log_interval=1", "train.eval_iters=0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=tmp_path,
    )
    try:
        assert proc.stdout is not None
        for line in proc.stdout:  # wait until training runs
            if "iteration        1/" in line:
                break
        for _ in range(5):
            proc.send_signal(signal.SIGTERM)
            time.sleep(0.05)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 143, err[-2000:]
    assert "Traceback" not in err
    assert err.strip().splitlines()[-1] == "bridge-train: stopped by SIGTERM"


def test_world_size_the_layout_cannot_use_is_named_once_by_rank_0(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # As torchrun --nproc_per_node=3 sets it up; the check runs before any process group.
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "test")
    monkeypatch.setenv("WORLD_SIZE", "3")
    monkeypatch.setenv("RANK", "0")
    line = _fails_with(capsys, ["--dry-run", "model.tensor_model_parallel_size=2"])
    assert "3" in line and "tensor_model_parallel_size" in line, line
    monkeypatch.setenv("RANK", "1")
    with pytest.raises(SystemExit) as info:
        main(["--dry-run", "model.tensor_model_parallel_size=2"])
    assert info.value.code == EXIT_CONFIG_ERROR
    assert capsys.readouterr().err == ""  # only rank 0 reports it
