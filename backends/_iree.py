"""IREE backend: compiles the StableHLO of `jax.export` artifacts on the worker, for its device.

XLA runs a graph only where a JAX plugin serves the device. IREE compiles the
same StableHLO for CPUs (llvm-cpu), Vulkan GPUs of any vendor (vulkan-spirv),
Apple GPUs (metal-spirv), NVIDIA (cuda) and AMD (rocm). The worker still runs
nothing but StableHLO it compiled itself: the artifact is deserialized with
`jax.export` (no model code, no pickle), its module text handed to IREE's
compiler, and the compiled module (native code) kept in an on-disk cache keyed
by the module's hash, the target and IREE's version.

What can go wrong: IREE is not installed (`BackendUnavailable` names the extra),
the device's driver is missing (`BackendUnavailable`), or the graph holds an
op IREE cannot compile for the target (`GraphError` naming the op, parsed from
the compiler's diagnostics).
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ._base import (
    Axis,
    Backend,
    BackendInfo,
    BackendUnavailable,
    GraphError,
    LoadedGraph,
    deserialize,
)
from ._host import cgroup_cpu_quota as cgroup_cpu_quota  # re-exported: tests read it here
from ._host import cpu_cores, host_cpu, host_memory
from ._iree_arrays import to_host_array
from ._vouch import vouch

INSTALL_HINT = "pip install 'pcp-tui[iree]'"
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class IreeTarget:
    """How IREE serves one platform: its compiler backend, runtime driver and extra flags."""

    compiler_backend: str  # --iree-hal-target-device / target_backends
    driver: str  # iree.runtime driver name
    flags: tuple[str, ...] = ()


TARGETS: dict[str, IreeTarget] = {
    "cpu": IreeTarget("llvm-cpu", "local-task", ("--iree-llvmcpu-target-cpu=host",)),
    "vulkan": IreeTarget("vulkan-spirv", "vulkan"),
    "metal": IreeTarget("metal-spirv", "metal"),
    "cuda": IreeTarget("cuda", "cuda"),
    "rocm": IreeTarget("rocm", "hip"),
}
# The jax.export lowering whose StableHLO IREE compiles: the CPU one is free of
# GPU custom calls and of per-platform branches, and IREE retargets it anywhere.
SOURCE_PLATFORM = "cpu"

_OP_ERROR = re.compile(r"error: '([\w.]+)' op ([^\n]*)")
_ILLEGAL_OP = re.compile(r"error: failed to legalize operation '([\w.]+)'")
_CALL_TARGET = re.compile(r'call_target_name = "([^"]+)"')
_ANY_ERROR = re.compile(r"error: ([^\n]*)")
_SCATTER = re.compile(r'"stablehlo\.scatter"\([^\n]*')
_LOCATION_ALIAS = re.compile(r"^#loc\d* = $\n?", re.MULTILINE)  # what is left of `#loc3 = loc(...)`


def compile_problem(diagnostics: str) -> str:
    """The first error of IREE's compiler output, naming the op, short enough for a person."""
    illegal = _ILLEGAL_OP.search(diagnostics)
    if illegal:
        op = illegal.group(1)
        target = _CALL_TARGET.search(diagnostics, illegal.end())
        called = f" {target.group(1)!r}" if target and op.endswith("custom_call") else ""
        return f"op {op}{called} has no IREE lowering (export the graph without it)"
    match = _OP_ERROR.search(diagnostics)
    if match:
        return f"op {match.group(1)}: {match.group(2).strip()[:300]}"
    match = _ANY_ERROR.search(diagnostics)
    return match.group(1).strip()[:300] if match else diagnostics.strip()[-300:]


def compile_stablehlo(text: str, target: IreeTarget, extra_flags: Sequence[str] = ()) -> bytes:
    """Compile StableHLO text into an IREE module (vmfb bytes); raises GraphError naming the op."""
    import iree.compiler as compiler

    try:
        return compiler.compile_str(
            text,
            target_backends=[target.compiler_backend],
            input_type="stablehlo",
            extra_args=[*target.flags, *extra_flags],
        )
    except compiler.CompilerToolError as exc:
        raise GraphError(compile_problem(str(exc))) from None


