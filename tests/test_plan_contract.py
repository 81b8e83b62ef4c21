"""The rules across a plan's fields and the conversation table (`pcp_tui.contract.plan`).

Unit tests of one module's logic; the end-to-end proof that the shepherd applies
them to real peers is tests/test_isolation.py.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from pcp_tui import protocol
from pcp_tui.contract import plan as contract

GRAPHS = (
    protocol.GraphInfo("train_chunk", (protocol.Platform.CPU,), "graph/train_chunk"),
    protocol.GraphInfo("init_opt_state", (protocol.Platform.CPU,), "graph/init_opt_state"),
)
TENSORS = {graph.tensor: np.zeros(3, np.uint8) for graph in GRAPHS}
PLAN = protocol.Plan(
    graphs=GRAPHS,
    param_names=("w", "b"),
    inner_steps=5,
    chunk_steps=5,
    batch_size=4,
    seq_len=32,
    tokens_per_row=32,
    fragments=(protocol.Fragment(("w", "b")),),  # plain DiLoCo: one fragment, every parameter
)


def test_token_arithmetic_is_explicit_for_both_batch_kinds():
    assert contract.tokens_per_row(protocol.BatchKind.WINDOWS, 32) == 32
    assert contract.tokens_per_row(protocol.BatchKind.ROWS, 32) == 1
    assert contract.max_result_tokens(PLAN) == 5 * 4 * 32
    rows = dataclasses.replace(PLAN, batch_kind=protocol.BatchKind.ROWS, tokens_per_row=1)
    assert contract.max_result_tokens(rows) == 5 * 4


@pytest.mark.parametrize(
    ("changes", "words"),
    [
        ({}, None),
        ({"graphs": GRAPHS[:1]}, "needs train_chunk and init_opt_state"),
        ({"batch_size": 0}, "must be >= 1"),
        ({"tokens_per_row": 1}, "a windows plan counts 32 tokens per row, this one says 1"),
        ({"batch_kind": protocol.BatchKind.ROWS}, "a rows plan counts 1 tokens per row"),
    ],
)
def test_plan_problem_names_the_broken_rule(changes, words):
    problem = contract.plan_problem(dataclasses.replace(PLAN, **changes), TENSORS)
    assert problem is None if words is None else words in problem


def test_a_plan_without_its_graph_tensors_is_refused():
    problem = contract.plan_problem(PLAN, {"graph/train_chunk": TENSORS["graph/train_chunk"]})
    assert "lacks its graph tensors ['graph/init_opt_state']" in problem


def spec(name: str, dtype: str = "float32", shape=(2, 3)) -> protocol.TensorSpec:
    count = int(np.prod(shape))
    return protocol.TensorSpec(name, dtype, tuple(shape), "none", 4 * count, 0)


SHAPES = {"w": (2, 3), "b": (3,)}


@pytest.mark.parametrize(
    ("specs", "words"),
    [
        ([spec("w"), spec("b", shape=(3,))], None),
        ([spec("b", shape=(3,)), spec("w")], None),  # order is free, names are not
        ([spec("w")], "missing ['b']"),
        ([spec("w"), spec("b", shape=(3,)), spec("x")], "unexpected ['x']"),
        ([spec("w"), spec("b", shape=(4,))], "b is float32[4], the plan's is float32[3]"),
        ([spec("w", dtype="float64"), spec("b", shape=(3,))], "w is float64[2, 3]"),
    ],
)
def test_a_result_header_must_be_exactly_the_plans_parameters(specs, words):
    problem = contract.result_header_problem(SHAPES, specs)
    assert problem is None if words is None else words in problem


def test_the_conversation_table():
    planned, ready = contract.Stage.PLANNED, contract.Stage.READY
    assert contract.out_of_turn("shepherd", "ready", planned) is None
    assert "not valid while the connection is ready" in contract.out_of_turn(
        "shepherd", "ready", ready
    )
    assert contract.out_of_turn("shepherd", "roundResult", ready) is None
    assert "planned" in contract.out_of_turn("shepherd", "progress", planned)
    for kind in ("hello", "workerHello", "welcome", "plan", "roundStart"):
        assert "never accepts" in contract.out_of_turn("shepherd", kind, ready)
    assert contract.out_of_turn("worker", "roundStart", ready) is None
    for kind in ("hello", "workerHello", "welcome", "ready", "progress", "roundResult"):
        assert "never accepts" in contract.out_of_turn("worker", kind, ready)
    every_kind = set(protocol.KINDS)
    for side in ("shepherd", "worker"):
        assert set(contract.RECEIVES[side]) <= every_kind
