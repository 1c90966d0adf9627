"""The global batch size of each recent iteration, from the consumed-sample counter.

With a batch-size ramp-up (``train.rampup_batch_size``) or a batch shrunk to fit the
data-parallel size, the configured ``train.global_batch_size`` is not the batch an
iteration ran. The trainer advances ``train_state.consumed_train_samples`` by the batch it
ran, so the difference between two calls of ``training_log`` is the truth.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field


@dataclass
class BatchHistory:
    """Batch sizes of the last iterations, recorded once per ``training_log`` call."""

    previous: tuple[int, int] | None = None
    """``(iteration, consumed samples)`` at the previous call."""

    sizes: deque[tuple[int, float | None]] = field(default_factory=deque)
    """``(iteration, batch size or None when unknown)``, oldest first."""

    def record(
        self,
        iteration: int,
        consumed: int,
        *,
        loaded_iteration: int,
        fallback: int | None,
        keep: int,
    ) -> float | None:
        """Record the counters after ``iteration``; return that iteration's batch size.

        The batch size is the consumed-sample increase since the previous call (per
        iteration, if several passed). The first call of a fresh run counts from zero. The
        first call of a resumed job cannot know it and returns ``fallback``.

        Args:
            iteration: ``train_state.step`` now.
            consumed: ``train_state.consumed_train_samples`` now.
            loaded_iteration: The iteration this job resumed from (0: a fresh run).
            fallback: The batch size to assume when it cannot be derived (``None``:
                unknown).
            keep: Iterations to remember (at least the throughput window).

        Returns:
            The batch size of ``iteration``, or ``None`` when unknown.
        """
        previous = self.previous
        if previous is None and loaded_iteration == 0:
            previous = (0, 0)  # a fresh run starts with nothing consumed
        if previous is not None and iteration == previous[0] and self.sizes:
            return self.sizes[-1][1]  # called again for the same iteration
        self.previous = (iteration, consumed)
        if previous is not None and iteration < previous[0]:
            self.sizes.clear()  # the counters went back (a reload): start over
        size: float | None = fallback
        first = iteration
        if previous is not None and iteration > previous[0]:
            first = previous[0] + 1
            size = (consumed - previous[1]) / (iteration - previous[0])
        for it in range(max(first, iteration - keep + 1), iteration + 1):
            self.sizes.append((it, size))
        while len(self.sizes) > keep:
            self.sizes.popleft()
        return size

    def samples_in_window(self, iteration: int, window: int) -> float | None:
        """Samples consumed by the ``window`` iterations ending at ``iteration``.

        Exact when every iteration's batch size is known; otherwise (only in the first
        window of a job resumed during a ramp-up) iterations of unknown size are taken
        at the average of the known ones.

        Returns:
            The samples, or ``None`` when no batch size of the window is known.
        """
        known = [
            size
            for it, size in self.sizes
            if iteration - window < it <= iteration and size is not None
        ]
        if not known:
            return None
        return sum(known) / len(known) * window