class IreeBackend(Backend):
    """One IREE device; graphs compile for it on first load and come from the cache after."""

    def __init__(
        self,
        platform: str,
        *,
        cache_dir: str | os.PathLike | None = None,
        flags: Sequence[str] = (),
    ):
        if platform not in TARGETS:
            raise BackendUnavailable(
                f"IREE serves no backend {platform!r}; choose one of {sorted(TARGETS)}"
            )
        try:
            import iree.compiler  # noqa: F401
            import iree.runtime as runtime
        except ImportError:
            raise BackendUnavailable(
                f"--runtime iree needs IREE's compiler and runtime: {INSTALL_HINT}"
            ) from None
        self._runtime = runtime
        self._platform = platform
        self._target = TARGETS[platform]
        if self._target.driver == "local-task":
            _unpin_cpu_workers(runtime)
        self._flags = tuple(flags)
        self._cache = Path(cache_dir) / "iree" if cache_dir else None
        try:
            self._device = runtime.get_device(self._target.driver)
        except (ValueError, RuntimeError) as exc:
            first = str(exc).splitlines()[0][:300]
            raise BackendUnavailable(
                f"IREE cannot open a {self._target.driver} device here ({first}); "
                f"install the {platform} driver (for vulkan: the Vulkan loader, e.g. libvulkan1, "
                "and the GPU vendor's driver), or run with --backend cpu"
            ) from None
        self._info = BackendInfo(
            platform=platform,
            device_kind=self._target.compiler_backend if platform == "cpu" else platform,
            device_count=1,
            memory_bytes=host_memory(),
            jax_version=_jax_version(),
            runtime="iree",
            target=self._target.compiler_backend,
        )

    @property
    def info(self) -> BackendInfo:
        return self._info

    @property
    def target(self) -> str:
        """IREE's name for what this backend compiles for, e.g. 'llvm-cpu' or 'vulkan-spirv'."""
        return self._target.compiler_backend

    def load(
        self,
        name: str,
        serialized: bytes,
        *,
        donate_argnums: Sequence[int] = (),
        own: bool = False,
    ) -> LoadedGraph:
        """Compile the artifact's StableHLO for this device (or read it from the cache);
        `own` as `Backend.load`."""
        exported = _deserialize_for_iree(name, serialized, own=own)
        module = self._module(name, exported)
        return LoadedGraph(
            name=name,
            platforms=tuple(exported.platforms),
            in_avals=tuple(exported.in_avals),
            out_avals=tuple(exported.out_avals),
            call=_IreeCall(self, exported, module),
        )

    def compiled_module(self, name: str, serialized: bytes) -> bytes:
        """The IREE module (vmfb bytes) that `load` runs for an artifact: cached, or compiled now.

        For tools that take a module file, e.g. `iree-benchmark-module`, which times
        a graph kernel by kernel on the device (benchmarks/bench_iree.py --dump-modules).
        """
        return self._module(name, _deserialize_for_iree(name, serialized))

    def _module(self, name: str, exported: Any) -> bytes:
        if SOURCE_PLATFORM not in exported.platforms:
            raise GraphError(
                f"graph {name!r} was lowered for {', '.join(exported.platforms)}; IREE compiles "
                f"the {SOURCE_PLATFORM} lowering, so the shepherd must export for {SOURCE_PLATFORM}"
            )
        text = exported.mlir_module()
        if self._platform != "cpu" and (scatters := serial_scatters(text)):
            log.warning(
                "graph %r holds %d scatter(s) with repeating indices, which IREE runs in one "
                "GPU thread: most of a step's time. Ask the shepherd to export without them "
                "(--token-lookup onehot for GPT-2)",
                name,
                scatters,
            )
        try:
            return self._compiled(text)
        except GraphError as exc:
            raise GraphError(
                f"graph {name!r} does not compile with IREE for {self.target}: {exc}"
            ) from None

    def _compiled(self, text: str) -> bytes:
        flags = [*self._target.flags, *self._flags]
        parts = [_without_locations(text), self.target, *flags, _version()]
        if any(flag.endswith("=host") for flag in flags):
            parts.append(host_cpu())  # `host` is this machine's CPU, not every cache reader's
        key = hashlib.sha256("\0".join(parts).encode()).hexdigest()
        path = self._cache / f"{key}.vmfb" if self._cache else None
        if path is not None and path.exists():
            return path.read_bytes()
        module = compile_stablehlo(text, self._target, self._flags)
        if path is not None:
            try:
                path.parent.mkdir(parents=True, exist_ok=True)
                partial = path.with_suffix(f".{os.getpid()}.part")
                partial.write_bytes(module)
                partial.replace(path)  # atomic: a concurrent reader sees all or nothing
            except OSError:
                pass  # a cache that cannot be written only costs the next start a compile
        return module

    def function(self, module: bytes, entry: str = "main") -> Any:
        """The entry function of a compiled module, in a context of its own on this device."""
        runtime = self._runtime
        config = runtime.Config(device=self._device)
        context = runtime.SystemContext(config=config)
        vm_module = runtime.VmModule.copy_buffer(context.instance, module)
        context.add_vm_module(vm_module)
        return context.modules[vm_module.name][entry]

    def to_device(
        self, arrays: Sequence[np.ndarray], axes: Sequence[Axis] | None = None
    ) -> list[Any]:
        return [self._runtime.asdevicearray(self._device, np.asarray(a)) for a in arrays]

    def to_host(self, arrays: Sequence[Any]) -> list[np.ndarray]:
        return [to_host_array(a) for a in arrays]


