"""The user-level description of where each module of a MIMO model runs.

A :class:`MimoLayout` maps module names to a :class:`ModulePlacement`: a contiguous range
of global ranks and the parallel sizes of the module on those ranks. It is plain data,
checked without any process group, so every mistake is reported before a group or a model
is built::

    layout = MimoLayout(
        {
            "vision": ModulePlacement(ranks=range(0, 2), dp=2),
            "language": ModulePlacement(ranks=range(2, 4), tp=2),
        }
    )
    layout.validate(world_size=4)

Rank order inside a module follows megatron-core (tensor-parallel fastest, then context,
data and pipeline parallel), so the ranks of data-parallel replica ``d`` are
``ranks[d * tp * cp : (d + 1) * tp * cp]`` when ``pp == 1``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

__all__ = ["LANGUAGE_MODULE_KEY", "MimoLayout", "ModulePlacement"]

# megatron-core's MimoModel keys the language model by this fixed name
# (megatron.core.models.mimo.config.role.MIMO_LANGUAGE_MODULE_KEY).
LANGUAGE_MODULE_KEY = "language"


def _ranks_text(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {ranks}"


def _as_rank_range(ranks: Iterable[int] | range) -> range:
    values = list(ranks)
    if not values:
        raise ValueError("ModulePlacement.ranks is empty; give at least one rank")
    if any(not isinstance(r, int) or isinstance(r, bool) for r in values):
        raise ValueError(f"ModulePlacement.ranks must hold integers, got {values}")
    start = values[0]
    if start < 0:
        raise ValueError(f"ModulePlacement.ranks must be non-negative, got {values}")
    expected = list(range(start, start + len(values)))
    if values != expected:
        raise ValueError(
            f"ModulePlacement.ranks must be a contiguous ascending range (a megatron-core "
            f"HyperCommGrid spans rank_offset .. rank_offset + size - 1), got {values}; "
            f"use e.g. range({start}, {start + len(values)})"
        )
    return range(start, start + len(values))


@dataclass(frozen=True)
class ModulePlacement:
    """Where one module runs and how it is parallelised there.

    Args:
        ranks: Contiguous ascending global ranks the module runs on (a ``range`` or a list).
        tp: Tensor-parallel size.
        dp: Data-parallel size. ``None`` derives it as ``len(ranks) // (tp * cp * pp)``.
        cp: Context-parallel size. Only 1 is supported by the cross-module data path.
        pp: Pipeline-parallel size. Only 1 is supported by the cross-module data path.

    Raises:
        ValueError: A size is not a positive integer, ``ranks`` is not contiguous, or
            ``tp * cp * dp * pp`` differs from the number of ranks.
    """

    ranks: range | Sequence[int]
    tp: int = 1
    dp: int | None = None
    cp: int = 1
    pp: int = 1

    def __post_init__(self) -> None:
        object.__setattr__(self, "ranks", _as_rank_range(self.ranks))
        for name in ("tp", "cp", "pp"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"ModulePlacement.{name} must be an integer >= 1, got {value!r}")
        model_parallel = self.tp * self.cp * self.pp
        if self.dp is None:
            if len(self.ranks) % model_parallel:
                raise ValueError(
                    f"ModulePlacement: {len(self.ranks)} ranks {self._span()} are not divisible "
                    f"by tp*cp*pp = {self.tp}*{self.cp}*{self.pp} = {model_parallel}"
                )
            object.__setattr__(self, "dp", len(self.ranks) // model_parallel)
        dp = self.dp
        if not isinstance(dp, int) or isinstance(dp, bool) or dp < 1:
            raise ValueError(f"ModulePlacement.dp must be an integer >= 1, got {dp!r}")
        if model_parallel * dp != len(self.ranks):
            raise ValueError(
                f"ModulePlacement: tp*cp*dp*pp = {self.tp}*{self.cp}*{dp}*{self.pp} = "
                f"{model_parallel * dp} but the module has {len(self.ranks)} ranks "
                f"{self._span()}; make the product equal the number of ranks"
            )

    def _span(self) -> str:
        return f"{self.rank_range.start}-{self.rank_range.stop - 1}"

    @property
    def rank_range(self) -> range:
        """The module's global ranks as a ``range``."""
        assert isinstance(self.ranks, range)  # normalised in __post_init__
        return self.ranks

    @property
    def dp_size(self) -> int:
        """The data-parallel size (``dp`` after derivation)."""
        assert self.dp is not None  # set in __post_init__
        return self.dp

    @property
    def size(self) -> int:
        """Number of ranks of the module."""
        return len(self.ranks)

    @property
    def rank_offset(self) -> int:
        """First global rank of the module."""
        return self.rank_range.start

    @property
    def grid_shape(self) -> list[int]:
        """Shape of the module's HyperCommGrid, in :attr:`grid_dim_names` order."""
        return [self.tp, self.cp, self.dp_size, self.pp]

    @property
    def grid_dim_names(self) -> list[str]:
        """Dimension names of the module's HyperCommGrid (megatron order tp-cp-dp-pp)."""
        return ["tp", "cp", "dp", "pp"]

    def replica_ranks(self, dp_rank: int) -> tuple[int, ...]:
        """Global ranks of data-parallel replica ``dp_rank`` (tensor-parallel rank order).

        Args:
            dp_rank: Index of the replica, ``0 <= dp_rank < dp``.

        Returns:
            The replica's ranks; the first is its tensor-parallel rank 0 (its leader).

        Raises:
            ValueError: ``dp_rank`` is out of range, or ``pp``/``cp`` is not 1.
        """
        if not 0 <= dp_rank < self.dp_size:
            raise ValueError(f"dp_rank must be in [0, {self.dp_size}), got {dp_rank}")
        if self.pp != 1 or self.cp != 1:
            raise ValueError("replica_ranks supports pp == 1 and cp == 1 only")
        start = self.rank_offset + dp_rank * self.tp
        return tuple(range(start, start + self.tp))

    def coordinates(self, rank: int) -> dict[str, int]:
        """Grid coordinates (tp, cp, dp, pp index) of a global rank in this module.

        Raises:
            ValueError: The rank is not one of the module's ranks.
        """
        if rank not in self.rank_range:
            raise ValueError(f"rank {rank} is not in this module's ranks {self._span()}")
        local = rank - self.rank_offset
        coords = {}
        for name, size in zip(self.grid_dim_names, self.grid_shape, strict=True):
            coords[name] = local % size
            local //= size
        return coords


