"""Checkpoint layout, tracker and settings checks that need no process group.

The on-disk rules (tracker written last, completion marker, fallback when the tracker names
a missing iteration, what a save directory may hold) and every refusal that happens before
a model exists are checked here on plain directories.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path
from typing import Any

import pytest
import torch

from bridge.config import CheckpointConfig, ConfigContainer, ConfigError
from bridge.train import GlobalState
from bridge.train.checkpointing import (
    CheckpointError,
    checkpoint_exists,
    find_latest_checkpoint,
    init_checkpointing_context,
    layout,
    load_checkpoint,
    read_tracker,
    save_checkpoint,
)
from bridge.train.checkpointing.architecture import read_run_config, saved_run_config
from bridge.train.checkpointing.layout import (
    MARKER_FILENAME,
    TRACKER_FILENAME,
    validate_save_dir,
    write_marker,
    write_tracker,
)


def _complete(root: Path, iteration: int) -> Path:
    path = root / f"iter_{iteration:07d}"
    path.mkdir(parents=True)
    (path / "__0_0.distcp").write_bytes(b"shards")
    write_marker(path, {"iteration": iteration})
    return path


def _state(**checkpoint: Any) -> GlobalState:
    return GlobalState(cfg=ConfigContainer(checkpoint=CheckpointConfig(**checkpoint)))


# ---------------------------------------------------------------------------- tracker, marker


def test_tracker_round_trips_and_is_replaced_atomically(tmp_path: Path) -> None:
    assert read_tracker(tmp_path) is None
    write_tracker(tmp_path, 20)
    write_tracker(tmp_path, 30)
    assert read_tracker(tmp_path) == 30
    assert (tmp_path / TRACKER_FILENAME).read_text() == "30\n"
    # The temporary file of the atomic write is gone.
    assert sorted(p.name for p in tmp_path.iterdir()) == [TRACKER_FILENAME]


def test_malformed_tracker_is_named(tmp_path: Path) -> None:
    (tmp_path / TRACKER_FILENAME).write_text("twenty\n")
    with pytest.raises(
        CheckpointError, match=r"should hold an iteration number but holds 'twenty'"
    ):
        read_tracker(tmp_path)
    (tmp_path / TRACKER_FILENAME).write_text("release\n")
    with pytest.raises(CheckpointError, match="release checkpoint"):
        read_tracker(tmp_path)


def test_latest_follows_the_tracker_not_the_newest_directory(tmp_path: Path) -> None:
    _complete(tmp_path, 10)
    _complete(tmp_path, 20)
    _complete(tmp_path, 30)  # complete but never committed (crash before the tracker)
    write_tracker(tmp_path, 20)
    found = find_latest_checkpoint(tmp_path)
    assert found is not None and found.iteration == 20
    assert found.path == str(tmp_path / "iter_0000020")
    assert checkpoint_exists(tmp_path)


def test_directory_without_marker_is_never_loaded(tmp_path: Path, caplog) -> None:
    _complete(tmp_path, 10)
    torn = tmp_path / "iter_0000020"
    torn.mkdir()
    (torn / "__0_0.distcp").write_bytes(b"half")
    (torn / MARKER_FILENAME).write_text('{"iter')  # a torn marker counts as no marker
    write_tracker(tmp_path, 20)
    with caplog.at_level(logging.WARNING):
        found = find_latest_checkpoint(tmp_path)
    assert found is not None and found.iteration == 10
    assert "names iteration 20" in caplog.text and "is incomplete" in caplog.text
    assert "iteration 10, instead" in caplog.text


def test_tracker_pointing_at_a_missing_iteration_with_nothing_older(tmp_path: Path) -> None:
    _complete(tmp_path, 40)  # newer than the tracker: not committed
    write_tracker(tmp_path, 30)
    with pytest.raises(CheckpointError) as info:
        find_latest_checkpoint(tmp_path)
    message = str(info.value)
    assert "names iteration 30" in message and "iter_0000030 does not exist" in message
    assert "no older complete checkpoint" in message


def test_ckpt_step_and_checkpoint_directories(tmp_path: Path) -> None:
    _complete(tmp_path, 10)
    _complete(tmp_path, 20)
    write_tracker(tmp_path, 20)
    step = find_latest_checkpoint(tmp_path, step=10)
    assert step is not None and step.iteration == 10
    with pytest.raises(
        CheckpointError,
        match=r"ckpt_step=15: .*iter_0000015 does not exist; complete checkpoints in .*: \[10, 20\]",
    ):
        find_latest_checkpoint(tmp_path, step=15)
    # A path naming one checkpoint directory is that checkpoint.
    direct = find_latest_checkpoint(tmp_path / "iter_0000010")
    assert direct is not None and direct.iteration == 10
    assert checkpoint_exists(tmp_path / "iter_0000010")
    assert not checkpoint_exists(tmp_path / "missing")
    assert not checkpoint_exists(None)


def _count_lookups(monkeypatch: pytest.MonkeyPatch) -> list[Path]:
    """Every directory the tracker lookup itself (not an answer handed on) reads."""
    looked: list[Path] = []
    look = layout._find_latest

    def spy(base: Path, step: int | None) -> Any:
        looked.append(base)
        return look(base, step)

    monkeypatch.setattr(layout, "_find_latest", spy)
    return looked


def test_one_lookup_per_launch_and_a_commit_is_never_hidden(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    looked = _count_lookups(monkeypatch)
    _complete(tmp_path, 10)
    (tmp_path / "iter_0000020").mkdir()  # the tracker's iteration has no marker: fallback
    write_tracker(tmp_path, 20)
    with caplog.at_level(logging.ERROR), layout.one_lookup_per_launch():
        answers = [find_latest_checkpoint(tmp_path) for _ in range(3)]
        with layout.one_lookup_per_launch():  # pretrain inside bridge-train's launch
            answers.append(find_latest_checkpoint(str(tmp_path)))
        assert {a.iteration for a in answers if a is not None} == {10}
        assert len(looked) == 1
        assert caplog.text.count("names iteration 20") == 1  # the fallback said once
        # A commit in between (here by this process) is seen at once...
        _complete(tmp_path, 30)
        write_tracker(tmp_path, 30)
        latest = find_latest_checkpoint(tmp_path)
        assert latest is not None and latest.iteration == 30 and len(looked) == 2
        # ...and so is one by another process (the tracker replaced, nothing forgotten here).
        _complete(tmp_path, 40)
        layout.atomic_write(tmp_path / TRACKER_FILENAME, "40\n")
        latest = find_latest_checkpoint(tmp_path)
        assert latest is not None and latest.iteration == 40 and len(looked) == 3
        # An error is an answer too: raised again to every asker, looked up once.
        with pytest.raises(CheckpointError, match="ckpt_step=15"):
            find_latest_checkpoint(tmp_path, step=15)
        with pytest.raises(CheckpointError, match="ckpt_step=15"):
            find_latest_checkpoint(tmp_path, step=15)
        assert len(looked) == 4
    # Outside a launch every call looks again; the next launch reports its fallback again.
    (tmp_path / "iter_0000040" / MARKER_FILENAME).unlink()
    assert find_latest_checkpoint(tmp_path) is not None
    assert find_latest_checkpoint(tmp_path) is not None
    assert len(looked) == 6
    caplog.clear()
    with caplog.at_level(logging.ERROR), layout.one_lookup_per_launch():
        find_latest_checkpoint(tmp_path)
    assert caplog.text.count("names iteration 40") == 1


def test_a_marker_removed_by_hand_during_a_launch_is_not_trusted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Deleting iter_*/checkpoint_complete.json changes no stamp of the save directory: the
    # launch's answer must still stop naming that checkpoint as complete.
    looked = _count_lookups(monkeypatch)
    _complete(tmp_path, 10)
    _complete(tmp_path, 20)
    write_tracker(tmp_path, 20)
    with layout.one_lookup_per_launch():
        latest = find_latest_checkpoint(tmp_path)
        assert latest is not None and latest.iteration == 20
        assert layout.complete_iterations(tmp_path) == [10, 20]
        (tmp_path / "iter_0000020" / MARKER_FILENAME).unlink()
        latest = find_latest_checkpoint(tmp_path)
        assert latest is not None and latest.iteration == 10  # the fallback, as outside
        assert layout.complete_iterations(tmp_path) == [10]
        assert find_latest_checkpoint(tmp_path) == latest and len(looked) == 2


# ---------------------------------------------------------------------------- save directory


def test_save_directory_with_foreign_entries_is_refused(tmp_path: Path) -> None:
    save = tmp_path / "run"
    _complete(save, 10)
    write_tracker(save, 10)
    for name in ("progress.txt", "run_config.yaml", "ft_state.json", "metrics.jsonl"):
        (save / name).write_text("")
    (save / "non_persistent").mkdir()
    (save / "profile").mkdir()  # torch profiler traces without a TensorBoard directory
    (save / "run_config.yaml.tmp").write_text("")  # a rewrite interrupted by a crash
    validate_save_dir(save)  # a previous run of ours is fine
    (save / "model.safetensors").write_bytes(b"")
    (save / "notes").mkdir()
    with pytest.raises(CheckpointError) as info:
        init_checkpointing_context(CheckpointConfig(save=str(save)))
    message = str(info.value)
    assert f"checkpoint.save={str(save)!r}" in message
    assert "model.safetensors, notes/" in message
    assert "choose an empty or new directory" in message
    # Nothing was touched.
    assert (save / "model.safetensors").exists() and (save / "iter_0000010").exists()


def test_save_path_that_is_a_file_is_refused(tmp_path: Path) -> None:
    target = tmp_path / "file"
    target.write_text("x")
    with pytest.raises(CheckpointError, match="is a file, not a directory"):
        init_checkpointing_context(CheckpointConfig(save=str(target)))


def test_context_for_a_fresh_directory(tmp_path: Path) -> None:
    context = init_checkpointing_context(CheckpointConfig(save=str(tmp_path / "new")))
    assert context["config"].save == str(tmp_path / "new")
    # Created at setup holding only the run's lock (nothing else until the first save).
    assert [p.name for p in (tmp_path / "new").iterdir()] == ["checkpoint.lock"]


# ---------------------------------------------------------------------------- refused settings


@pytest.mark.parametrize(
    ("fields", "location", "fragment"),
    [
        ({"ckpt_format": "zarr"}, "checkpoint.ckpt_format", "use ckpt_format='torch_dist'"),
        (
            {"non_persistent_ckpt_type": "local", "non_persistent_local_ckpt_dir": "/tmp/x"},
            "checkpoint.non_persistent_ckpt_type",
            "'local' is not supported",
        ),
        (
            {"non_persistent_ckpt_type": "in_memory"},
            "checkpoint.non_persistent_ckpt_type",
            "'in_memory' is not supported",
        ),
        ({"ckpt_convert_format": "torch"}, "checkpoint.ckpt_convert_format", "unset"),
        ({"ckpt_convert_save": "/tmp/x"}, "checkpoint.ckpt_convert_save", "unset"),
        (
            {"non_persistent_local_ckpt_dir": "/tmp/x"},
            "checkpoint.non_persistent_local_ckpt_dir",
            "local checkpoints are not supported",
        ),
        (
            {"non_persistent_local_ckpt_algo": "atomic"},
            "checkpoint.non_persistent_local_ckpt_algo",
            "unset non_persistent_local_ckpt_algo",
        ),
        ({"use_checkpoint_args": True}, "checkpoint.use_checkpoint_args", "run_config.yaml"),
        (
            {"fully_parallel_load": True},
            "checkpoint.fully_parallel_load",
            "requires CUDA",
        ),
    ],
)
def test_unsupported_settings_are_refused_at_setup(
    tmp_path: Path, fields: dict, location: str, fragment: str
) -> None:
    import torch

    if "requires CUDA" in fragment and torch.cuda.is_available():
        pytest.skip("these settings are allowed on a GPU machine")
    config = CheckpointConfig(save=str(tmp_path / "run"), **fields)
    with pytest.raises(ConfigError) as info:
        init_checkpointing_context(config)
    assert str(info.value).startswith(location + ":")
    assert fragment in str(info.value)


def test_save_needs_a_directory(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"checkpoint.save: is not set"):
        save_checkpoint(_state(), [], None, None, 0.0)
    with pytest.raises(
        ConfigError, match=r"non_persistent_ckpt_type: is None but a non-persistent"
    ):
        save_checkpoint(
            _state(save=str(tmp_path / "unused")), [], None, None, 0.0, non_persistent_ckpt=True
        )
    with pytest.raises(ConfigError, match=r"^checkpoint: state.cfg.checkpoint is not set"):
        save_checkpoint(GlobalState(), [], None, None, 0.0)


# ---------------------------------------------------------------------------- what load picks


def test_missing_load_path_with_exit_on_missing_checkpoint(tmp_path: Path) -> None:
    missing = tmp_path / "typo"
    with pytest.raises(CheckpointError) as info:
        load_checkpoint(_state(load=str(missing), exit_on_missing_checkpoint=True), [], None, None)
    message = str(info.value)
    assert f"checkpoint.load={str(missing)!r} does not exist" in message
    assert "exit_on_missing_checkpoint" in message
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match="holds no checkpoint"):
        load_checkpoint(
            _state(load=str(tmp_path / "empty"), exit_on_missing_checkpoint=True), [], None, None
        )


def test_nothing_to_load_starts_from_scratch(tmp_path: Path, caplog) -> None:
    state = _state(load=str(tmp_path / "fresh"))
    with caplog.at_level(logging.WARNING):
        assert load_checkpoint(state, [], None, None) == (0, 0.0)
    assert "starting from a random initialisation" in caplog.text
    assert load_checkpoint(_state(), [], None, None) == (0, 0.0)


def test_missing_pretrained_checkpoint_and_step_are_errors(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match=r"pretrained_checkpoint='.*nope' does not exist"):
        load_checkpoint(
            _state(pretrained_checkpoint=str(tmp_path / "nope"), finetune=True), [], None, None
        )
    _complete(tmp_path / "run", 10)
    write_tracker(tmp_path / "run", 10)
    with pytest.raises(CheckpointError, match=r"ckpt_step=7: .*iter_0000007 does not exist"):
        load_checkpoint(_state(load=str(tmp_path / "run"), ckpt_step=7), [], None, None)
    with pytest.raises(
        CheckpointError, match=r"ckpt_step=7: checkpoint.load='.*absent' does not exist"
    ):
        load_checkpoint(_state(load=str(tmp_path / "absent"), ckpt_step=7), [], None, None)


def test_non_persistent_directory_newer_than_the_persistent_one_wins(tmp_path: Path) -> None:
    from bridge.train.checkpointing.load import planned_load

    run = tmp_path / "run"
    _complete(run, 10)
    write_tracker(run, 10)
    _complete(run / "non_persistent", 15)
    write_tracker(run / "non_persistent", 15)
    config = CheckpointConfig(load=str(run), save=str(run), non_persistent_ckpt_type="global")
    plan = planned_load(config)
    assert plan is not None and plan.iteration == 15 and plan.source == "non-persistent"
    # Without the non-persistent type configured, only the persistent tracker counts.
    plan = planned_load(dataclasses.replace(config, non_persistent_ckpt_type=None))
    assert plan is not None and plan.iteration == 10
    # A newer persistent checkpoint wins.
    _complete(run, 20)
    write_tracker(run, 20)
    plan = planned_load(config)
    assert plan is not None and plan.iteration == 20 and plan.source == "checkpoint.load"
    # pretrained_checkpoint is used only when load holds nothing, and always as finetune.
    pretrained = planned_load(
        CheckpointConfig(load=str(tmp_path / "empty"), pretrained_checkpoint=str(run))
    )
    assert pretrained is not None and pretrained.weights_only and pretrained.iteration == 20


def test_marker_content_is_json(tmp_path: Path) -> None:
    path = _complete(tmp_path, 3)
    assert json.loads((path / MARKER_FILENAME).read_text()) == {"iteration": 3}


def test_what_the_common_state_refuses_before_any_model_is_touched(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A directory megatron cannot read, a dist_checkpointing checkpoint another program
    saved and a newer format are refused, each naming the checkpoint; one saved before
    content checksums existed is read unverified, with a warning saying so."""
    path = _complete(tmp_path, 10)  # a marker without file checksums: an older save
    write_tracker(tmp_path, 10)
    state = _state(load=str(tmp_path))
    with (
        caplog.at_level(logging.WARNING),
        pytest.raises(CheckpointError, match=f"cannot read the checkpoint {path}"),
    ):
        load_checkpoint(state, [], None, None)
    assert "saved without content checksums" in caplog.text
    backends = {"sharded_backend": "torch_dist", "common_backend": "torch"}
    (path / "metadata.json").write_text(json.dumps(backends))
    torch.save({"iteration": 10}, path / "common.pt")  # megatron's legacy common state
    with pytest.raises(CheckpointError, match="not one saved by bridge-train"):
        load_checkpoint(state, [], None, None)
    torch.save({"bridge_checkpoint": {"version": 99}}, path / "common.pt")
    with pytest.raises(CheckpointError, match="format 99, newer than this bridge-train reads"):
        load_checkpoint(state, [], None, None)


