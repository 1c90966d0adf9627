"""Stand-ins, in the training process, for writers that run in the metric writer process.

:class:`RemoteWriter` is the :class:`~bridge.logging.MetricWriter` of one backend of a
:class:`~bridge.logging._writer_process.WriterProcess`; its :attr:`~RemoteWriter.backend`
is a proxy with the methods megatron-core's MoE / MTP helpers and
:func:`bridge.logging.build_moe_metric_writer` call (``wandb_writer.log(dict, step)``,
``mlflow.log_metrics(dict, step=)``, ``experiment.log_metrics(dict, step=)``) and a few
more. A proxy call is queued like a record and runs in the writer process, in order with
the records; it returns ``None``. Anything else raises ``AttributeError`` saying how to
get the real object (``LoggerConfig.metrics_writer_mode="inline"``).
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

from bridge.logging._writer_process import WriterProcess
from bridge.logging.backends import MetricWriter, check_table, to_scalar


class _BackendProxy:
    """Forwards the listed methods of a backend object to the writer process."""

    _kind: ClassVar[str] = ""
    _real: ClassVar[str] = ""

    def __init__(self, process: WriterProcess) -> None:
        self._process = process

    def _call(self, method: str, *args: Any, **kwargs: Any) -> None:
        self._process.call(self._kind, method, args, kwargs)

    @property
    def info(self) -> dict[str, Any]:
        """What the writer process reported about the run (ids, directories)."""
        return dict(self._process.info.get(self._kind, {}))

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        methods = sorted(
            n for n in dir(type(self)) if not n.startswith("_") and callable(getattr(type(self), n))
        )
        raise AttributeError(
            f"{type(self).__name__} has no {name!r}: the {self._real} lives in the metric "
            f"writer process (LoggerConfig.metrics_writer_mode='process'), which forwards "
            f"only {', '.join(methods)}. Set logger.metrics_writer_mode=inline to use the "
            f"{self._real} itself"
        )

    def __repr__(self) -> str:
        return f"<{type(self).__name__} in writer process {self._process.pid}>"


class RemoteWandbRun(_BackendProxy):
    """The W&B run of the writer process, as far as the training loop uses it."""

    _kind = "wandb"
    _real = "wandb Run"

    def log(
        self, data: Mapping[str, Any], step: int | None = None, commit: bool | None = None
    ) -> None:
        """``run.log(data, step=step, commit=commit)`` in the writer process."""
        self._call("log", dict(data), step=step, commit=commit)

    def define_metric(self, name: str, **kwargs: Any) -> None:
        """``run.define_metric(name, **kwargs)`` in the writer process."""
        self._call("define_metric", name, **kwargs)

    @property
    def id(self) -> str | None:
        """The run id."""
        return self.info.get("id")

    @property
    def name(self) -> str | None:
        """The run name."""
        return self.info.get("name")

    @property
    def project(self) -> str | None:
        """The project."""
        return self.info.get("project")

    @property
    def dir(self) -> str | None:
        """The run's local files directory."""
        return self.info.get("dir")


class RemoteMlflow(_BackendProxy):
    """The ``mlflow`` module of the writer process, acting on its run."""

    _kind = "mlflow"
    _real = "mlflow module"

    def log_metric(
        self, key: str, value: float, step: int | None = None, timestamp: int | None = None
    ) -> None:
        """``mlflow.log_metric(...)`` on the writer's run."""
        self._call("log_metric", key=key, value=value, step=step, timestamp=timestamp)

    def log_metrics(
        self, metrics: Mapping[str, float], step: int | None = None, timestamp: int | None = None
    ) -> None:
        """``mlflow.log_metrics(...)`` on the writer's run."""
        self._call("log_metrics", metrics=dict(metrics), step=step, timestamp=timestamp)

    def log_param(self, key: str, value: Any) -> None:
        """``mlflow.log_param(key, value)`` on the writer's run."""
        self._call("log_param", key=key, value=value)

    def log_params(self, params: Mapping[str, Any]) -> None:
        """``mlflow.log_params(params)`` on the writer's run."""
        self._call("log_params", params=dict(params))

    def set_tag(self, key: str, value: Any) -> None:
        """``mlflow.set_tag(key, value)`` on the writer's run."""
        self._call("set_tag", key=key, value=value)

    def set_tags(self, tags: Mapping[str, Any]) -> None:
        """``mlflow.set_tags(tags)`` on the writer's run."""
        self._call("set_tags", tags=dict(tags))

    @property
    def run_id(self) -> str | None:
        """The run's id."""
        return self.info.get("run_id")

    @property
    def tracking_uri(self) -> str | None:
        """The tracking URI."""
        return self.info.get("tracking_uri")


