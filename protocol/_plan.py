"""The plan a worker trains from, and the `Ready` that says it compiled it.

Graph bytes and the data shard ride as tensors named here; the rules across
fields are in `pcp_tui.contract.plan`, which both sides use.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from ._enums import BatchKind, OverlapMerge, ParamLayout, Platform, Quantization, ShardingMode
from ._fields import MAX_SHARDING_RULES, TENSOR_NAME_CHARS, Body, _finite, _items, _text


@dataclass(frozen=True)
class GraphInfo:
    """One exported graph in a plan: its name, platforms, and the tensor carrying its bytes."""

    name: str = _text()
    platforms: tuple[Platform, ...] = _items(16)
    tensor: str = _text(TENSOR_NAME_CHARS)


@dataclass(frozen=True)
class ShardingRule:
    """Parameters whose names match `pattern` (fnmatch) get `layout`."""

    pattern: str = _text(TENSOR_NAME_CHARS)
    layout: ParamLayout = ParamLayout.REPLICATED


@dataclass(frozen=True)
class Sharding:
    """How a worker with several devices places parameters: the first matching rule, else `mode`."""

    mode: ShardingMode = ShardingMode.DATA
    rules: tuple[ShardingRule, ...] = _items(MAX_SHARDING_RULES)


@dataclass(frozen=True)
class Fragment:
    """Streaming DiLoCo: the tensors of one fragment, synced together."""

    tensors: tuple[str, ...] = _items("max_tensors", chars=TENSOR_NAME_CHARS)


@dataclass(frozen=True)
class Plan(Body):
    """shepherd -> worker: everything a worker needs to train, no model code.

    Graph bytes and the data shard ride as tensors named here. The rules across
    fields (token arithmetic, which tensors a result carries) are in
    `pcp_tui.contract.plan`, which both sides use.
    """

    KIND: ClassVar[str] = "plan"
    run_id: str = _text()
    model_name: str = _text()
    param_count: int = 0
    graphs: tuple[GraphInfo, ...] = _items(8)
    param_names: tuple[str, ...] = _items("max_tensors", chars=TENSOR_NAME_CHARS)
    inner_steps: int = 0
    chunk_steps: int = 0
    batch_size: int = 0
    seq_len: int = 0
    seed: int = 0
    shard_tensor: str = _text(TENSOR_NAME_CHARS)
    shard_fingerprint: str = _text()
    worker_slot: int = 0
    compression: Quantization = Quantization.NONE
    batch_kind: BatchKind = BatchKind.WINDOWS
    data_tensors: tuple[str, ...] = _items(64, chars=TENSOR_NAME_CHARS)
    tokens_per_row: int = 0
    sharding: Sharding = field(default_factory=Sharding)
    fragments: tuple[Fragment, ...] = _items("max_tensors")  # empty: plain DiLoCo
    overlap_steps: int = 0
    mix_alpha: float = _finite(0.0)
    overlap_merge: OverlapMerge = OverlapMerge.MIX


@dataclass(frozen=True)
class Ready(Body):
    """worker -> shepherd: the plan's graphs compiled; rounds may start."""

    KIND: ClassVar[str] = "ready"
    compile_seconds: float = _finite()
    platform: Platform = Platform.CPU