def test_a_saved_run_config_that_no_longer_loads(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The reader of a checkpoint's run_config.yaml: None without one; one that no longer
    loads is an error, which the resume checks log and then compare nothing."""
    assert saved_run_config(tmp_path) is None and read_run_config(tmp_path) is None
    (tmp_path / "run_config.yaml").write_text("model:\n  _target_: gone.module.OldConfig\n")
    with pytest.raises(ConfigError, match=r"cannot import 'gone\.module\.OldConfig'"):
        saved_run_config(tmp_path)
    with caplog.at_level(logging.INFO):
        assert read_run_config(tmp_path) is None
    assert "not comparing this run with" in caplog.text


# ---------------------------------------------------------------------------- RNG state and layout


def test_rng_state_follows_expert_sizes_not_the_virtual_pipeline() -> None:
    """megatron seeds ``expert-parallel-rng`` per expert-model and expert-tensor rank, so an
    EP-only change makes a rank's saved states another rank's (reseeded, not restored); no
    seed depends on the virtual stage, so VPP (not part of the layout) never does. A
    checkpoint from before the expert sizes were recorded is compared on what it records."""
    from bridge.train.checkpointing.load import _layout_sizes, _rng_layout_changed

    dense = {
        "world_size": 2,
        "tensor_model_parallel_size": 1,
        "pipeline_model_parallel_size": 1,
        "context_parallel_size": 1,
        "data_parallel_size": 2,
    }
    ep1 = {**dense, "expert_model_parallel_size": 1, "expert_tensor_parallel_size": 1}
    ep2 = {**ep1, "expert_model_parallel_size": 2}
    etp2 = {**ep1, "expert_tensor_parallel_size": 2}
    assert not _rng_layout_changed(ep1, dict(ep1))
    assert _rng_layout_changed(ep1, ep2) and _rng_layout_changed(ep2, ep1)
    assert _rng_layout_changed(ep1, etp2)
    assert not _rng_layout_changed(dense, ep2)  # saved before the expert sizes were recorded
    assert _rng_layout_changed(dense, {**ep2, "data_parallel_size": 1, "world_size": 1})
    assert _layout_sizes(ep2) == "TP1 PP1 CP1 DP2 EP2 ETP1"
    mimo = {"vision": "ranks 0-1 TP1 DP2", "language": "ranks 2-3 TP2 DP1"}
    assert _layout_sizes({"world_size": 4, "mimo_layout": mimo}) == (
        "vision ranks 0-1 TP1 DP2, language ranks 2-3 TP2 DP1"
    )
    assert _layout_sizes({"world_size": 1}) == "no model parallelism"


def test_a_new_save_clears_crashed_saves_and_puts_a_retired_checkpoint_back(
    tmp_path: Path,
) -> None:
    """Leftovers of crashed saves: a staging directory is removed; a complete checkpoint
    retired for a same-iteration replacement that never arrived is moved back, and one whose
    replacement did arrive is removed."""
    from bridge.train.checkpointing.save import _prepare_staging

    save = tmp_path / "save"
    (save / "iter_0000003.tmp").mkdir(parents=True)
    _complete(save, 4).rename(save / "iter_0000004.old")  # its replacement never arrived
    _complete(save, 5).rename(save / "iter_0000005.old")
    _complete(save, 5)  # ... and this one did
    staging = _prepare_staging(str(save), 6)
    assert staging == str(save / "iter_0000006.tmp")
    assert sorted(p.name for p in save.iterdir()) == [
        "iter_0000004",
        "iter_0000005",
        "iter_0000006.tmp",
    ]
    assert (save / "iter_0000004" / MARKER_FILENAME).is_file()
