"""Training-loop callbacks: the points a loop offers, and the list that calls them in order.

A loop built on this module owns one :class:`CallbackList`. Its own parts (a checkpointer, a
metrics processor, fault-tolerance heartbeats, ...) and the user's callbacks share the
:class:`Callback` interface, so a user extends the loop exactly the way the loop is built.
The context passed to every hook is the loop's own object (for bridge-train,
``core_utils.loop.LoopContext``); this module does not look inside it except for
an ``iteration`` attribute, which error messages quote when it exists.

Cost: a hook that no callback overrides is skipped when the list is built, so registering
callbacks that override only ``on_train_end`` adds nothing to a step.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

__all__ = ["HOOKS", "Callback", "CallbackError", "CallbackList"]

#: The hook points, in the order a run reaches them (validation and save repeat inside steps).
HOOKS: tuple[str, ...] = (
    "on_train_start",
    "on_step_start",
    "on_step_end",
    "on_validation_start",
    "on_validation_end",
    "on_save",
    "on_train_end",
)


class Callback:
    """A participant in a training loop. Every hook is a no-op until a subclass overrides it.

    Hooks run on every rank, in registration order; a hook that issues a collective must do
    so on every rank. The ``context`` argument is the loop's context object.
    """

    def on_train_start(self, context: Any) -> None:
        """Called once, after the model, optimizer and data are ready and before step 1."""

    def on_step_start(self, context: Any) -> None:
        """Called before each training step."""

    def on_step_end(self, context: Any) -> None:
        """Called after each training step; the step's result is on the context."""

    def on_validation_start(self, context: Any) -> None:
        """Called before each evaluation on the validation split."""

    def on_validation_end(self, context: Any) -> None:
        """Called after each evaluation on the validation split."""

    def on_save(self, context: Any) -> None:
        """Called after a checkpoint was written (for async saves: once it is committed)."""

    def on_train_end(self, context: Any) -> None:
        """Called once when the loop ends, normally or by an exit condition (not on a crash)."""


class CallbackError(RuntimeError):
    """A user callback raised; the message names the callback, the hook and the iteration.

    Attributes:
        callback: The callback object that raised.
        hook: The hook's name (one of :data:`HOOKS`).
        iteration: The loop's iteration at the time, if the context has one.
    """

    def __init__(self, callback: object, hook: str, iteration: int | None, cause: BaseException):
        self.callback = callback
        self.hook = hook
        self.iteration = iteration
        where = "" if iteration is None else f" at iteration {iteration}"
        super().__init__(
            f"callback {type(callback).__qualname__}.{hook} raised{where}: "
            f"{type(cause).__name__}: {cause}"
        )


def _overrides(callback: Callback, hook: str) -> bool:
    return getattr(type(callback), hook, None) is not getattr(Callback, hook)


class CallbackList:
    """The loop's ordered callbacks: ``components``, the user's ``callbacks``, then ``after``.

    An exception from a user callback is re-raised as :class:`CallbackError` (chained to the
    original) so the user sees which of their hooks failed; an exception from one of the
    loop's own components propagates unchanged, since those already say what to fix.
    ``KeyboardInterrupt`` and ``SystemExit`` always propagate unchanged.

    Args:
        components: The loop's own parts, in the order they must run.
        callbacks: The user's callbacks, run after the components at every hook.
        after: Parts of the loop that run after the user's callbacks at every hook (for
            example evaluation and checkpointing, so a callback's ``on_step_end`` sees the
            step before the iteration is evaluated and saved).

    Raises:
        TypeError: An entry is not a :class:`Callback`.
    """

    def __init__(
        self,
        components: Iterable[Callback] = (),
        callbacks: Iterable[Callback] = (),
        after: Iterable[Callback] = (),
    ) -> None:
        entries = (
            [(c, False) for c in components]
            + [(c, True) for c in callbacks]
            + [(c, False) for c in after]
        )
        for callback, _ in entries:
            if not isinstance(callback, Callback):
                raise TypeError(
                    f"{type(callback).__qualname__} is not a core_utils.Callback: subclass "
                    "core_utils.Callback (bridge.train.Callback) and override its hooks"
                )
        self.entries: tuple[Callback, ...] = tuple(c for c, _ in entries)
        self._user = frozenset(id(c) for c, user in entries if user)
        self._dispatch: dict[str, tuple[tuple[Callback, Callable[[Any], None]], ...]] = {
            hook: tuple((c, getattr(c, hook)) for c, _ in entries if _overrides(c, hook))
            for hook in HOOKS
        }

    def __len__(self) -> int:
        return len(self.entries)

    def __iter__(self) -> Any:
        return iter(self.entries)

    def has(self, hook: str) -> bool:
        """Whether any callback overrides ``hook``."""
        return bool(self._dispatch[hook])

    def fire(self, hook: str, context: Any) -> None:
        """Call ``hook`` of every callback that overrides it, in order.

        Args:
            hook: One of :data:`HOOKS`.
            context: The loop's context object.

        Raises:
            CallbackError: A user callback raised (the original is its ``__cause__``).
            KeyError: ``hook`` is not one of :data:`HOOKS`.
        """
        for callback, method in self._dispatch[hook]:
            try:
                method(context)
            except Exception as exc:
                if id(callback) not in self._user or isinstance(exc, CallbackError):
                    raise
                iteration = getattr(context, "iteration", None)
                raise CallbackError(callback, hook, iteration, exc) from exc

    def on_train_start(self, context: Any) -> None:
        """Fire ``on_train_start``."""
        self.fire("on_train_start", context)

    def on_step_start(self, context: Any) -> None:
        """Fire ``on_step_start``."""
        self.fire("on_step_start", context)

    def on_step_end(self, context: Any) -> None:
        """Fire ``on_step_end``."""
        self.fire("on_step_end", context)

    def on_validation_start(self, context: Any) -> None:
        """Fire ``on_validation_start``."""
        self.fire("on_validation_start", context)

    def on_validation_end(self, context: Any) -> None:
        """Fire ``on_validation_end``."""
        self.fire("on_validation_end", context)

    def on_save(self, context: Any) -> None:
        """Fire ``on_save``."""
        self.fire("on_save", context)

    def on_train_end(self, context: Any) -> None:
        """Fire ``on_train_end``."""
        self.fire("on_train_end", context)
