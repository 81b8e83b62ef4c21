"""Train any JAX model: load a user's model file on the shepherd and turn it into a Workload.

`pcp-tui shepherd --model path/to/model.py:build` imports that file (the user's
own code, on the user's own machine: only the shepherd ever runs it), calls
``build(config)`` and gets a `ModelSpec`. The shepherd exports the training
graphs from it; workers receive StableHLO and row shards, never this file.

The contract, in full:

- ``init(key) -> {name: float array}``: a flat dict of the initial parameters.
- ``loss(params, batch) -> scalar``: ``batch`` is a dict of the dataset's
  arrays with a leading batch axis ``[B, ...]`` (or, with ``data=None``, an
  int32 ``[B, seq_len + 1]`` array of token windows of the ``--data`` corpus).
- ``data``: a `Dataset` of row-indexed numpy arrays (every array has the same
  leading N), or a function ``() -> Dataset``, or None for token windows.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import inspect
import sys
import traceback
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from pcp_tui.config import ConfigError, RunConfig
from pcp_tui.training import corpus
from pcp_tui.training.workload import Workload

HOLD_OUT = 0.05  # share of rows held out (every 20th) when a Dataset has no val split


class ModelFileError(Exception):
    """The user's model file raised: one line naming its file, line and the error."""


@dataclass(frozen=True)
class Dataset:
    """Row-indexed arrays: ``train={"x": x[N, ...], "y": y[N]}``; ``val`` alike (optional)."""

    train: Mapping[str, Any]
    val: Mapping[str, Any] | None = None


@dataclass(frozen=True)
class ModelSpec:
    """What a model file's ``build(config)`` returns."""

    name: str
    init: Callable[[jax.Array], Mapping[str, Any]]
    loss: Callable[[dict[str, jax.Array], Any], jax.Array]
    data: Dataset | Callable[[], Dataset] | None = None


def is_model_file(model: str) -> bool:
    """True for ``path/to/file.py:function`` (or ``path/to/file.py``, meaning ``:build``)."""
    return model.partition(":")[0].endswith(".py")


def load_spec(model: str, config: RunConfig) -> ModelSpec:
    """Import ``file.py``, call its builder with `config`.

    ConfigError says what is wrong with `model`; ModelFileError, in one line,
    what the file itself raised (a SyntaxError, or any error of its code).
    """
    path, function = model_path(model), model.partition(":")[2] or "build"
    if not path.is_file():
        raise ConfigError(f"--model {model!r}: no file {path}")
    digest = hashlib.sha256(str(path).encode()).hexdigest()[:12]
    module_spec = importlib.util.spec_from_file_location(f"pcp_tui_model_{digest}", path)
    if module_spec is None or module_spec.loader is None:  # no loader for its suffix
        raise ConfigError(f"--model {model!r}: {path.name} is not a Python file (name it .py)")
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[module_spec.name] = module  # dataclasses and pickling-free tracing look modules up
    with user_code(path, "importing it"):
        module_spec.loader.exec_module(module)
    builder = getattr(module, function, None)
    if not callable(builder):
        raise ConfigError(f"--model {model!r}: {path.name} has no function {function!r}")
    with user_code(path, f"{function}(config)"):
        spec = builder(config)
    if not isinstance(spec, ModelSpec):
        raise ConfigError(
            f"--model {model!r}: {function}(config) must return pcp_tui.ModelSpec, got {type(spec).__name__}"
        )
    return spec


def model_path(model: str) -> Path:
    """The file of ``path/to/model.py:build``, absolute (as its tracebacks name it)."""
    return Path(model.partition(":")[0]).expanduser().resolve()


@contextlib.contextmanager
def user_code(path: Path, doing: str, inputs: Callable[[], str] | None = None) -> Iterator[None]:
    """Turn an error raised while running the model file's code into a ModelFileError.

    A 40-100 line traceback through pcp-tui, trio and JAX hides the one frame
    that matters: the line of the user's file. The message names that line,
    the error's type and first line (JAX's shape errors carry the shapes) and
    `inputs()`, a description of what the code was called with.
    """
    try:
        yield
    except ModelFileError:
        raise
    except SyntaxError as exc:  # the import itself failed: there is no frame to point at
        where = f"{exc.filename or path}:{exc.lineno or 0}"
        raise ModelFileError(f"{where}: {type(exc).__name__}: {exc.msg}") from None
    except Exception as exc:  # noqa: BLE001 - any error of the user's code, reported in one line
        raise ModelFileError(_describe(exc, path, doing, inputs)) from None


def _describe(exc: Exception, path: Path, doing: str, inputs: Callable[[], str] | None) -> str:
    frames = traceback.extract_tb(exc.__traceback__)
    mine = [f for f in frames if Path(f.filename) == path]
    frame = mine[-1] if mine else None  # the innermost line of the model file
    where = f"{path}:{frame.lineno}: in {frame.name}" if frame else f"{path}: {doing}"
    lines = [line for line in str(exc).splitlines() if line.strip()]
    message = f"{where}: {type(exc).__name__}: {lines[0] if lines else ''}".rstrip(": ")
    return f"{message} ({inputs()})" if inputs else message


def _shapes(arrays: Mapping[str, Any]) -> str:
    """``x: float32[32,16], y: int32[32]``: what a loss got, for its error message."""
    return ", ".join(
        f"{name}: {np.dtype(a.dtype).name}[{','.join(map(str, a.shape))}]"
        for name, a in arrays.items()
    )


