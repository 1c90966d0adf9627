"""The wheels the GPU machine lacks, resolved from ``uv.lock``, and the command that fetches them.

The GPU machine (see ``/work/.library/device/KINDS.md``) has Python 3.12, torch 2.11 built
for CUDA 13 and a long list of packages, but no megatron-core, none of this project's
distributions and no network. Everything else travels with the working tree as wheels in
an ignored folder (``.whl/``), at most 64 MiB per call, and is installed there with::

    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \\
        --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site

``--no-deps`` means the list must be complete and must never name torch: the machine's own
torch (and its CUDA libraries) stays, and a second copy would not fit anyway. The plan is:

* walk ``uv.lock`` from the six workspace distributions (with the extras bridge-train's own
  requirements name, plus ``bridge-train[hf]``) for Linux x86-64, CPython 3.12;
* never carry, nor walk into, the machine's CUDA stack (:data:`EXCLUDED`: torch, triton,
  ``nvidia-*``, ``cuda-*``);
* leave out what the machine's image already has (:data:`IMAGE_PACKAGES`, read off
  KINDS.md on 2026-11-17); the acceptance run checks on the machine that the installed
  versions satisfy the distributions' requirements and reports any that do not;
* build the six workspace distributions with ``uv build`` and download the rest with
  ``pip download`` at the exact version and file the lock names, checking each file's
  sha256 against the lock.

Run from the repository root::

    python benchmarks/gpu/wheels.py                    # the plan: names, versions, sizes
    python benchmarks/gpu/wheels.py --download .whl    # build + download into .whl/

The sizes of downloaded wheels come from ``uv.lock`` (no download needed to know them);
workspace wheels are measured when built.
"""

from __future__ import annotations

import argparse
import dataclasses
import fnmatch
import hashlib
import shutil
import subprocess
import sys
import tomllib
from collections.abc import Iterable
from pathlib import Path

__all__ = [
    "EXCLUDED",
    "IMAGE_PACKAGES",
    "LIMIT_BYTES",
    "WORKSPACE",
    "WheelPlan",
    "download",
    "is_excluded",
    "main",
    "pip_download_command",
    "plan",
]

ROOT = Path(__file__).resolve().parents[2]

#: The most that travels with the working tree in one device call (the device tool's limit).
LIMIT_BYTES = 64 * 1024 * 1024

#: The six distributions of this repository, built from source.
WORKSPACE = (
    "core-utils",
    "bridge-config",
    "bridge-logging",
    "bridge-resiliency",
    "bridge-mimo",
    "bridge-train",
)

#: Extras of workspace distributions included beyond what their requirements name.
EXTRAS = {"bridge-train": ("hf",)}

#: Never carried and never walked into: the GPU machine's own torch build and CUDA stack.
EXCLUDED = ("torch", "triton", "pytorch-triton", "nvidia-*", "cuda-*")