class _IreeCall:
    """Calls a compiled module like `jax.jit(exported.call)`: same pytrees in, same out.

    JAX drops arguments the graph does not use (`module_kept_var_idx`), and a
    multi-platform export takes the platform's index first: both are handled here.
    """

    def __init__(self, backend: IreeBackend, exported: Any, module: bytes):
        import jax

        self._jax = jax
        self._exported = exported
        self._kept = tuple(exported.module_kept_var_idx)
        self._prefix = (
            (np.asarray(exported.platforms.index(SOURCE_PLATFORM), np.int32),)
            if len(exported.platforms) > 1
            else ()
        )
        self.in_avals = tuple(exported.in_avals)  # as jax's Compiled has: the round's shape checks
        self._in_dtypes = [np.dtype(a.dtype) for a in self.in_avals]
        self._function = backend.function(module)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        leaves, tree = self._jax.tree.flatten((args, kwargs))
        if tree != self._exported.in_tree:
            raise GraphError(f"arguments {tree} do not match the graph's {self._exported.in_tree}")
        inputs = [*self._prefix, *(self._input(leaves[i], i) for i in self._kept)]
        outputs = self._function(*inputs)
        if not isinstance(outputs, tuple | list):
            outputs = (outputs,)
        return self._jax.tree.unflatten(self._exported.out_tree, list(outputs))

    def _input(self, value: Any, index: int) -> Any:
        if isinstance(value, np.ndarray | np.generic | int | float):
            return np.asarray(value, self._in_dtypes[index])
        return value  # already an IREE device array


def serial_scatters(text: str) -> int:
    """Scatters in StableHLO text that IREE must run in one thread: not marked unique_indices.

    A scatter whose indices may repeat (the gradient of a gather: an embedding
    lookup, a picked logit) cannot be split without atomics, so IREE gives it one
    workgroup of one thread; on a GPU that is thousands of dependent memory trips.
    """
    return sum("unique_indices = true" not in m.group(0) for m in _SCATTER.finditer(text))


def _deserialize_for_iree(name: str, serialized: bytes, *, own: bool = False) -> Any:
    exported = deserialize(name, serialized)
    if exported.ordered_effects or exported.unordered_effects:
        raise GraphError(f"graph {name!r} has side effects, which IREE workers do not run")
    if any(not isinstance(d, int) for a in exported.in_avals for d in a.shape):
        raise GraphError(f"graph {name!r} has symbolic shapes; export it with concrete shapes")
    if not own:
        vouch(name, exported, SOURCE_PLATFORM)  # IREE compiles the cpu lowering, for any target
    return exported


def _without_locations(text: str) -> str:
    """The module without its `loc(...)` source locations, which name the exporting script's files.

    Two exports of one graph from different call sites compile to the same code:
    the cache key ignores where the graph was traced. Quoted strings may hold
    parentheses, so they are skipped whole.
    """
    kept, at = [], 0
    while (start := text.find("loc(", at)) >= 0:
        kept.append(text[at:start])
        depth, index = 0, start + 3
        while index < len(text):
            char = text[index]
            if char == '"':
                index = text.find('"', index + 1)  # locations' strings hold no escaped quotes
                if index < 0:
                    return text
            elif char == "(":
                depth += 1
            elif char == ")":
                depth -= 1
                if depth == 0:
                    break
            index += 1
        at = index + 1
    kept.append(text[at:])
    return _LOCATION_ALIAS.sub("", "".join(kept))


def _unpin_cpu_workers(runtime: Any) -> None:
    """Run IREE's CPU device on one worker thread per core, unpinned (IREE pins them by default).

    A pinned worker whose core another program is using cannot move to an idle
    core, and each of the graph's hundreds of dispatches waits for its slowest
    tile: on a loaded 2-core box pinned workers ran at 0.2-0.5x XLA's speed, unpinned
    ones at 0.7-1.5x, median 1.1x (docs/performance.md, section 7).
    IREE's runtime flags are process-wide and read once, when the first CPU device
    is created; a topology set in IREE's own IREE_PY_RUNTIME_FLAGS is left alone.
    """
    if "--task_topology" in os.environ.get("IREE_PY_RUNTIME_FLAGS", ""):
        return
    runtime.flags.parse_flags(f"--task_topology_group_count={cpu_cores()}")


def _jax_version() -> str:
    import jax

    return jax.__version__


def _version() -> str:
    """IREE's version: part of the cache key, and what the hello reports."""
    from importlib import metadata

    try:
        return f"iree {metadata.version('iree-base-compiler')}"
    except metadata.PackageNotFoundError:
        return "iree"