class RemoteCometExperiment(_BackendProxy):
    """The Comet experiment of the writer process."""

    _kind = "comet"
    _real = "Comet experiment"

    def log_metric(
        self, name: str, value: Any, step: int | None = None, epoch: int | None = None
    ) -> None:
        """``experiment.log_metric(...)`` in the writer process."""
        self._call("log_metric", name, value, step=step, epoch=epoch)

    def log_metrics(
        self,
        dic: Mapping[str, Any],
        prefix: str | None = None,
        step: int | None = None,
        epoch: int | None = None,
    ) -> None:
        """``experiment.log_metrics(...)`` in the writer process."""
        self._call("log_metrics", dict(dic), prefix=prefix, step=step, epoch=epoch)

    def log_parameter(self, name: str, value: Any, step: int | None = None) -> None:
        """``experiment.log_parameter(...)`` in the writer process."""
        self._call("log_parameter", name, value, step=step)

    def log_parameters(
        self, parameters: Mapping[str, Any], prefix: str | None = None, step: int | None = None
    ) -> None:
        """``experiment.log_parameters(...)`` in the writer process."""
        self._call("log_parameters", dict(parameters), prefix=prefix, step=step)

    def log_other(self, key: str, value: Any) -> None:
        """``experiment.log_other(key, value)`` in the writer process."""
        self._call("log_other", key, value)

    def log_others(self, dictionary: Mapping[str, Any]) -> None:
        """``experiment.log_others(dictionary)`` in the writer process."""
        self._call("log_others", dict(dictionary))

    def add_tag(self, tag: str) -> None:
        """``experiment.add_tag(tag)`` in the writer process."""
        self._call("add_tag", tag)

    def add_tags(self, tags: Sequence[str]) -> None:
        """``experiment.add_tags(tags)`` in the writer process."""
        self._call("add_tags", list(tags))

    def set_name(self, name: str) -> None:
        """``experiment.set_name(name)`` in the writer process."""
        self._call("set_name", name)

    @property
    def offline(self) -> bool | None:
        """Whether the experiment writes an offline archive."""
        return self.info.get("offline")


_PROXIES: dict[str, type[_BackendProxy]] = {
    "wandb": RemoteWandbRun,
    "mlflow": RemoteMlflow,
    "comet": RemoteCometExperiment,
}


class RemoteWriter(MetricWriter):
    """One backend of a writer process, seen from the training process.

    Values are turned into floats (and bad ones rejected) here; writing happens in the
    writer process. Closing the last open ``RemoteWriter`` of a process closes the process.
    Build them with :func:`remote_writers` (one subclass per kind, so ``kind`` is the
    backend's).

    Args:
        process: The writer process holding a writer of this class's ``kind``.
    """

    kind = "remote"

    def __init__(self, process: WriterProcess) -> None:
        if self.kind not in process.kinds:
            raise ValueError(f"the writer process has no {self.kind!r} writer ({process.kinds})")
        self.process = process
        proxy = _PROXIES.get(self.kind)
        self._backend: Any = proxy(process) if proxy is not None else None
        self._closed = False

    @property
    def backend(self) -> Any:
        """The proxy of the backend object (``None`` for custom kinds)."""
        return self._backend

    @property
    def info(self) -> dict[str, Any]:
        """What the writer process reported about the run (ids, directories)."""
        return dict(self.process.info.get(self.kind, {}))

    def add_scalar(self, tag: str, value: Any, step: int) -> None:
        """Queue one scalar."""
        self.log_metrics({tag: value}, step)

    def log_metrics(self, metrics: Mapping[str, Any], step: int) -> None:
        """Queue ``metrics`` at ``step`` for this backend."""
        if metrics:
            values = {t: to_scalar(t, v) for t, v in metrics.items()}
            self.process.send_metrics(values, step, (self.kind,))

    def log_table(
        self, tag: str, columns: Sequence[str], rows: Sequence[Sequence[str]], step: int
    ) -> None:
        """Queue a table for this backend (checked here, written by the writer process)."""
        header, body = check_table(tag, columns, rows)
        self.process.send_table((self.kind,), tag, header, body, step)

    def flush(self) -> None:
        """Wait until the writer process has written and flushed everything sent so far."""
        self.process.flush()
        self.flush_local()

    def flush_local(self) -> None:
        """Flush what this writer holds in the training process (nothing, by default)."""

    def close(self) -> None:
        """Stop writing to this backend; the process closes with its last writer."""
        if not self._closed:
            self._closed = True
            self.process.release(self.kind)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.process!r})"


class RemoteTensorBoardWriter(RemoteWriter):
    """The TensorBoard writer of a writer process, seen from the training process.

    Records are written to the event files by the writer process. :attr:`backend` is a
    real ``torch.utils.tensorboard.SummaryWriter`` of the same directory, made in this
    process on first access, for code that writes to it directly (megatron-core's MoE
    helpers, ``process_non_loss_data_func``): its events go to a file of their own in that
    directory, which TensorBoard reads together with the writer process's.
    """

    kind = "tensorboard"

    def __init__(self, process: WriterProcess) -> None:
        super().__init__(process)
        self._summary_writer: Any = None

    @property
    def backend(self) -> Any:
        """The in-process ``SummaryWriter`` (``None`` once closed)."""
        if self._summary_writer is None and not self._closed:
            from torch.utils.tensorboard import SummaryWriter

            info = self.info
            self._summary_writer = SummaryWriter(
                log_dir=info["log_dir"], max_queue=int(info.get("queue_size", 1000))
            )
        return self._summary_writer

    def flush_local(self) -> None:
        """Flush the in-process ``SummaryWriter``, if it was made."""
        if self._summary_writer is not None:
            self._summary_writer.flush()

    def close(self) -> None:
        """Close the in-process ``SummaryWriter``, then stop writing to this backend."""
        if self._summary_writer is not None and not self._closed:
            self._summary_writer.close()
        super().close()


_SPECIAL: dict[str, type[RemoteWriter]] = {"tensorboard": RemoteTensorBoardWriter}


@functools.cache
def _remote_class(kind: str) -> type[RemoteWriter]:
    if kind in _SPECIAL:
        return _SPECIAL[kind]
    name = f"Remote{kind.title().replace('_', '')}Writer"
    return type(name, (RemoteWriter,), {"kind": kind, "__module__": __name__})


def remote_writers(process: WriterProcess) -> list[RemoteWriter]:
    """One :class:`RemoteWriter` per writer of ``process``, in its order."""
    return [_remote_class(kind)(process) for kind in process.kinds]
