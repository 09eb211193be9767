"""core/graph: walks of the autograd graph by node identity hold every node whose id they keep. Here on a graph
whose nodes' Python objects are made at each access and let go when unreferenced, as torch 2.11's are (2.14 keeps
one per node): an id kept of a dropped object is taken by the next node's, which confused four layer outputs' nodes
with one another (book-keeping then gave three of four layers zero norms, on an H200 with torch 2.11)."""

from __future__ import annotations

import weakref

import pytest
import torch

from pergrad_viz.core.graph import NodeMap, Nodes, children, walk
from pergrad_viz.core.guards import reentrant_checkpoint_in
from pergrad_viz.core.loss_reads import parameters_read_by_loss
from pergrad_viz.engine import lowest as lowest_outputs


class Node:
    """The C++ node: a name, the nodes its backward feeds, a leaf's tensor."""

    def __init__(self, name: str, *below: Node | None, variable: object = None):
        self.name, self.below, self.variable = name, below, variable


class Handle:
    """A node's Python object: made when asked for, freed when no longer referenced (its address then reused)."""

    __slots__ = ("node", "__weakref__")

    def __init__(self, node: Node):
        self.node = node

    def name(self) -> str:
        return self.node.name

    @property
    def next_functions(self):
        return tuple((None if n is None else handle(n), 0) for n in self.node.below)

    @property
    def variable(self):
        return self.node.variable


_LIVE: weakref.WeakValueDictionary = weakref.WeakValueDictionary()


def handle(node: Node) -> Handle:
    h = _LIVE.get(id(node))
    if h is None:
        h = _LIVE[id(node)] = Handle(node)
    return h


class Tensor:
    def __init__(self, node: Node | None):
        self.node = node

    @property
    def grad_fn(self):
        return None if self.node is None else handle(self.node)


def layer_outputs():
    """Four layer outputs as the positional-embedding net's: token and position embeddings, fc on their sum, head."""
    tok = Node("ViewBackward0", Node("EmbeddingBackward0", Node("AccumulateGrad")))
    pos = Node("ViewBackward0", Node("AccumulateGrad"))
    fc = Node("ViewBackward0", Node("AddmmBackward0", Node("TBackward0", Node("AccumulateGrad")),
                                    Node("ViewBackward0", Node("AddBackward0", tok, pos))))
    head = Node("ViewBackward0", Node("AddmmBackward0", Node("MeanBackward1", Node("TanhBackward0", fc))))
    return [Tensor(n) for n in (tok, pos, fc, head)]


def test_fresh_objects_do_take_a_dropped_ones_id():
    """The premise: without holding them, two nodes' objects taken one after the other share an id."""
    outputs = layer_outputs()
    assert len({id(t.grad_fn) for t in outputs}) == 1  # as on the H200's torch 2.11: four nodes, one id


def test_lowest_outputs_are_both_embeddings():
    tok, pos, fc, head = layer_outputs()
    lowest = lowest_outputs.lowest([tok, pos, fc, head])
    assert [t.node for t in lowest] == [tok.node, pos.node]


def test_reached():
    tok, pos, fc, head = layer_outputs()
    nodes = [t.grad_fn for t in (tok, pos)]
    assert lowest_outputs.reached(head.grad_fn, nodes)
    assert not lowest_outputs.reached(pos.grad_fn, [tok.grad_fn])
    assert not lowest_outputs.reached(tok.grad_fn, [head.grad_fn, fc.grad_fn])


def test_walk_meets_every_node_once():
    *_, head = layer_outputs()
    met = [h.node for h in walk([head.grad_fn])]
    assert len(met) == len({id(n) for n in met}) == 15  # every node of the graph, each once
    below_fc = [h.node for h in walk([head.grad_fn], stops=[layer_outputs()[2].grad_fn])]
    assert len(below_fc) == 15  # another graph's node is not a stop here


def test_a_reentrant_checkpoint_anywhere_is_found(monkeypatch):
    checkpointed = Node("CheckpointFunctionBackward", Node("AccumulateGrad"))
    out = Node("AddBackward0", Node("ViewBackward0", Node("AccumulateGrad")), Node("ViewBackward0", checkpointed))
    monkeypatch.setattr(torch, "Tensor", Tensor)  # the walk takes tensors only
    assert reentrant_checkpoint_in([Tensor(out)])
    assert not reentrant_checkpoint_in([Tensor(out.below[0])])


def test_the_loss_reads_the_parameter_it_reads():
    weight, other = object(), object()
    output = Node("ViewBackward0", Node("AccumulateGrad", variable=other))
    total = Node("SumBackward0", Node("AddBackward0", output, Node("MulBackward0", Node("AccumulateGrad",
                                                                                          variable=weight))))

    class Total:
        grad_fn = property(lambda self: handle(total))

    out = Tensor(output)
    monkeypatch = pytest.MonkeyPatch()
    monkeypatch.setattr(torch, "Tensor", Tensor)  # the output's tensors are found by type
    try:
        assert parameters_read_by_loss(Total(), out, [other, weight]) == [1]
    finally:
        monkeypatch.undo()


def test_node_map_holds_its_nodes():
    tok, pos, *_ = layer_outputs()
    seen: NodeMap[int] = NodeMap()
    seen[tok.grad_fn] = 1
    assert pos.grad_fn not in seen and tok.grad_fn in seen and seen[tok.grad_fn] == 1
    nodes = Nodes([tok.grad_fn, None])
    assert len(nodes) == 1 and pos.grad_fn not in nodes
    assert [h.node for h in children(tok.grad_fn)] == [tok.node.below[0]]