#: Python packages the GPU machine's image holds (KINDS.md, "Python packages already
#: there", read on a machine running the image on 2026-11-17), kept as KINDS.md spells it
#: so that the two compare line by line.
IMAGE_PACKAGES = frozenset(
    """
    absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs
    botorch build certifi charset-normalizer chex click cloudpickle cmake colorama contourpy
    coverage cuda-bindings cuda-core cuda-pathfinder cuda-toolkit cupy-cuda13x cycler cython
    diffrax e3nn einops equinox etils execnet filelock flatbuffers flax fonttools formulaic
    frozenlist fsspec gpytorch grpcio h11 h5py hf-xet httpcore httpx huggingface-hub humanize
    hypothesis idna imageio iniconfig interface-meta jax jax-cuda13-pjrt jax-cuda13-plugin
    jaxlib jaxtyping jinja2 joblib kiwisolver lazy-loader lightning lightning-utilities
    linear-operator lineax llvmlite lxml markdown markdown-it-py markupsafe matplotlib mdurl
    meson ml-dtypes mpi4py mpmath msgpack multidict multipledispatch mypy-extensions nanobind
    narwhals networkx ninja numba numba-cuda numpy numpyro nvidia-cublas nvidia-cuda-cupti
    nvidia-cuda-nvrtc nvidia-cuda-runtime nvidia-cudnn-cu13 nvidia-cufft nvidia-cufile
    nvidia-curand nvidia-cusolver nvidia-cusparse nvidia-cusparselt-cu13 nvidia-ml-py
    nvidia-nccl-cu13 nvidia-nvjitlink nvidia-nvshmem-cu13 nvidia-nvtx onnx onnx-ir onnxruntime
    onnxscript opencv-python-headless optax opt-einsum opt-einsum-fx optimistix
    orbax-checkpoint packaging pandas pathspec patsy peft pillow pip pluggy portalocker
    prometheus-client propcache protobuf psutil pyarrow pybind11 py-cpuinfo pygments
    pyparsing pyproject-hooks pyre-extensions pytest pytest-benchmark pytest-cov pytest-mock
    pytest-timeout pytest-xdist python-dateutil pytorch-lightning pyyaml regex requests rich
    sacrebleu safetensors scikit-build-core scikit-image scikit-learn scipy seaborn
    sentencepiece sentence-transformers setuptools shellingham simplejson six
    sortedcontainers statsmodels sympy tabulate tensorboard tensorboard-data-server
    tensorstore threadpoolctl tifffile tiktoken timm tokenizers toolz torch torchaudio
    torchdiffeq torch-geometric torchmetrics torchvision tqdm transformers treescope triton
    typer typing-extensions typing-inspect urllib3 uvloop wadler-lindig werkzeug wheel wrapt
    xarray xxhash yarl zipp
    """.split()  # noqa: SIM905
)

# The machine a wheel must run on, for environment markers in uv.lock.
_MARKER_ENV = {
    "python_version": "3.12",
    "python_full_version": "3.12.3",
    "implementation_name": "cpython",
    "platform_python_implementation": "CPython",
    "sys_platform": "linux",
    "platform_system": "Linux",
    "platform_machine": "x86_64",
    "os_name": "posix",
    "extra": "",
}

# pip download's platform tags for the machine (the device tool's notes), newest first.
_PLATFORMS = (
    "manylinux_2_28_x86_64",
    "manylinux_2_27_x86_64",
    "manylinux_2_24_x86_64",
    "manylinux_2_17_x86_64",
    "manylinux2014_x86_64",
    "manylinux1_x86_64",
)


@dataclasses.dataclass(frozen=True)
class WheelPlan:
    """One distribution the acceptance run needs on the GPU machine.

    Attributes:
        name: Normalised distribution name (as in ``uv.lock``).
        version: The locked version.
        source: ``"workspace"`` (built here with ``uv build``), ``"download"`` (a wheel
            from the registry, carried) or ``"image"`` (the machine already has it; not
            carried).
        filename: The wheel file the lock names (downloads only).
        size: Its size in bytes from the lock (downloads only).
        sha256: Its hash from the lock (downloads only).
    """

    name: str
    version: str
    source: str
    filename: str | None = None
    size: int | None = None
    sha256: str | None = None


def _normalise(name: str) -> str:
    return name.lower().replace("_", "-").replace(".", "-")


def is_excluded(name: str) -> bool:
    """Whether ``name`` belongs to the machine's own torch / CUDA stack (never carried)."""
    return any(fnmatch.fnmatch(_normalise(name), pattern) for pattern in EXCLUDED)


def _marker_holds(marker: str | None) -> bool:
    if not marker:
        return True
    from packaging.markers import Marker

    return bool(Marker(marker).evaluate(dict(_MARKER_ENV)))


