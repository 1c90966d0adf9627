"""Layout validation: every bad layout fails before any process group, with a clear message."""

from __future__ import annotations

import pytest

from bridge.mimo import MimoLayout, ModulePlacement


def _layout(**modules: ModulePlacement) -> MimoLayout:
    return MimoLayout(modules)


def test_placement_derives_dp_and_exposes_megatron_rank_order() -> None:
    placement = ModulePlacement(ranks=range(4, 8), tp=2)
    assert placement.dp_size == 2
    assert placement.grid_shape == [2, 1, 2, 1]
    assert placement.grid_dim_names == ["tp", "cp", "dp", "pp"]
    assert placement.replica_ranks(0) == (4, 5)
    assert placement.replica_ranks(1) == (6, 7)
    assert placement.coordinates(7) == {"tp": 1, "cp": 0, "dp": 1, "pp": 0}
    assert ModulePlacement(ranks=[3]).rank_range == range(3, 4)


def test_replica_ranks_agree_with_hypercommgrid(monkeypatch: pytest.MonkeyPatch) -> None:
    from megatron.core.hyper_comm_grid import HyperCommGrid

    monkeypatch.setenv("WORLD_SIZE", "10")  # HyperCommGrid needs no process group for this
    placement = ModulePlacement(ranks=range(2, 10), tp=2, dp=4)
    grid = HyperCommGrid(placement.grid_shape, placement.grid_dim_names, placement.rank_offset)
    by_dp = grid.get_rank_enum(["tp", "cp", "pp"])
    assert [list(placement.replica_ranks(d)) for d in range(4)] == by_dp
    for dp_group in grid.get_rank_enum("dp"):
        for index, rank in enumerate(dp_group):
            assert placement.coordinates(rank)["dp"] == index


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"ranks": []}, "ranks is empty"),
        ({"ranks": [0, 2]}, r"contiguous ascending range .* got \[0, 2\]"),
        ({"ranks": [1, 0]}, "contiguous"),
        ({"ranks": [-1, 0]}, "non-negative"),
        ({"ranks": range(0, 3), "tp": 2}, "3 ranks 0-2 are not divisible by tp\\*cp\\*pp"),
        (
            {"ranks": range(0, 4), "tp": 2, "dp": 1},
            "tp\\*cp\\*dp\\*pp = 2\\*1\\*1\\*1 = 2 but .* 4 ranks",
        ),
        ({"ranks": range(0, 2), "tp": 0}, "tp must be an integer >= 1, got 0"),
        ({"ranks": range(0, 2), "dp": 0}, "dp must be an integer >= 1, got 0"),
    ],
)
def test_bad_placements_name_the_field(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ModulePlacement(**kwargs)


def test_layout_requires_language_and_encoder() -> None:
    with pytest.raises(ValueError, match="no language module 'language'"):
        _layout(vision=ModulePlacement(ranks=[0]), text=ModulePlacement(ranks=[1]))
    with pytest.raises(ValueError, match="at least one encoder module"):
        _layout(language=ModulePlacement(ranks=[0]))
    with pytest.raises(ValueError, match=r"modules\['vision'\] must be a ModulePlacement"):
        MimoLayout({"vision": {"ranks": [0]}, "language": ModulePlacement(ranks=[1])})  # type: ignore[dict-item]


def test_rank_in_no_module_is_named() -> None:
    layout = _layout(
        vision=ModulePlacement(ranks=[0]), language=ModulePlacement(ranks=range(2, 4), dp=2)
    )
    with pytest.raises(
        ValueError, match=r"rank 1 is not in any module \(ranks without a module: \[1\]\)"
    ):
        layout.validate(world_size=4)


def test_uncovered_rank_between_modules_is_fixed_by_extending_a_module() -> None:
    # Modules on {0, 1} and {3} in a world of 4: launching 3 ranks would drop rank 3.
    layout = _layout(
        vision=ModulePlacement(ranks=range(0, 2), dp=2), language=ModulePlacement(ranks=[3])
    )
    with pytest.raises(ValueError) as info:
        layout.validate(world_size=4)
    message = str(info.value)
    assert message == (
        "rank 2 is not in any module (ranks without a module: [2]); every rank must run a "
        "module: rank 2 comes before the last module rank (3, module 'language'), so launching "
        "fewer ranks would drop module ranks; extend a module's rank range to cover rank 2 (or "
        "shift the modules above it down)"
    )
    assert "launch" not in message.replace("launching fewer", "")


def test_grids_must_cover_the_world() -> None:
    # Only trailing ranks are idle: launching fewer ranks is the fix.
    layout = _layout(vision=ModulePlacement(ranks=[0]), language=ModulePlacement(ranks=[1]))
    with pytest.raises(ValueError) as info:
        layout.validate(world_size=4)
    assert str(info.value) == (
        "rank 2 is not in any module (ranks without a module: [2, 3]); every rank must run a "
        "module: launch 2 ranks (the modules use ranks 0-1) or extend a module's ranks to "
        "cover ranks [2, 3]"
    )


def test_gap_and_trailing_ranks_get_both_fixes() -> None:
    layout = _layout(
        vision=ModulePlacement(ranks=[0]), language=ModulePlacement(ranks=range(2, 4), dp=2)
    )
    with pytest.raises(ValueError) as info:
        layout.validate(world_size=5)
    message = str(info.value)
    assert "ranks without a module: [1, 4]" in message
    assert "extend a module's rank range to cover rank 1" in message
    assert message.endswith("and launch 4 ranks or also cover rank 4")


def test_module_beyond_the_world_is_refused() -> None:
    layout = _layout(
        vision=ModulePlacement(ranks=range(0, 2), dp=2),
        language=ModulePlacement(ranks=range(2, 4), tp=2),
    )
    with pytest.raises(
        ValueError, match="module 'language' uses ranks 2-3 but the world has only 2 ranks"
    ):
        layout.validate(world_size=2)


def test_rank_in_two_modules_is_refused_in_a_non_colocated_layout() -> None:
    layout = _layout(
        vision=ModulePlacement(ranks=range(0, 2), dp=2),
        language=ModulePlacement(ranks=range(1, 4), dp=3),
    )
    assert not layout.is_colocated
    with pytest.raises(
        ValueError,
        match=r"rank 1 is in two modules: 'vision' \(ranks 0-1\), 'language' \(ranks 1-3\).*grids must not overlap",
    ):
        layout.validate(world_size=4)


def test_overlapping_grids_with_three_modules_are_refused() -> None:
    layout = _layout(
        vision=ModulePlacement(ranks=range(0, 2), dp=2),
        audio=ModulePlacement(ranks=range(0, 2), dp=2),
        language=ModulePlacement(ranks=range(2, 4), dp=2),
    )
    with pytest.raises(ValueError, match="rank 0 is in two modules"):
        layout.validate(world_size=4)


def test_colocated_modules_must_share_tp_and_dp() -> None:
    good = _layout(
        vision=ModulePlacement(ranks=range(0, 2), dp=2),
        language=ModulePlacement(ranks=range(0, 2), dp=2),
    )
    assert good.is_colocated
    good.validate(world_size=2)
    bad = _layout(
        vision=ModulePlacement(ranks=range(0, 2), dp=2),
        language=ModulePlacement(ranks=range(0, 2), tp=2),
    )
    with pytest.raises(ValueError, match=r"colocated modules .* must share tp and dp"):
        bad.validate(world_size=2)


def test_pipeline_and_context_parallel_are_refused() -> None:
    layout = _layout(
        vision=ModulePlacement(ranks=[0]),
        language=ModulePlacement(ranks=range(1, 3), pp=2),
    )
    with pytest.raises(ValueError, match=r"module 'language': pp=2 is not supported .* set pp=1"):
        layout.validate(world_size=3)


def test_batch_sizes_must_divide_every_module_dp() -> None:
    layout = _layout(
        vision=ModulePlacement(ranks=range(0, 4), dp=4),
        language=ModulePlacement(ranks=range(4, 6), dp=2),
    )
    assert layout.validate_batch_sizes(16, 8) == 2
    with pytest.raises(
        ValueError,
        match="micro_batch_size=6 is not divisible by module 'vision''s data-parallel size 4",
    ):
        layout.validate_batch_sizes(12, 6)
    with pytest.raises(
        ValueError, match="global_batch_size=12 is not a multiple of micro_batch_size=8"
    ):
        layout.validate_batch_sizes(12, 8)
    with pytest.raises(ValueError, match="micro_batch_size must be a positive integer, got 0"):
        layout.validate_batch_sizes(8, 0)


def test_module_order_is_by_first_rank_whatever_the_insertion_order() -> None:
    a = MimoLayout(
        {"language": ModulePlacement(ranks=[2]), "vision": ModulePlacement(ranks=range(0, 2))}
    )
    b = MimoLayout(
        {"vision": ModulePlacement(ranks=range(0, 2)), "language": ModulePlacement(ranks=[2])}
    )
    assert list(a.modules) == list(b.modules) == ["vision", "language"]
    assert a.encoder_modules == ["vision"]
    assert a.world_size == 3
