"""What a worker agrees to run: every op of a received graph, checked before it compiles.

A `jax.export` artifact is data, but its module can name code outside the graph:
a `stablehlo.custom_call` runs whatever the local runtime registered under its
target name (jaxlib registers a Python-callback target whose `index` attribute is
looked up in a process-local table without a bound: a module that calls it
crashes the worker at an address the module chose), and infeed, outfeed, send and
recv move bytes between the graph and the host. `jax.export` refuses to serialize
host callbacks, but module bytes swapped into an honest export deserialize and
compile as well as any. So the worker walks the module it is about to compile and
refuses any op outside the dialects our exports use, any host transfer, and any
custom call whose target is not one our own exports contain.

Measured (JAX 0.10.2, `build_graphs` of the tiny GPT-2 and of GPT-2 124M, exported
for cpu, cuda and rocm, and for cpu alone as IREE workers get them): no custom call
at all; the ops are builtin, func and stablehlo ones. A graph partitioned in the
exporter (`shard_map`, sharding constraints) adds GSPMD's markers (`Sharding`,
`SPMDFullToShardShape`, `SPMDShardToFullShape`) or, under Shardy, `sdy` ops; the
cuDNN attention of `--attention cudnn` adds its two kernels, on CUDA only (an attention
forward and backward exported on an H100, JAX 0.11.2: exactly those two targets).
"""

from __future__ import annotations

from typing import Any

from ._base import GraphError

# GSPMD's partitioning markers: annotations the partitioner consumes, no code of their own
PARTITIONING_CALLS = frozenset({"Sharding", "SPMDFullToShardShape", "SPMDShardToFullShape"})
# cuDNN fused attention (forward, backward): `--attention cudnn` graphs, run only on CUDA
CUDNN_ATTENTION_CALLS = ("__cudnn$fmhaSoftmax", "__cudnn$fmhaSoftmaxBackward")
# Dialects a deserialized export holds; chlo and sdy (Shardy) lower to stablehlo or annotate it
_DIALECTS = frozenset({"builtin", "func", "stablehlo", "chlo", "sdy"})
# Ops that move data between the graph and the host: our graphs take arguments instead
_HOST_TRANSFERS = frozenset(
    {"stablehlo.infeed", "stablehlo.outfeed", "stablehlo.send", "stablehlo.recv"}
)


class UntrustedGraph(GraphError):
    """A graph calls out of itself (a custom call or host transfer our exports never contain).

    No runtime or backend runs it: whoever sent it is broken or hostile.
    """


def allowed_calls(platform: str) -> frozenset[str]:
    """The custom-call targets a graph may hold to run on `platform` (a jax.export name)."""
    if platform == "cuda":
        return PARTITIONING_CALLS | frozenset(CUDNN_ATTENTION_CALLS)
    return PARTITIONING_CALLS


def vouch(name: str, exported: Any, platform: str) -> None:
    """Raise UntrustedGraph naming the first op of `exported` that calls out of the graph.

    `exported` is a deserialized `jax.export.Exported`; its module is read as
    `jax.jit(exported.call)` reads it when it compiles, so the check covers what runs.
    """
    from jax.extend.mlir import ir
    from jax.interpreters import mlir

    allowed = allowed_calls(platform)
    refused: list[str] = []

    def visit(op: Any) -> Any:
        op = op.operation
        kind = op.name
        if kind == "stablehlo.custom_call":
            target = ir.StringAttr(op.attributes["call_target_name"]).value
            if target not in allowed:
                refused.append(f"a custom call to {target!r}")
        elif kind in _HOST_TRANSFERS:
            refused.append(f"a host transfer ({kind})")
        elif kind.partition(".")[0] not in _DIALECTS:
            refused.append(f"an op of another dialect ({kind})")
        return ir.WalkResult.INTERRUPT if refused else ir.WalkResult.ADVANCE

    with mlir.make_ir_context():
        try:
            module = exported.mlir_module(serialized=False)
        except Exception as exc:  # MLIR raises many types on bytes that are no module
            raise GraphError(f"graph {name!r} holds no readable StableHLO module: {exc}") from exc
        module.operation.walk(visit)
    if refused:
        raise UntrustedGraph(
            f"graph {name!r} holds {refused[0]}, which pcp-tui's exports for {platform} never "
            "contain: not running it (the shepherd that sent it is broken or hostile)"
        )