def _wheel_rank(filename: str) -> int | None:
    """How well a wheel file fits the machine (lower is better); ``None`` if it cannot run."""
    python_tag, abi_tag, platform_tag = filename[: -len(".whl")].split("-")[-3:]
    pythons = python_tag.split(".")
    if platform_tag == "any":
        return 10 if any(p in ("py3", "py312", "cp312") for p in pythons) else None
    cpython312 = "cp312" in pythons and abi_tag in ("cp312", "abi3", "none")
    stable_abi = abi_tag == "abi3" and any(p.startswith("cp3") for p in pythons)
    if not (cpython312 or stable_abi):
        return None
    for rank, platform in enumerate(_PLATFORMS):
        if platform in platform_tag.split("."):
            return rank
    return None


def _locked_wheel(package: dict[str, object]) -> tuple[str, int, str]:
    """(filename, size, sha256) of the locked wheel that runs on the machine."""
    candidates = []
    for wheel in package.get("wheels", []):  # type: ignore[attr-defined]
        filename = str(wheel["url"]).rsplit("/", 1)[-1]
        rank = _wheel_rank(filename)
        if rank is not None:
            candidates.append((rank, filename, int(wheel["size"]), str(wheel["hash"])))
    if not candidates:
        raise LookupError(
            f"uv.lock has no wheel of {package['name']} {package['version']} for CPython 3.12 "
            "on manylinux x86-64: build one here (pip wheel) and add it to the plan"
        )
    _, filename, size, digest = min(candidates)
    return filename, size, digest.removeprefix("sha256:")


def _closure(packages: dict[str, dict[str, object]]) -> dict[str, dict[str, object]]:
    """Every locked package the workspace needs on the machine.

    Excluded packages are not walked into, nor are the image's: the image brings their
    dependencies with them.
    """
    seen: dict[str, dict[str, object]] = {}
    todo: list[tuple[str, tuple[str, ...]]] = [(n, EXTRAS.get(n, ())) for n in WORKSPACE]
    while todo:
        name, extras = todo.pop()
        if is_excluded(name):
            continue
        package = packages[name]
        first = name not in seen
        seen[name] = package
        if name in IMAGE_PACKAGES and name not in WORKSPACE:
            continue
        deps: list[dict[str, object]] = list(package.get("dependencies", [])) if first else []  # type: ignore[call-overload]
        optional = package.get("optional-dependencies", {})
        for extra in extras:
            deps += optional.get(extra, [])  # type: ignore[attr-defined]
        for dep in deps:
            if not _marker_holds(dep.get("marker")):  # type: ignore[arg-type]
                continue
            todo.append((_normalise(str(dep["name"])), tuple(dep.get("extra", ()))))  # type: ignore[arg-type]
    return seen


def plan(lock_path: Path | None = None) -> list[WheelPlan]:
    """The wheels the acceptance run needs, resolved against ``uv.lock``.

    Args:
        lock_path: The lock file (default: the repository's ``uv.lock``).

    Returns:
        One entry per distribution, sorted by source then name: workspace distributions,
        downloads and packages the image already holds. Excluded packages are not listed.

    Raises:
        LookupError: A needed package has no locked wheel that runs on the machine.
    """
    lock = tomllib.loads((lock_path or ROOT / "uv.lock").read_text(encoding="utf-8"))
    packages = {_normalise(p["name"]): p for p in lock["package"]}
    entries = []
    for name, package in _closure(packages).items():
        version = str(package["version"])
        if name in WORKSPACE:
            entries.append(WheelPlan(name, version, "workspace"))
        elif name in IMAGE_PACKAGES:
            entries.append(WheelPlan(name, version, "image"))
        else:
            filename, size, digest = _locked_wheel(package)
            entries.append(WheelPlan(name, version, "download", filename, size, digest))
    order = {"workspace": 0, "download": 1, "image": 2}
    return sorted(entries, key=lambda e: (order[e.source], e.name))


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _pip() -> list[str]:
    """A pip to download with: this interpreter's, else its base interpreter's or
    ``python3``'s (a uv venv has no pip of its own)."""
    base = getattr(sys, "_base_executable", None)
    for python in (sys.executable, base, shutil.which("python3")):
        if python is None:
            continue
        probe = subprocess.run([python, "-m", "pip", "--version"], capture_output=True, check=False)
        if probe.returncode == 0:
            return [python, "-m", "pip"]
    raise RuntimeError("no pip found (neither this Python nor python3 has it)")


