"""The graph view of a func (`hlopar.ir.graph`) and the attribute decoders (`hlopar.ir.op_attrs`)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import pytest
from jax import lax
from jaxlib.mlir import ir

from hlopar.corpus import corpus_dir
from hlopar.ir import op_attrs as A
from hlopar.ir.context import make_context
from hlopar.ir.graph import FuncGraph, Location, OpNode, decode_location, module_graphs

CORPUS = corpus_dir() / "models"


def spec(*shape, dtype=jnp.float32):
    return jax.ShapeDtypeStruct(shape, dtype)


def i32(*shape):
    return spec(*shape, dtype=jnp.int32)


@pytest.fixture(scope="module")
def context():
    return make_context()


@pytest.fixture
def parse(context):
    def parse(text: str) -> ir.Module:
        with context:
            return ir.Module.parse(text)

    return parse


@pytest.fixture
def lower(parse):
    """Lowers a function with jax and returns the graph of one of its funcs (default @main)."""

    def lower(fn, *args, func: str = "main", debug_info: bool = False) -> FuncGraph:
        text = jax.jit(fn).lower(*args).as_text(debug_info=debug_info)
        graph = FuncGraph.from_module(parse(text), func)
        check_consistency(graph)
        return graph

    return lower


def ops_named(graph: FuncGraph, name: str) -> list[OpNode]:
    return [op for op in graph.walk() if op.name == name]


def only(graph: FuncGraph, name: str) -> OpNode:
    found = ops_named(graph, name)
    assert len(found) == 1, f"{len(found)} {name} ops"
    return found[0]


def check_consistency(graph: FuncGraph) -> None:
    """Ids, producers, users and nesting agree with each other and with program order."""
    assert [op.index for op in graph.ops] == list(range(len(graph.ops)))
    assert [op.id for op in graph.ops] == list(range(len(graph.ops)))
    walked = list(graph.walk())
    assert sorted(op.id for op in walked) == list(range(graph.num_ops))
    assert all(graph.op(op.id) is op for op in walked)
    nested_ids = [op.id for op in walked if not op.is_top_level]
    assert nested_ids == sorted(nested_ids)  # pre-order numbering after the top-level ops
    assert [v.id for v in graph.values] == list(range(len(graph.values)))
    for position, v in enumerate(graph.args):
        assert graph.values[v].arg_index == position and graph.values[v].is_arg

    expected_users: dict[int, list[int]] = {v.id: [] for v in graph.values}
    for op in walked:
        top = graph.ops[op.top]
        assert top.is_top_level and (op.is_top_level == (op.id == op.top))
        for v in op.operands:
            value = graph.values[v]
            if value.producer is not None:
                # Defined earlier in program order, or inside the same top-level op.
                assert value.producer < op.top or (value.producer == op.top and value.nested)
            if not expected_users[v] or expected_users[v][-1] != op.top:
                expected_users[v].append(op.top)
        for position, v in enumerate(op.results):
            value = graph.values[v]
            assert (value.def_op, value.result_index, value.producer) == (op.id, position, op.top)
            assert value.nested == (not op.is_top_level)
            assert graph.defining_op(v) is op
        for region in op.regions:
            for block in region:
                for v in block.args:
                    assert graph.values[v].producer == op.top and graph.values[v].nested
                for inner in block.ops:
                    assert inner.parent == op.id and inner.top == op.top
    for value in graph.values:
        assert list(value.users) == expected_users[value.id]
        assert graph.users_of(value.id) == tuple(graph.ops[i] for i in value.users)


# --------------------------------------------------------------------------- values


def test_values_shapes_dtypes_and_sizes(lower):
    graph = lower(
        lambda a, b, c, d: (a.astype(jnp.float32), b, c, d),
        spec(2, 3, dtype=jnp.bfloat16),
        spec(4, dtype=jnp.bool_),
        spec(5, dtype=jnp.complex64),
        spec(6, dtype=jnp.uint8),
    )
    a, b, c, d = (graph.values[v] for v in graph.args)
    assert (a.shape, a.dtype, a.nbytes, a.type) == ((2, 3), "bf16", 12, "tensor<2x3xbf16>")
    assert (b.shape, b.dtype, b.nbytes) == ((4,), "i1", 4)
    assert (c.shape, c.dtype, c.nbytes) == ((5,), "complex<f32>", 40)
    assert (d.shape, d.dtype, d.nbytes, d.rank) == ((6,), "ui8", 6, 1)
    (convert,) = graph.ops
    assert convert.name == "stablehlo.convert"
    assert graph.results == (convert.results[0], graph.args[1], graph.args[2], graph.args[3])
    out = graph.values[convert.results[0]]
    assert (out.producer, out.def_op, out.result_index, out.users) == (0, 0, 0, ())


def test_dynamic_and_non_tensor_types(parse):
    module = parse(
        """
        func.func @main(%x: tensor<?x4xf32>, %t: !stablehlo.token) -> (tensor<?x4xf32>, !stablehlo.token) {
          %0 = stablehlo.abs %x : tensor<?x4xf32>
          %1 = stablehlo.after_all %t : !stablehlo.token
          return %0, %1 : tensor<?x4xf32>, !stablehlo.token
        }
        """
    )
    graph = FuncGraph.from_module(module)
    x, token = (graph.values[v] for v in graph.args)
    assert (x.shape, x.dtype, x.nbytes) == ((None, 4), "f32", None)
    assert (token.shape, token.dtype, token.nbytes, token.rank) == (None, "!stablehlo.token", None, None)
    assert [op.name for op in graph.ops] == ["stablehlo.abs", "stablehlo.after_all"]


def test_graph_is_immutable(lower):
    graph = lower(lambda x: x * 2, spec(3))
    with pytest.raises(dataclasses.FrozenInstanceError):
        graph.ops = ()
    with pytest.raises(AttributeError):
        graph.ops[0].name = "x"
    with pytest.raises(dataclasses.FrozenInstanceError):
        only(graph, "stablehlo.broadcast_in_dim").attrs.dims = ()
    with pytest.raises(dataclasses.FrozenInstanceError):
        only(graph, "stablehlo.multiply").location.line = 1


def test_node_equality_ignores_mlir_objects(parse):
    text = jax.jit(lambda x: jnp.sin(x) @ x.T).lower(spec(3, 4)).as_text()
    first = FuncGraph.from_module(parse(text))
    second = FuncGraph.from_module(parse(text))
    assert first.ops[0].mlir_op != second.ops[0].mlir_op
    assert first.ops == second.ops and first.values == second.values
    assert "mlir_op" not in repr(first.ops[0])


# --------------------------------------------------------------------------- decoded attributes


def test_dot_general_batch_dims(lower):
    graph = lower(lambda a, b: jnp.einsum("bij,bjk->bik", a, b), spec(2, 3, 4), spec(2, 4, 5))
    dot = only(graph, "stablehlo.dot_general")
    assert dot.attrs == A.DotGeneralDims(lhs_batch=(0,), rhs_batch=(0,), lhs_contracting=(2,), rhs_contracting=(1,))
    assert graph.values[dot.results[0]].shape == (2, 3, 5)


def test_dot_general_multiple_contracting_dims(lower):
    graph = lower(lambda a, b: jnp.einsum("abcd,cdf->abf", a, b), spec(2, 3, 4, 5), spec(4, 5, 6))
    dot = only(graph, "stablehlo.dot_general")
    assert dot.attrs == A.DotGeneralDims((), (), (2, 3), (0, 1))


def test_matrix_vector(lower):
    graph = lower(lambda a, b: a @ b, spec(3, 4), spec(4))
    dot = only(graph, "stablehlo.dot_general")
    assert dot.attrs == A.DotGeneralDims((), (), (1,), (0,))
    assert [graph.values[v].shape for v in dot.operands] == [(3, 4), (4,)]
    assert dot.operands == graph.args


def test_convolution_nhwc_grouped(lower):
    graph = lower(
        lambda x, k: lax.conv_general_dilated(
            x,
            k,
            window_strides=(2, 1),
            padding=((1, 1), (0, 2)),
            rhs_dilation=(1, 2),
            dimension_numbers=("NHWC", "HWIO", "NHWC"),
            feature_group_count=2,
        ),
        spec(2, 9, 9, 4),
        spec(3, 3, 2, 6),
    )
    conv = only(graph, "stablehlo.convolution")
    assert conv.attrs == A.ConvDims(
        input_batch=0,
        input_feature=3,
        input_spatial=(1, 2),
        kernel_in=2,
        kernel_out=3,
        kernel_spatial=(0, 1),
        output_batch=0,
        output_feature=3,
        output_spatial=(1, 2),
        window_strides=(2, 1),
        padding=((1, 1), (0, 2)),
        lhs_dilation=(1, 1),
        rhs_dilation=(1, 2),
        window_reversal=(False, False),
        feature_group_count=2,
        batch_group_count=1,
    )


def test_reduce_kinds(lower):
    graph = lower(lambda x: (x.sum(axis=1), x.max(axis=(0, 2)), x.min(axis=0), x.prod(axis=2)), spec(2, 3, 4))
    reduces = [op for op in graph.ops if op.name == "stablehlo.reduce"]
    assert [op.attrs for op in reduces] == [
        A.ReduceAttrs((1,), "add"),
        A.ReduceAttrs((0, 2), "max"),
        A.ReduceAttrs((0,), "min"),
        A.ReduceAttrs((2,), "mul"),
    ]
    body = reduces[0].regions[0][0]
    assert len(body.args) == 2 and [op.name for op in body.ops] == ["stablehlo.add", "stablehlo.return"]
    assert body.ops[0].operands == body.args


def test_reduce_boolean_and_argmax(lower):
    graph = lower(lambda x: jnp.all(x, axis=0), spec(3, 2, dtype=jnp.bool_))
    assert only(graph, "stablehlo.reduce").attrs == A.ReduceAttrs((0,), "and")
    graph = lower(lambda x: jnp.argmax(x, axis=1), spec(2, 3), func="argmax")
    argmax = only(graph, "stablehlo.reduce")
    assert argmax.attrs == A.ReduceAttrs((1,), "other")
    assert len(argmax.operands) == 4 and len(argmax.results) == 2


def test_reduce_window_max_pool(lower):
    pool = lambda x: lax.reduce_window(x, -jnp.inf, lax.max, (1, 2, 2, 1), (1, 2, 2, 1), "SAME")
    graph = lower(pool, spec(1, 5, 5, 3))
    pool = only(graph, "stablehlo.reduce_window")
    assert pool.attrs == A.ReduceWindowAttrs(
        window_dimensions=(1, 2, 2, 1),
        window_strides=(1, 2, 2, 1),
        base_dilations=(1, 1, 1, 1),
        window_dilations=(1, 1, 1, 1),
        padding=((0, 0), (0, 1), (0, 1), (0, 0)),
        kind="max",
    )


def test_select_and_scatter_of_max_pool_gradient(lower):
    pool = lambda x: lax.reduce_window(x, -jnp.inf, lax.max, (1, 2, 2, 1), (1, 2, 2, 1), "VALID").sum()
    graph = lower(jax.grad(pool), spec(1, 4, 4, 3))
    op = only(graph, "stablehlo.select_and_scatter")
    assert op.attrs == A.SelectAndScatterAttrs(
        window_dimensions=(1, 2, 2, 1),
        window_strides=(1, 2, 2, 1),
        padding=((0, 0),) * 4,
        select="GE",
        kind="add",
    )


def test_broadcast_transpose_reshape(lower):
    graph = lower(lambda x: jnp.broadcast_to(x[:, None], (3, 4, 5)).transpose(2, 0, 1).reshape(5, 12), spec(3, 5))
    assert [op.attrs for op in ops_named(graph, "stablehlo.broadcast_in_dim")] == [
        A.BroadcastInDimAttrs((0, 2)),
        A.BroadcastInDimAttrs((0, 1, 2)),
    ]
    assert only(graph, "stablehlo.transpose").attrs == A.TransposeAttrs((2, 0, 1))
    assert only(graph, "stablehlo.reshape").attrs == A.ReshapeAttrs((5, 3, 4), (5, 12))


def test_slice_pad_concatenate(lower):
    graph = lower(
        lambda x, y: jnp.concatenate([lax.pad(x[1:5:2, ::3], 0.0, ((1, 2, 1), (0, 0, 0))), y], axis=1),
        spec(6, 7),
        spec(6, 5),
    )
    assert only(graph, "stablehlo.slice").attrs == A.SliceAttrs(start=(1, 0), limit=(5, 7), strides=(2, 3))
    assert only(graph, "stablehlo.pad").attrs == A.PadAttrs(low=(1, 0), high=(2, 0), interior=(1, 0))
    assert only(graph, "stablehlo.concatenate").attrs == A.ConcatenateAttrs(1)


def test_gather_indexing(lower):
    graph = lower(lambda x, i: x[i], spec(5, 4), i32(3))
    gather = only(graph, "stablehlo.gather")
    assert gather.attrs == A.GatherAttrs(
        offset_dims=(1,),
        collapsed_slice_dims=(0,),
        operand_batching_dims=(),
        start_indices_batching_dims=(),
        start_index_map=(0,),
        index_vector_dim=1,
        slice_sizes=(1, 4),
        indices_are_sorted=False,
    )


def test_gather_take_along_axis(lower):
    graph = lower(lambda x, i: jnp.take_along_axis(x, i, axis=1), spec(5, 4), i32(5, 2), func="take_along_axis")
    gather = only(graph, "stablehlo.gather")
    assert gather.attrs == A.GatherAttrs(
        offset_dims=(),
        collapsed_slice_dims=(1,),
        operand_batching_dims=(0,),
        start_indices_batching_dims=(0,),
        start_index_map=(1,),
        index_vector_dim=2,
        slice_sizes=(1, 1),
        indices_are_sorted=False,
    )


def test_scatter_add_and_set(lower):
    dims = dict(
        update_window_dims=(1,),
        inserted_window_dims=(0,),
        input_batching_dims=(),
        scatter_indices_batching_dims=(),
        scatter_dims_to_operand_dims=(0,),
        index_vector_dim=1,
        indices_are_sorted=False,
        unique_indices=False,
    )
    graph = lower(lambda x, i, u: x.at[i].add(u), spec(5, 4), i32(3), spec(3, 4))
    assert only(graph, "stablehlo.scatter").attrs == A.ScatterAttrs(**dims, kind="add")
    graph = lower(lambda x, i, u: x.at[i].set(u), spec(5, 4), i32(3), spec(3, 4))
    assert only(graph, "stablehlo.scatter").attrs == A.ScatterAttrs(**dims, kind="set")
    graph = lower(lambda x, i, u: x.at[i].max(u), spec(5, 4), i32(3), spec(3, 4))
    assert only(graph, "stablehlo.scatter").attrs.kind == "max"


def test_iota_sort_compare(lower):
    graph = lower(lambda: lax.broadcasted_iota(jnp.int32, (3, 4), 1))
    assert only(graph, "stablehlo.iota").attrs == A.IotaAttrs(1)
    graph = lower(lambda x: jnp.sort(x, axis=0, stable=True), spec(4, 3), func="sort")
    sort = only(graph, "stablehlo.sort")
    assert sort.attrs == A.SortAttrs(dimension=0, is_stable=True)
    comparator = sort.regions[0][0]
    assert comparator.ops[-1].name == "stablehlo.return" and len(comparator.args) == 2
    compares = ops_named(graph, "stablehlo.compare")
    assert compares[-1].attrs == A.CompareAttrs("LT", "TOTALORDER")
    graph = lower(lambda a, b: a < b, i32(3), i32(3))
    assert only(graph, "stablehlo.compare").attrs == A.CompareAttrs("LT", "SIGNED")


def test_dynamic_slice_and_update(lower):
    graph = lower(lambda x, i: lax.dynamic_slice(x, (i, 0), (2, 3)), spec(5, 4), i32())
    ds = only(graph, "stablehlo.dynamic_slice")
    assert ds.attrs == A.DynamicSliceAttrs((2, 3)) and len(ds.operands) == 3
    graph = lower(lambda x, u, i: lax.dynamic_update_slice(x, u, (i, 0)), spec(5, 4), spec(2, 4), i32())
    dus = only(graph, "stablehlo.dynamic_update_slice")
    assert dus.attrs == A.DynamicUpdateSliceAttrs()
    assert dus.operands[:2] == graph.args[:2]


def test_constants_reduce_precision_and_unknown_ops(lower):
    graph = lower(lambda x: lax.reduce_precision(x * jnp.array([1.0, 2.0, 3.0]) + 1.0, 5, 10), spec(3))
    constants = [op.attrs for op in ops_named(graph, "stablehlo.constant")]
    assert A.ConstantAttrs(splat=False, splat_value=None) in constants
    assert A.ConstantAttrs(splat=True, splat_value=1.0) in constants
    assert only(graph, "stablehlo.reduce_precision").attrs == A.ReducePrecisionAttrs(5, 10)
    assert only(graph, "stablehlo.multiply").attrs is None


def test_complex_constants(parse):
    # The bindings refuse to hand out complex dense attributes; decoding must not need them.
    module = parse(
        """
        func.func @main() -> (tensor<2xcomplex<f32>>, tensor<3xcomplex<f64>>) {
          %0 = stablehlo.constant dense<(1.5,-2.0)> : tensor<2xcomplex<f32>>
          %1 = stablehlo.constant dense<[(1.0,2.0), (3.0,4.0), (5.0,6.0)]> : tensor<3xcomplex<f64>>
          return %0, %1 : tensor<2xcomplex<f32>>, tensor<3xcomplex<f64>>
        }
        """
    )
    splat, full = FuncGraph.from_module(module).ops
    assert splat.attrs == A.ConstantAttrs(splat=True, splat_value=complex(1.5, -2.0))
    assert full.attrs == A.ConstantAttrs(splat=False, splat_value=None)
    assert full.raw_attrs["value"].startswith("dense<[(1.0")
    assert A.decode_attrs(splat.mlir_op) == splat.attrs


def test_custom_call(lower):
    graph = lower(jnp.linalg.cholesky, spec(4, 4), func="cholesky")
    call = only(graph, "stablehlo.custom_call")
    assert call.attrs.target.startswith("lapack_") and call.attrs.has_side_effect is False
    assert len(call.results) == 2
    assert "call_target_name" in call.raw_attrs and "operand_layouts" in call.raw_attrs


def test_func_call_and_module_graphs(parse):
    @jax.jit
    def inner(x):
        return jnp.sin(x) * 2

    text = jax.jit(lambda x: inner(x) + inner(x + 1)).lower(spec(3)).as_text()
    module = parse(text)
    graphs = module_graphs(module)
    assert set(graphs) == {"main", "inner"}
    main = graphs["main"]
    calls = [op for op in main.ops if op.name == "func.call"]
    assert len(calls) == 2 and calls[0].attrs == calls[1].attrs
    callee = calls[0].attrs.callee
    assert callee in graphs and [op.name for op in graphs[callee].ops][0] == "stablehlo.sine"
    # The builtin.module operation works as well as the ir.Module.
    assert FuncGraph.from_module(module.operation, callee).ops == graphs[callee].ops
    with pytest.raises(KeyError):
        FuncGraph.from_module(module, "missing")


# --------------------------------------------------------------------------- regions


def test_while_loop_regions(lower):
    graph = lower(lambda n, x: lax.fori_loop(0, n, lambda i, c: c * x + 1.0, x), i32(), spec(3))
    loop = only(graph, "stablehlo.while")
    assert loop.is_top_level and len(loop.regions) == 2
    cond, body = (region[0] for region in loop.regions)
    assert len(cond.args) == len(body.args) == len(loop.operands) == len(loop.results)
    assert [graph.values[v].shape for v in cond.args] == [graph.values[v].shape for v in loop.operands]
    assert cond.ops[0].name == "stablehlo.compare" and cond.ops[-1].name == "stablehlo.return"
    assert "stablehlo.multiply" in [op.name for op in body.ops]
    for op in body.ops:
        assert op.id >= len(graph.ops) and op.top == loop.index and op.parent == loop.id
    # The trip count is an argument: it reaches the loop as an operand.
    assert graph.args[0] in loop.operands
    assert loop.index in graph.values[graph.args[0]].users


def test_while_body_reads_value_from_outside(parse):
    module = parse(
        """
        func.func @main(%x: tensor<3xf32>, %n: tensor<i32>) -> tensor<3xf32> {
          %zero = stablehlo.constant dense<0> : tensor<i32>
          %scale = stablehlo.multiply %x, %x : tensor<3xf32>
          %r:2 = stablehlo.while(%i = %zero, %acc = %x) : tensor<i32>, tensor<3xf32>
          cond {
            %c = stablehlo.compare LT, %i, %n : (tensor<i32>, tensor<i32>) -> tensor<i1>
            stablehlo.return %c : tensor<i1>
          } do {
            %one = stablehlo.constant dense<1> : tensor<i32>
            %next = stablehlo.add %i, %one : tensor<i32>
            %y = stablehlo.multiply %acc, %scale : tensor<3xf32>
            stablehlo.return %next, %y : tensor<i32>, tensor<3xf32>
          }
          %out = stablehlo.add %r#1, %scale : tensor<3xf32>
          return %out : tensor<3xf32>
        }
        """
    )
    graph = FuncGraph.from_module(module)
    check_consistency(graph)
    x, n = graph.args
    zero, scale, loop, out = graph.ops
    assert loop.name == "stablehlo.while" and loop.operands == (zero.results[0], x)
    # %n is read by the cond region only, %scale by the body and after the loop.
    assert graph.values[n].users == (loop.index,)
    assert graph.values[scale.results[0]].users == (loop.index, out.index)
    assert graph.values[x].users == (scale.index, loop.index)
    assert [op.name for op in graph.direct_users_of(n)] == ["stablehlo.compare"]
    assert [op.name for op in graph.direct_users_of(scale.results[0])] == ["stablehlo.multiply", "stablehlo.add"]
    assert graph.predecessors(loop.index) == (zero.index, scale.index)
    assert graph.successors(scale.index) == (loop.index, out.index)
    assert graph.producer_of(scale.results[0]) is scale and graph.producer_of(x) is None
    body = loop.regions[1][0]
    y = graph.values[body.ops[2].results[0]]
    assert (y.producer, y.nested, y.users) == (loop.index, True, (loop.index,))
    assert graph.defining_op(y.id) is body.ops[2]
    assert graph.results == out.results
    assert list(graph.topological_order()) == [0, 1, 2, 3]


def test_case_branches_capture_outer_values(lower):
    graph = lower(lambda i, x: lax.switch(i, [jnp.sin, jnp.cos, lambda y: y * 2], x), i32(), spec(3))
    case = only(graph, "stablehlo.case")
    assert len(case.regions) == 3
    names = [[op.name for op in region[0].ops] for region in case.regions]
    assert names[0] == ["stablehlo.sine", "stablehlo.return"]
    assert names[1] == ["stablehlo.cosine", "stablehlo.return"]
    x = graph.args[1]
    assert x not in case.operands and graph.values[x].users == (case.index,)
    assert len(graph.direct_users_of(x)) == 3


# --------------------------------------------------------------------------- odds and ends


def test_locations(lower):
    def f(x, w):
        with jax.named_scope("layer_3"):
            return jnp.tanh(x @ w)

    graph = lower(f, spec(4, 8), spec(8, 2), debug_info=True)
    dot = only(graph, "stablehlo.dot_general")
    loc = dot.location
    assert loc.name is not None and loc.name.endswith("layer_3/dot_general")
    assert loc.file == __file__ and loc.line is not None and loc.col is not None
    # Without debug info the parser's own positions remain.
    plain = lower(f, spec(4, 8), spec(8, 2))
    assert only(plain, "stablehlo.dot_general").location.name is None


def test_decode_location_shapes(context):
    with context:
        file = ir.Location.file("a.py", 3, 7)
        assert decode_location(file) == Location("a.py", 3, 7, None)
        assert decode_location(ir.Location.unknown()) is None
        frame = ir.Location.callsite(ir.Location.name("f", file), [ir.Location.file("b.py", 1, 1)])
        named = ir.Location.name("jit(f)/dot", frame)
        assert decode_location(named) == Location("a.py", 3, 7, "jit(f)/dot")
        fused = ir.Location.fused([ir.Location.name("n"), ir.Location.file("c.py", 9, 2)])
        assert decode_location(fused) == Location("c.py", 9, 2, "n")


def test_foreign_ops_and_declarations():
    context = make_context(allow_unregistered=True)
    with context:
        module = ir.Module.parse(
            """
            sdy.mesh @mesh = <["x"=2]>
            func.func private @ext(tensor<2xf32>) -> tensor<2xf32>
            func.func @main(%x: tensor<4x2xf32>) -> tensor<4x2xf32> {
              %0 = sdy.sharding_constraint %x <@mesh, [{"x"}, {}]> : tensor<4x2xf32>
              %1 = "foo.bar"(%0) {weird = [1, "two"]} : (tensor<4x2xf32>) -> tensor<4x2xf32>
              %2 = stablehlo.custom_call @tpu_custom_call(%1) {backend_config = "opaque", has_side_effect = true}
                : (tensor<4x2xf32>) -> tensor<4x2xf32>
              return %2 : tensor<4x2xf32>
            }
            """
        )
    graphs = module_graphs(module)
    assert set(graphs) == {"ext", "main"}
    ext = graphs["ext"]
    assert ext.ops == () and len(ext.args) == 1 and ext.values[0].shape == (2,) and ext.results == ()
    main = graphs["main"]
    check_consistency(main)
    constraint, foreign, call = main.ops
    assert constraint.name == "sdy.sharding_constraint" and constraint.attrs is None
    assert foreign.attrs is None and foreign.raw_attrs["weird"] == '[1, "two"]'
    assert call.attrs == A.CustomCallAttrs("tpu_custom_call", True, "opaque", None)


@pytest.mark.corpus
@pytest.mark.parametrize("name", ["pt_bert.mlir", "jax_resnet_50.mlir"])
def test_corpus_models(context, name):
    with context:
        module = ir.Module.parse((CORPUS / name).read_text())
    graphs = module_graphs(module)
    assert "main" in graphs
    for graph in graphs.values():
        check_consistency(graph)
        counted = []
        graph.mlir_func.walk(lambda op: (counted.append(op.name), ir.WalkResult.ADVANCE)[1])  # noqa: B023
        # The walk also meets the func itself and its return.
        assert len(counted) == graph.num_ops + 2 and counted.count("func.return") == 1
        for op in graph.walk():
            if op.name in A.DECODERS:
                assert op.attrs is not None, op
    main = graphs["main"]
    assert any(op.name in ("stablehlo.dot_general", "stablehlo.convolution") for op in main.walk())


def test_subgraph_takes_outside_values_as_args_and_gives_what_others_read(lower):
    def f(x, w):
        h = jnp.tanh(x @ w)
        y = jnp.sin(h) * 2.0
        return y + h, jnp.cos(x)

    graph = lower(f, jnp.ones((4, 8)), jnp.ones((8, 8)))
    tanh = next(op.index for op in graph.ops if op.name == "stablehlo.tanh")
    sine = next(op.index for op in graph.ops if op.name == "stablehlo.sine")
    part = graph.subgraph([tanh, sine])
    assert [op.index for op in part.ops] == [tanh, sine]
    # tanh reads the dot's result, made outside; sine reads tanh, made inside.
    (arg,) = part.args
    assert graph.producer_of(arg).name == "stablehlo.dot_general"
    # Both results are read outside: h by the final add, sin(h) by the multiply.
    assert set(part.results) == {graph.ops[tanh].results[0], graph.ops[sine].results[0]}
    # Ids stay those of the whole graph.
    assert part.op(graph.ops[tanh].id) is graph.ops[tanh]
