"""``bridge-train recipe.yaml ...`` as docs/yaml-and-overrides.md writes it, and what
``--dry-run`` says about the config file a launch writes."""

from __future__ import annotations

from pathlib import Path

import pytest

from bridge.train.cli import main, run
from bridge.train.recipes import recipe_path


@pytest.fixture
def recipe(tmp_path: Path) -> Path:
    path = tmp_path / "my_recipe.yaml"
    path.write_text(recipe_path("tiny_gpt").read_text())
    return path


def test_a_yaml_file_first_is_the_recipe(recipe: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # Before: "bridge-train: error: .../my_recipe.yaml: override has no '='".
    assert run([str(recipe), "--dry-run", "train.train_iters=3"]) == 0
    out = capsys.readouterr().out
    assert f"[bridge-train] recipe: {recipe}" in out
    assert "  train.train_iters: 200 -> 3" in out
    assert run(["--print-config", str(recipe), "optimizer.lr=1e-3"]) == 0
    assert "lr: 0.001" in capsys.readouterr().out
    with pytest.raises(SystemExit) as info:
        main([str(recipe), "--config", str(recipe)])
    assert info.value.code == 2
    assert "both name a recipe; give one" in capsys.readouterr().err
    # Any other word without '=' is still an override error, now with the recipe hint.
    with pytest.raises(SystemExit) as info:
        main(["train.train_iters"])
    err = capsys.readouterr().err
    assert info.value.code == 2 and "a recipe file goes first" in err


def test_dry_run_does_not_name_a_file_it_does_not_write(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    save = tmp_path / "runs" / "a"
    assert run(["--dry-run", f"checkpoint.save={save}"]) == 0
    out = capsys.readouterr().out
    line = next(x for x in out.splitlines() if x.startswith("[bridge-train] full resolved config"))
    assert line == (
        f"[bridge-train] full resolved config: --print-config (a launch saves it as "
        f"{save}/run_config.yaml)"
    )
    assert not save.exists()