def pip_download_command(
    entries: Iterable[WheelPlan], directory: Path, pip: list[str] | None = None
) -> list[str]:
    """The ``pip download`` command line for the carried registry wheels.

    Args:
        entries: The plan (only ``download`` entries are named).
        directory: Where pip saves them.
        pip: The pip to run (default: ``python3 -m pip``).
    """
    command = [
        *(pip or ["python3", "-m", "pip"]),
        "download",
        "--no-deps",
        "--only-binary=:all:",
        "--python-version",
        "3.12",
        "--implementation",
        "cp",
    ]
    for platform in _PLATFORMS:
        command += ["--platform", platform]
    command += ["-d", str(directory)]
    return command + [f"{e.name}=={e.version}" for e in entries if e.source == "download"]


def download(directory: Path, entries: list[WheelPlan] | None = None) -> list[Path]:
    """Build the workspace wheels and download the others into ``directory``.

    Wheels already in ``directory`` that the plan does not name are removed (two versions
    of one distribution would stop the install on the machine).

    Args:
        directory: Where the wheels go (created; normally ``.whl`` at the repository root,
            which ``.gitignore`` ignores and the device call names in ``carry``).
        entries: The plan (default: :func:`plan`).

    Returns:
        The wheel files, sorted.

    Raises:
        RuntimeError: A build or download failed, a hash does not match the lock, or the
            total is over :data:`LIMIT_BYTES`.
    """
    entries = plan() if entries is None else entries
    directory.mkdir(parents=True, exist_ok=True)
    for stale in directory.glob("*.whl"):
        stale.unlink()
    uv = shutil.which("uv")
    if uv is None:
        raise RuntimeError("uv is not on PATH: pip install uv")
    for entry in entries:
        if entry.source == "workspace":
            subprocess.run(
                [uv, "build", "--package", entry.name, "--wheel", "--out-dir", str(directory)],
                cwd=ROOT,
                check=True,
            )
    downloads = [e for e in entries if e.source == "download"]
    if downloads:
        subprocess.run(pip_download_command(downloads, directory, _pip()), check=True)
    for entry in downloads:
        assert entry.filename is not None
        path = directory / entry.filename
        if not path.exists():
            raise RuntimeError(f"pip did not fetch {entry.filename} (the file uv.lock names)")
        if _sha256(path) != entry.sha256:
            raise RuntimeError(f"{entry.filename}: sha256 differs from uv.lock")
    wheels = sorted(directory.glob("*.whl"))
    total = sum(p.stat().st_size for p in wheels)
    if total > LIMIT_BYTES:
        raise RuntimeError(f"{total / 2**20:.1f} MiB of wheels: over the 64 MiB per call")
    return wheels


def _format(entries: list[WheelPlan]) -> str:
    lines = [f"{'distribution':28s} {'version':12s} {'source':10s} {'bytes':>10s}  file"]
    for e in entries:
        size = "" if e.size is None else str(e.size)
        lines.append(f"{e.name:28s} {e.version:12s} {e.source:10s} {size:>10s}  {e.filename or ''}")
    carried = sum(e.size or 0 for e in entries if e.source == "download")
    lines.append(f"registry wheels carried: {carried / 2**20:.2f} MiB (from uv.lock sizes)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    """Print the plan, or build and download it (``--download DIR``)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--download", metavar="DIR", type=Path, help="build and download the wheels into DIR"
    )
    args = parser.parse_args(argv)
    entries = plan()
    print(_format(entries))
    if args.download is not None:
        wheels = download(args.download, entries)
        total = sum(p.stat().st_size for p in wheels)
        print(f"{len(wheels)} wheels in {args.download}: {total / 2**20:.2f} MiB (limit 64 MiB)")


if __name__ == "__main__":
    main()