def build_custom_workload(config: RunConfig, shards: int) -> Workload:
    """The Workload of a model file: parameters, wrapped loss, row (or window) shards, eval batches."""
    spec = load_spec(config.model.name, config)
    path = model_path(config.model.name)
    with user_code(path, "init(key)"):
        params = spec.init(jax.random.PRNGKey(config.model.seed))
    if not isinstance(params, Mapping) or not params:
        raise ConfigError(f"{spec.name}: init(key) must return a non-empty flat dict of arrays")
    host_params = {}
    for name, value in params.items():
        array = np.asarray(value)
        if not isinstance(name, str) or array.dtype.kind != "f":
            raise ConfigError(
                f"{spec.name}: parameter {name!r} must be a float array under a str name, got {array.dtype}"
            )
        host_params[name] = array.astype(np.float32)
    with user_code(path, "data()"):
        source = spec.data() if callable(spec.data) else spec.data
    if source is None:
        return _window_workload(config, spec, host_params, shards, path)
    if not isinstance(source, Dataset):
        raise ConfigError(
            f"{spec.name}: data must be a pcp_tui.Dataset, a function returning one, or None"
        )
    rows = row_data(spec.name, source)
    keys = tuple(rows.train)
    first = {k: a[: config.data.batch_size] for k, a in rows.train.items()}

    def loss_fn(params: dict[str, jax.Array], batch: tuple[jax.Array, ...]) -> jax.Array:
        named = dict(zip(keys, batch, strict=True))
        with user_code(path, "loss(params, batch)", lambda: f"batch {_shapes(named)}"):
            return spec.loss(params, named)

    batch_spec = tuple(
        jax.ShapeDtypeStruct((config.data.batch_size, *a.shape[1:]), a.dtype)
        for a in first.values()
    )
    check_scalar_loss(
        spec, loss_fn, host_params, batch_spec, dict(zip(keys, batch_spec, strict=True))
    )
    return Workload(
        name=spec.name,
        params=host_params,
        loss_fn=loss_fn,
        batch_spec=batch_spec,
        corpus=rows,
        shards=corpus.split_rows(rows.train, shards),
        eval_tokens=corpus.eval_rows(
            rows.val, batch_size=config.data.batch_size, max_batches=config.evaluation.batches
        ),
        tokens_per_step=config.data.batch_size,  # a row counts as one token
        flops_per_token=6.0 * sum(p.size for p in host_params.values()),
    )


def check_scalar_loss(
    spec: ModelSpec,
    loss_fn: Callable[[dict[str, jax.Array], Any], jax.Array],
    params: Mapping[str, np.ndarray],
    batch_spec: Any,
    named: Mapping[str, Any],
) -> None:
    """Trace `loss_fn` once (shapes only): a loss that is not a scalar is a ConfigError at its def.

    Gradients exist only for a scalar; JAX's own complaint comes from deep inside
    the export as a long traceback. An error of the user's code while tracing is
    the ModelFileError `loss_fn` raises, as it would be during the export.
    """
    out = jax.eval_shape(loss_fn, dict(params), batch_spec)
    if getattr(out, "shape", None) == ():
        return
    got = (
        f"{np.dtype(out.dtype).name}[{','.join(map(str, out.shape))}]"
        if hasattr(out, "shape")
        else type(out).__name__
    )
    try:
        where = f"{inspect.getsourcefile(spec.loss)}:{inspect.getsourcelines(spec.loss)[1]}: in "
    except (TypeError, OSError):  # a builtin or a callable object: no source line to name
        where = ""
    name = getattr(spec.loss, "__name__", "loss")
    raise ConfigError(
        f"{where}{name}: the loss must be a scalar, got {got} for batch {_shapes(named)}; "
        "reduce it over the batch (e.g. jnp.mean)"
    )


def row_data(name: str, source: Dataset) -> corpus.RowData:
    """Checked train/val arrays; without val every 20th row (5%) is held out."""
    train = corpus.row_arrays(dict(source.train), f"{name}: data.train")
    if source.val is not None:
        val = corpus.row_arrays(dict(source.val), f"{name}: data.val")
        if set(val) != set(train):
            raise corpus.DataError(
                f"{name}: data.val has arrays {sorted(val)}, data.train has {sorted(train)}"
            )
    else:  # every k-th row: rows sorted by anything (a label, a date) are held out evenly
        every = max(2, min(round(1 / HOLD_OUT), corpus.row_count(train)))
        held = np.arange(every - 1, corpus.row_count(train), every)
        val = {k: a[held] for k, a in train.items()}
        train = {k: np.delete(a, held, axis=0) for k, a in train.items()}
    fingerprint = corpus.fingerprint(*train.values(), *val.values())
    return corpus.RowData(name, train, val, fingerprint)


def _window_workload(
    config: RunConfig, spec: ModelSpec, params: dict[str, np.ndarray], shards: int, path: Path
) -> Workload:
    text = corpus.load_corpus(config.data.path, max_bytes=config.data.max_bytes)

    def loss_fn(params: dict[str, jax.Array], batch: jax.Array) -> jax.Array:
        with user_code(path, "loss(params, batch)", lambda: f"batch {_shapes({'tokens': batch})}"):
            return spec.loss(params, batch)

    batch_spec = jax.ShapeDtypeStruct((config.data.batch_size, config.data.seq_len + 1), jnp.int32)
    check_scalar_loss(spec, loss_fn, params, batch_spec, {"tokens": batch_spec})
    return Workload(
        name=spec.name,
        params=params,
        loss_fn=loss_fn,
        batch_spec=batch_spec,
        corpus=text,
        shards=corpus.split_shards(text.train, shards),
        eval_tokens=corpus.eval_batches(
            text.val,
            batch_size=config.data.batch_size,
            seq_len=config.data.seq_len,
            max_batches=config.evaluation.batches,
        ),
        tokens_per_step=config.data.batch_size * config.data.seq_len,
        flops_per_token=6.0 * sum(p.size for p in params.values()),
    )
