"""Process-group infrastructure of a MIMO model: one HyperCommGrid per module.

:func:`build_megatron_mimo_infra` turns a :class:`~bridge.mimo.MimoLayout` into a
:class:`MegatronMIMOInfra`: a megatron-core ``HyperCommGrid`` per module and, for the modules
this rank runs, a ``ProcessGroupCollection`` built from that grid's groups. Group creation is
collective over the whole world, so every rank creates every group of every grid in the same
order (the layout's module order), whether or not it belongs to the grid.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch.distributed as dist
from megatron.core.hyper_comm_grid import HyperCommGrid
from megatron.core.process_groups_config import ProcessGroupCollection

from bridge.mimo.layout import MimoLayout, ModulePlacement

__all__ = ["MegatronMIMOInfra", "build_megatron_mimo_infra"]

# Groups created on every grid, in this order. Each entry is the list of grid dims a group
# spans; together they are what megatron-core's GPTModel, TransformerBlock, the DP gradient
# reduction and checkpointing read from a ProcessGroupCollection.
_GRID_GROUPS: tuple[tuple[str, ...], ...] = (
    ("tp",),
    ("cp",),
    ("dp",),
    ("pp",),
    ("dp", "cp"),
    ("tp", "cp"),
    ("tp", "pp"),
    ("tp", "dp", "cp"),
    ("tp", "cp", "dp", "pp"),
)


@dataclass
class MegatronMIMOInfra:
    """Per-module grids and process groups of a MIMO model, as seen from this rank.

    Attributes:
        module_to_grid_map: Module name -> its HyperCommGrid (every module, on every rank).
        topology: Module data flow: module name -> names of the modules it feeds (every
            encoder feeds the language model; the language model feeds nothing).
        pg_collections: Module name -> ProcessGroupCollection built from the module's grid,
            or ``None`` for modules this rank does not run.
        participating_modules: Names of the modules this rank runs (exactly one in a
            non-colocated layout, all of them in a colocated one).
        language_module_name: Name of the language model module.
        layout: The layout the grids were built from.
    """

    module_to_grid_map: dict[str, HyperCommGrid]
    topology: dict[str, list[str]]
    pg_collections: dict[str, ProcessGroupCollection | None]
    participating_modules: list[str]
    language_module_name: str
    layout: MimoLayout
    _destroyed: bool = field(default=False, init=False, repr=False)

    @property
    def is_colocated(self) -> bool:
        """Whether every module runs on every rank."""
        return self.layout.is_colocated

    @property
    def encoder_module_names(self) -> list[str]:
        """Names of the modules that are not the language model."""
        return [n for n in self.module_to_grid_map if n != self.language_module_name]

    def dp_size(self, module_name: str) -> int:
        """Data-parallel size of ``module_name`` (known on every rank)."""
        return self._placement(module_name).dp_size

    def tp_size(self, module_name: str) -> int:
        """Tensor-parallel size of ``module_name`` (known on every rank)."""
        return self._placement(module_name).tp

    def dp_rank(self, module_name: str) -> int:
        """This rank's data-parallel index in ``module_name``.

        Raises:
            ValueError: This rank does not run ``module_name``.
        """
        placement = self._placement(module_name)
        rank = dist.get_rank()
        if rank not in placement.rank_range:
            raise ValueError(f"rank {rank} does not run module {module_name!r}")
        return placement.coordinates(rank)["dp"]

    def tp_rank(self, module_name: str) -> int:
        """This rank's tensor-parallel index in ``module_name``.

        Raises:
            ValueError: This rank does not run ``module_name``.
        """
        placement = self._placement(module_name)
        rank = dist.get_rank()
        if rank not in placement.rank_range:
            raise ValueError(f"rank {rank} does not run module {module_name!r}")
        return placement.coordinates(rank)["tp"]

    def _placement(self, module_name: str) -> ModulePlacement:
        try:
            return self.layout.modules[module_name]
        except KeyError:
            raise KeyError(
                f"unknown module {module_name!r}; modules: {list(self.layout.modules)}"
            ) from None

    def destroy(self) -> None:
        """Destroy the process groups of every grid that this rank belongs to (idempotent)."""
        if self._destroyed:
            return
        for grid in self.module_to_grid_map.values():
            grid.destroy()
        self._destroyed = True


def _collection_from_grid(grid: HyperCommGrid) -> ProcessGroupCollection:
    pgs = ProcessGroupCollection()
    pgs.tp = grid.get_pg("tp")
    pgs.cp = grid.get_pg("cp")
    pgs.dp = grid.get_pg("dp")
    pgs.pp = grid.get_pg("pp")
    pgs.dp_cp = grid.get_pg(["dp", "cp"])
    pgs.intra_dp_cp = pgs.dp_cp
    pgs.tp_cp = grid.get_pg(["tp", "cp"])
    pgs.mp = grid.get_pg(["tp", "pp"])
    pgs.tp_dp_cp = grid.get_pg(["tp", "dp", "cp"])
    pgs.intra_dist_opt = grid.get_pg(["tp", "cp", "dp", "pp"])
    # One pipeline stage per module: no embedding groups to tie across stages.
    pgs.embd = None
    pgs.pos_embd = None
    return pgs


def build_megatron_mimo_infra(
    layout: MimoLayout,
    *,
    backend: str | None = None,
    timeout: timedelta | None = None,
) -> MegatronMIMOInfra:
    """Build the grids and process groups of ``layout``. Collective: call on every rank.

    The layout is validated against the world first (no rank left without a module, no
    overlapping grids, ...), so a bad layout fails on every rank before any group exists.

    Args:
        layout: Where each module runs.
        backend: Backend of the module groups; default: the default group's backend (gloo
            on CPU, nccl on GPU).
        timeout: Timeout of the module groups; default: torch's default.

    Returns:
        The infra for this rank.

    Raises:
        RuntimeError: torch.distributed is not initialised.
        ValueError: The layout does not fit the world (see :meth:`MimoLayout.validate`).
    """
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            "build_megatron_mimo_infra needs an initialised torch.distributed default group "
            "(torch.distributed.init_process_group, e.g. under torchrun)"
        )
    world_size = dist.get_world_size()
    layout.validate(world_size)
    if backend is None:
        backend = str(dist.get_backend())
    rank = dist.get_rank()
    kwargs: dict[str, Any] = {}
    if timeout is not None:
        kwargs["timeout"] = timeout

    grids: dict[str, HyperCommGrid] = {}
    for name, placement in layout.modules.items():
        grid = HyperCommGrid(
            shape=placement.grid_shape,
            dim_names=placement.grid_dim_names,
            rank_offset=placement.rank_offset,
            backend=backend,
        )
        for dims in _GRID_GROUPS:
            grid.create_pg(list(dims), **kwargs)
        grids[name] = grid

    pg_collections: dict[str, ProcessGroupCollection | None] = {}
    for name, grid in grids.items():
        pg_collections[name] = (
            _collection_from_grid(grid) if rank in layout.modules[name].rank_range else None
        )
    participating = [name for name, pgs in pg_collections.items() if pgs is not None]
    topology: dict[str, list[str]] = {name: [layout.language_module] for name in grids}
    topology[layout.language_module] = []
    return MegatronMIMOInfra(
        module_to_grid_map=grids,
        topology=topology,
        pg_collections=pg_collections,
        participating_modules=participating,
        language_module_name=layout.language_module,
        layout=layout,
    )