class MimoLayout:
    """Placement of every module of a MIMO model.

    Two layouts are supported: *non-colocated* (every module on its own disjoint ranks, each
    rank runs exactly one module: encoders send embeddings to the language model) and
    *colocated* (every module on the same ranks with the same parallel sizes: the model runs
    whole on each rank).

    Args:
        modules: Module name -> placement. Must contain the language model under
            ``language_module`` and at least one other (encoder) module.
        language_module: Name of the language model. megatron-core's ``MimoModel`` uses the
            fixed key ``"language"``.

    Raises:
        ValueError: ``modules`` is empty, lacks the language model or an encoder, or holds a
            value that is not a :class:`ModulePlacement`.
    """

    def __init__(
        self,
        modules: Mapping[str, ModulePlacement],
        language_module: str = LANGUAGE_MODULE_KEY,
    ) -> None:
        if not modules:
            raise ValueError("MimoLayout.modules is empty; give the language model and encoders")
        for name, placement in modules.items():
            if not isinstance(name, str) or not name:
                raise ValueError(f"MimoLayout module names must be non-empty strings, got {name!r}")
            if not isinstance(placement, ModulePlacement):
                raise ValueError(
                    f"MimoLayout.modules[{name!r}] must be a ModulePlacement, got "
                    f"{type(placement).__name__}"
                )
        if language_module not in modules:
            raise ValueError(
                f"MimoLayout has no language module {language_module!r} (modules: "
                f"{sorted(modules)}); add it or set language_module to its name"
            )
        if len(modules) < 2:
            raise ValueError(
                f"MimoLayout needs at least one encoder module besides {language_module!r}"
            )
        # Grids are created collectively in this order on every rank: sort so that two
        # ranks that built the mapping in different insertion orders still agree.
        self.modules: dict[str, ModulePlacement] = dict(
            sorted(modules.items(), key=lambda item: (item[1].rank_offset, item[0]))
        )
        self.language_module = language_module

    def __repr__(self) -> str:
        return f"MimoLayout({self.modules!r}, language_module={self.language_module!r})"

    @property
    def encoder_modules(self) -> list[str]:
        """Names of the non-language modules, in grid-creation order."""
        return [name for name in self.modules if name != self.language_module]

    @property
    def is_colocated(self) -> bool:
        """Whether every module spans the same ranks."""
        spans = {placement.rank_range for placement in self.modules.values()}
        return len(spans) == 1

    @property
    def world_size(self) -> int:
        """Number of ranks the layout covers (highest rank + 1)."""
        return max(p.rank_range.stop for p in self.modules.values())

    def modules_of_rank(self, rank: int) -> list[str]:
        """Names of the modules that run on global ``rank``."""
        return [name for name, p in self.modules.items() if rank in p.rank_range]

    def validate(self, world_size: int) -> None:
        """Check the layout against a world of ``world_size`` ranks.

        Checks, each failing with a message that names the rank or module: no module uses a
        rank outside the world; every rank runs a module (no stub ranks); in a non-colocated
        layout no rank runs two modules (no overlapping grids); in a colocated layout all
        modules use the same parallel sizes; pipeline and context parallelism are 1.

        Args:
            world_size: Number of ranks of the job.

        Raises:
            ValueError: The layout does not fit the world.
        """
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        for name, p in self.modules.items():
            if p.rank_range.stop > world_size:
                raise ValueError(
                    f"module {name!r} uses ranks {p.rank_range.start}-{p.rank_range.stop - 1} but the "
                    f"world has only {world_size} ranks (0-{world_size - 1}); launch with "
                    f"{p.rank_range.stop} ranks or move the module"
                )
            for dim in ("pp", "cp"):
                if getattr(p, dim) != 1:
                    raise ValueError(
                        f"module {name!r}: {dim}={getattr(p, dim)} is not supported by "
                        f"bridge-mimo (one pipeline stage and no context parallelism per "
                        f"module); set {dim}=1"
                    )
        uncovered = [r for r in range(world_size) if not self.modules_of_rank(r)]
        if uncovered:
            raise ValueError(self._uncovered_message(uncovered, world_size))
        if self.is_colocated:
            shapes = {name: (p.tp, p.dp_size) for name, p in self.modules.items()}
            if len(set(shapes.values())) != 1:
                desc = ", ".join(f"{n!r}: tp={t} dp={d}" for n, (t, d) in shapes.items())
                raise ValueError(
                    f"colocated modules (all on the same ranks) must share tp and dp, got "
                    f"{desc}; megatron-core's colocated communicator for differing layouts "
                    f"is not supported here: use the same tp/dp, or give each module its "
                    f"own ranks (non-colocated)"
                )
            return
        for rank in range(world_size):
            names = self.modules_of_rank(rank)
            if len(names) > 1:
                spans = ", ".join(
                    f"{n!r} (ranks {self.modules[n].rank_range.start}-{self.modules[n].rank_range.stop - 1})"
                    for n in names
                )
                raise ValueError(
                    f"rank {rank} is in two modules: {spans}. In a non-colocated layout each "
                    f"rank runs exactly one module (grids must not overlap); give the modules "
                    f"disjoint rank ranges, or put every module on the same ranks (colocated)"
                )

    def _uncovered_message(self, uncovered: list[int], world_size: int) -> str:
        """The error for ranks that run no module, with a fix that keeps every module."""
        covered = [r for r in range(world_size) if r not in uncovered]
        if not covered:
            return f"no rank of the world 0-{world_size - 1} is in any module"
        last = max(covered)
        inner = [r for r in uncovered if r < last]
        trailing = [r for r in uncovered if r > last]
        head = (
            f"rank {uncovered[0]} is not in any module (ranks without a module: {uncovered}); "
            f"every rank must run a module"
        )
        if not inner:
            # Only the highest ranks are idle: a smaller world keeps every module whole.
            return (
                f"{head}: launch {last + 1} ranks (the modules use ranks 0-{last}) or extend "
                f"a module's ranks to cover {_ranks_text(trailing)}"
            )
        # Launching fewer ranks cannot help: it would cut off the modules above the gap.
        fix = (
            f"{head}: {_ranks_text(inner)} {'comes' if len(inner) == 1 else 'come'} before "
            f"the last module rank ({last}, module {self.modules_of_rank(last)[0]!r}), so "
            f"launching fewer ranks would drop module ranks; extend a module's rank range to "
            f"cover {_ranks_text(inner)} (or shift the modules above it down)"
        )
        if trailing:
            fix += f", and launch {last + 1} ranks or also cover {_ranks_text(trailing)}"
        return fix

    def validate_batch_sizes(self, global_batch_size: int, micro_batch_size: int) -> int:
        """Check batch sizes against every module's data-parallel size.

        Args:
            global_batch_size: Samples per optimizer step, over all data-parallel replicas.
            micro_batch_size: Samples per micro-batch, over all data-parallel replicas
                (each replica of a module takes ``micro_batch_size / dp`` of them).

        Returns:
            The number of micro-batches per step.

        Raises:
            ValueError: A size is not positive, or not divisible as required; the message
                names the module and both sizes.
        """
        for label, value in (
            ("global_batch_size", global_batch_size),
            ("micro_batch_size", micro_batch_size),
        ):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{label} must be a positive integer, got {value!r}")
        for name, p in self.modules.items():
            if micro_batch_size % p.dp_size:
                raise ValueError(
                    f"micro_batch_size={micro_batch_size} is not divisible by module {name!r}'s "
                    f"data-parallel size {p.dp_size}; use a multiple of {p.dp_size}"
                )
            if global_batch_size % p.dp_size:
                raise ValueError(
                    f"global_batch_size={global_batch_size} is not divisible by module "
                    f"{name!r}'s data-parallel size {p.dp_size}; use a multiple of {p.dp_size}"
                )
        if global_batch_size % micro_batch_size:
            raise ValueError(
                f"global_batch_size={global_batch_size} is not a multiple of "
                f"micro_batch_size={micro_batch_size}"
            )
        return global_batch_size // micro_batch_size
