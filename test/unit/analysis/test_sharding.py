"""ShardingSpec and the sdy sharding attributes: parse/format exactly as jaxlib prints them."""

from __future__ import annotations

import pickle
import random
import re

import pytest

from hlopar.analysis.auto_sharding.cluster import logical_mesh
from hlopar.analysis.mesh import DeviceMesh
from hlopar.analysis.sharding import (
    AxisRef,
    DimSharding,
    ShardingPerValue,
    ShardingSpec,
    TensorSharding,
    axes_index,
    axes_size,
    unused_axes,
)
from hlopar.corpus import corpus_dir

CORPUS = corpus_dir()
MESH = DeviceMesh.of((2, 4), ("x", "y"))


# --- ShardingSpec --------------------------------------------------------------------------


def test_spec_basics():
    spec = ShardingSpec((("x",), (), ("y", "z")))
    assert spec.rank == 3
    assert spec.used_axes == ("x", "y", "z")
    assert not spec.is_replicated
    assert ShardingSpec.replicated(2) == ShardingSpec(((), ()))
    assert ShardingSpec.replicated(2).is_replicated
    assert ShardingSpec.of("x", None, ("y", "z")) == spec
    assert ShardingSpec.of() == ShardingSpec(())


def test_spec_hash_is_kept_per_process():
    """The cost model's caches key on specs and meshes: hashed once, equal values equal
    hashes; a pickle leaves the hash out (a string's hash differs in another process), and
    the copy computes its own."""
    spec = ShardingSpec.of("x", None, ("y", "z"))
    same = ShardingSpec((("x",), (), ("y", "z")))
    assert hash(spec) == hash(same) == hash(spec) and spec == same and {spec: 1}[same] == 1
    assert hash(spec) != hash(ShardingSpec.of(("y", "z"), None, "x"))
    state = pickle.dumps(spec)
    assert b"_cached_hash" not in state
    copy = pickle.loads(state)
    assert copy == spec and hash(copy) == hash(spec) and copy.used_axes == ("x", "y", "z")
    mesh = logical_mesh((2, 4), preset="a100-80g-nvlink")
    assert b"_cached_hash" not in pickle.dumps((hash(mesh), mesh)) and pickle.loads(pickle.dumps(mesh)) == mesh
    assert hash(logical_mesh((2, 4), preset="a100-80g-nvlink")) == hash(mesh) != hash(logical_mesh((4, 2)))


def test_spec_num_shards_and_check():
    mesh = DeviceMesh.of((2, 4, 3), ("x", "y", "z"))
    spec = ShardingSpec.of(("y", "x"), None, "z")
    assert [spec.num_shards(mesh, d) for d in range(3)] == [8, 1, 3]
    spec.check(mesh)
    with pytest.raises(ValueError, match="no axis 'w'"):
        ShardingSpec.of("w").check(mesh)


def test_spec_rejects_reused_axes():
    with pytest.raises(ValueError, match=r"\['x'\]"):
        ShardingSpec.of("x", "x")
    with pytest.raises(ValueError, match="split more than one"):
        ShardingSpec.of(("x", "x"))
    with pytest.raises(ValueError, match="non-empty strings"):
        ShardingSpec(((1,),))


@pytest.mark.parametrize(
    "spec, text, paper",
    [
        (ShardingSpec.of("x", None), "[S(x), R]", "S0R"),
        (ShardingSpec.of(None, "y"), "[R, S(y)]", "RS1"),
        (ShardingSpec.of(("x", "y"), None), "[S(x,y), R]", "S01R"),
        (ShardingSpec.of(("y", "x")), "[S(y,x)]", "S10"),
        (ShardingSpec.of("x", "y"), "[S(x), S(y)]", "S0S1"),
        (ShardingSpec.replicated(2), "[R, R]", "RR"),
        (ShardingSpec(()), "[]", ""),
    ],
)
def test_spec_notation(spec, text, paper):
    assert str(spec) == text
    assert ShardingSpec.parse(text) == spec
    assert spec.paper_str(MESH) == paper


def test_spec_with_pending_sums():
    spec = ShardingSpec(((), ("y",)), ("x",))
    assert str(spec) == "[R, S(y)] U(x)"
    assert ShardingSpec.parse(str(spec)) == spec and ShardingSpec.parse("[R, S(y)]U(x)") == spec
    assert spec != ShardingSpec.of(None, "y") and hash(spec) != hash(ShardingSpec.of(None, "y"))
    assert spec.reduced() == ShardingSpec.of(None, "y") and not spec.is_replicated
    assert ShardingSpec((), ("x",)).used_axes == () and not ShardingSpec((), ("x",)).is_replicated
    with pytest.raises(ValueError, match="split no dimension"):
        ShardingSpec((("x",),), ("x",))
    with pytest.raises(ValueError, match="distinct"):
        ShardingSpec(((),), ("x", "x"))


@pytest.mark.parametrize("text", ["S(x), R", "[S(), R]", "[S(x) R]", "[Q]", "[S(x),]", "[R] U()", "[R] U(x"])
def test_spec_parse_rejects(text):
    with pytest.raises(ValueError):
        ShardingSpec.parse(text)


# --- axis references ---------------------------------------------------------------------


def test_sub_axis_indices_major_first():
    mesh = DeviceMesh.of((8,), ("x",))
    major, minor = AxisRef("x", (1, 2)), AxisRef("x", (2, 4))
    assert major.size(mesh) == 2 and minor.size(mesh) == 4
    assert [major.index(mesh, {"x": c}) for c in range(8)] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert [minor.index(mesh, {"x": c}) for c in range(8)] == [0, 1, 2, 3, 0, 1, 2, 3]
    middle = AxisRef("x", (2, 2))
    assert [middle.index(mesh, {"x": c}) for c in range(8)] == [0, 0, 1, 1, 0, 0, 1, 1]
    # Major and minor together index the whole axis.
    assert [axes_index(mesh, [major, minor], {"x": c}) for c in range(8)] == list(range(8))
    assert axes_size(mesh, [major, minor]) == 8
    with pytest.raises(ValueError, match="does not divide"):
        AxisRef("x", (3, 2)).size(mesh)
    with pytest.raises(ValueError, match="positive"):
        AxisRef("x", (0, 2))


def test_unused_axes():
    mesh = DeviceMesh.of((2, 8, 3), ("x", "y", "z"))
    assert unused_axes(mesh, []) == (AxisRef("x"), AxisRef("y"), AxisRef("z"))
    assert unused_axes(mesh, [AxisRef("y")]) == (AxisRef("x"), AxisRef("z"))
    assert unused_axes(mesh, [AxisRef("y", (2, 2))]) == (
        AxisRef("x"),
        AxisRef("y", (1, 2)),
        AxisRef("y", (4, 2)),
        AxisRef("z"),
    )
    assert unused_axes(mesh, [AxisRef("y", (4, 2)), AxisRef("y", (1, 2))]) == (
        AxisRef("x"),
        AxisRef("y", (2, 2)),
        AxisRef("z"),
    )
    with pytest.raises(ValueError, match="used twice"):
        unused_axes(mesh, [AxisRef("y"), AxisRef("y", (1, 2))])
    with pytest.raises(ValueError, match="no axis"):
        unused_axes(mesh, [AxisRef("w")])


# --- TensorSharding text -------------------------------------------------------------------

CANONICAL = [
    '#sdy.sharding<@mesh, [{"a"}, {}]>',
    "#sdy.sharding<@mesh, []>",
    '#sdy.sharding<@mesh, [{?}, {"a", ?}]>',
    '#sdy.sharding<@mesh, [{"a", ?}p0, {"c", ?}]>',
    '#sdy.sharding<@mesh1, [{"a", "b"}p0, {"c", ?}p3], replicated={"d", "e"}>',
    '#sdy.sharding<@mesh, [{"x"}, {}], unreduced={"y"}>',
    '#sdy.sharding<@mesh1, [{"a"}, {?}p2], replicated={"d"}, unreduced={"f":(1)2}>',
    '#sdy.sharding<@mesh, [{"a", "c":(1)2, ?}, {"c":(2)4, ?}]>',
    '#sdy.sharding<mesh<["x"=2], device_ids=[1, 0]>, [{"x"}, {}]>',
    "#sdy.sharding<mesh<[], device_ids=[3]>, []>",
    '#sdy.sharding<mesh<["a"=2, "b"=2]>, [{"a", "b"}, {}]>',
    '#sdy.sharding<@"my mesh", [{"x y"}]>',
    '#sdy.sharding<@m$.1, [{"a\\22b"}, {"\\C3\\A9"}]>',
    "#sdy.sharding<@mesh, [{}p9223372036854775807]>",
]


@pytest.mark.parametrize("text", CANONICAL)
def test_canonical_text_round_trips(text):
    assert TensorSharding.parse(text).format() == text
    assert str(TensorSharding.parse(text)) == text


def test_parsed_structure():
    s = TensorSharding.parse(
        '#sdy.sharding<@mesh1, [{"a", "b":(2)2}p0, {"c", ?}p3, {}], replicated={"d"}, unreduced={"e"}>'
    )
    assert s.mesh == "mesh1" and s.mesh_name == "mesh1" and s.rank == 3
    assert s.dims[0] == DimSharding((AxisRef("a"), AxisRef("b", (2, 2))), True, 0)
    assert s.dims[1] == DimSharding((AxisRef("c"),), False, 3)
    assert s.dims[2] == DimSharding()
    assert s.replicated_axes == (AxisRef("d"),)
    assert s.unreduced_axes == (AxisRef("e"),)
    inline = TensorSharding.parse('#sdy.sharding<mesh<["x"=2], device_ids=[1, 0]>, [{"x"}]>')
    assert inline.mesh == DeviceMesh.of((2,), ("x",), device_ids=(1, 0)) and inline.mesh_name is None


@pytest.mark.parametrize(
    "text, canonical",
    [
        ('#sdy.sharding<@mesh, [{"c", "a",?}p1, {"b", ?}]>', '#sdy.sharding<@mesh, [{"c", "a", ?}p1, {"b", ?}]>'),
        ('#sdy.sharding<@mesh, [{?}, {?}], replicated = {"x"}>', '#sdy.sharding<@mesh, [{?}, {?}], replicated={"x"}>'),
        ('#sdy.sharding<@mesh7, [{"y"}, {"x": (2)4}]>', '#sdy.sharding<@mesh7, [{"y"}, {"x":(2)4}]>'),
        (
            '<@mesh, [{"x"}], unreduced={"z"}, replicated={"y"}>',
            '#sdy.sharding<@mesh, [{"x"}], replicated={"y"}, unreduced={"z"}>',
        ),
        ('#sdy.sharding<@mesh, [{"a\\"b\\n"}]>', '#sdy.sharding<@mesh, [{"a\\22b\\0A"}]>'),
        ('#sdy.sharding<@"mesh", [{"é"}]>', '#sdy.sharding<@mesh, [{"\\C3\\A9"}]>'),
    ],
)
def test_noncanonical_text_prints_like_jaxlib(text, canonical):
    assert TensorSharding.parse(text).format() == canonical


@pytest.mark.parametrize(
    "text",
    [
        '#sdy.sharding<@foo, [{"a"}p01, {"b"}]>',
        '#sdy.sharding<@foo, [{"a"}, {"b"}phigh]>',
        '#sdy.sharding<@foo, [{"a"}, {"b"}p9999999999999999999]>',
        '#sdy.sharding<@foo, [{"a"}p-1]>',
        '#sdy.sharding<@foo, [{}, {}], replicated unreduced={"a", "b"}>',
        '#sdy.sharding<@foo, [{}, {}], replicated={"a", b}>',
        '#sdy.sharding<@foo, [{}, {}], replicated={"a"}, >',
        '#sdy.sharding<@foo, [{}, {}], replicated={"a"}, replicated={"b"}>',
        "#sdy.sharding<@foo, [{}, {}], replicated={}>",
        '#sdy.sharding<@foo, [{}, {}], unknown={"a"}>',
        '#sdy.sharding<@foo, [{}, {}], unreduced=["a", "b"]>',
        "#sdy.sharding<@foo, [{}, {}],>",
        '#sdy.sharding<@foo, [{?, "a"}]>',
        '#sdy.sharding<@foo, [{"a"}]',
        '#sdy.sharding<foo, [{"a"}]>',
        '#sdy.sharding<@foo, [{"a":(0)2}]>',
        '#sdy.sharding<@foo, [{"a"}]> extra',
    ],
)
def test_invalid_text_is_rejected(text):
    with pytest.raises(ValueError, match="invalid sdy sharding"):
        TensorSharding.parse(text)


def test_sharding_per_value():
    text = '#sdy.sharding_per_value<[<@mesh, [{"x"}, {"y"}]>, <@mesh, [{?}, {?}]>]>'
    per_value = ShardingPerValue.parse(text)
    assert len(per_value) == 2
    assert per_value[0] == TensorSharding.parse('#sdy.sharding<@mesh, [{"x"}, {"y"}]>')
    assert [s.rank for s in per_value] == [2, 2]
    assert per_value.format() == text
    assert ShardingPerValue.parse("#sdy.sharding_per_value<[]>").format() == "#sdy.sharding_per_value<[]>"
    # Elements may be spelled with the full attribute name; jaxlib prints the short form.
    long = '#sdy.sharding_per_value<[#sdy.sharding<@mesh, [{"x"}, {}]>]>'
    assert ShardingPerValue.parse(long).format() == '#sdy.sharding_per_value<[<@mesh, [{"x"}, {}]>]>'
    with pytest.raises(ValueError, match="sharding_per_value"):
        ShardingPerValue.parse("#sdy.sharding_per_value<[#propagated_sharding]>")


# --- spec conversion -----------------------------------------------------------------------


def test_spec_conversion():
    spec = ShardingSpec.of(("x", "y"), None)
    sharding = TensorSharding.from_spec("mesh", spec)
    assert sharding.format() == '#sdy.sharding<@mesh, [{"x", "y"}, {}]>'
    assert sharding.to_spec() == spec
    # Open dims, priorities and explicit replication do not change the layout.
    loose = TensorSharding.parse('#sdy.sharding<@mesh, [{"x", ?}p1, {?}], replicated={"z"}>')
    assert loose.to_spec() == ShardingSpec.of("x", None)
    with pytest.raises(ValueError, match="sub-axes"):
        TensorSharding.parse('#sdy.sharding<@mesh, [{"x":(1)2}]>').to_spec()
    # Pending sums (Shardy's unreduced axes) are part of the layout, both ways.
    pending = TensorSharding.parse('#sdy.sharding<@mesh, [{"y"}], unreduced={"x"}>')
    assert pending.to_spec() == ShardingSpec((("y",),), ("x",))
    assert TensorSharding.from_spec("mesh", pending.to_spec()) == pending
    with pytest.raises(ValueError, match="sub-axes"):
        TensorSharding.parse('#sdy.sharding<@mesh, [{}], unreduced={"x":(1)2}>').to_spec()
    inline = TensorSharding.from_spec(MESH, ShardingSpec.of("y"))
    assert inline.format() == '#sdy.sharding<mesh<["x"=2, "y"=4]>, [{"y"}]>'


def test_check_against_mesh():
    TensorSharding.parse('#sdy.sharding<@m, [{"x"}, {"y":(1)2}], replicated={"y":(2)2}>').check(MESH)
    for bad in [
        '#sdy.sharding<@m, [{"x"}, {"x"}]>',
        '#sdy.sharding<@m, [{"y"}], unreduced={"y":(1)2}>',
        '#sdy.sharding<@m, [{"w"}]>',
        '#sdy.sharding<@m, [{"y":(1)3}]>',
    ]:
        with pytest.raises(ValueError):
            TensorSharding.parse(bad).check(MESH)
    with pytest.raises(ValueError, match="pass that mesh"):
        TensorSharding.parse('#sdy.sharding<@m, [{"x"}]>').check()


# --- against jaxlib ------------------------------------------------------------------------


def _random_sharding(rng: random.Random) -> TensorSharding:
    names = ["x", "y", "z", "w", 'a"b', "é"]
    rng.shuffle(names)

    def ref() -> AxisRef:
        name = names.pop()
        return AxisRef(name, rng.choice([None, (1, 2), (2, 4), (4, 2)]))

    dims = []
    for _ in range(rng.randrange(0, 4)):
        axes = tuple(ref() for _ in range(rng.randrange(0, 3)) if names)
        dims.append(DimSharding(axes, rng.random() < 0.6, rng.choice([None, None, 0, 3, 12])))
    replicated = tuple(ref() for _ in range(rng.randrange(0, 2)) if names)
    unreduced = tuple(ref() for _ in range(rng.randrange(0, 2)) if names)
    mesh = rng.choice(["mesh", "m-2", DeviceMesh.of((2, 2), ("p", "q"), device_ids=(3, 1, 2, 0)), DeviceMesh()])
    return TensorSharding(mesh, tuple(dims), replicated, unreduced)


def test_random_shardings_print_like_jaxlib():
    from jaxlib.mlir import ir

    from hlopar.ir.context import make_context

    rng = random.Random(0)
    with make_context():
        for _ in range(300):
            sharding = _random_sharding(rng)
            text = sharding.format()
            assert str(ir.Attribute.parse(text)) == text
            assert TensorSharding.parse(text) == sharding
        per_value = ShardingPerValue(tuple(_random_sharding(rng) for _ in range(3)))
        assert str(ir.Attribute.parse(per_value.format())) == per_value.format()
        assert ShardingPerValue.parse(per_value.format()) == per_value


def _extract_attributes(text: str) -> list[str]:
    """Every `#sdy.sharding<...>` / `#sdy.sharding_per_value<...>`, brackets balanced."""
    found = []
    for match in re.finditer(r"#sdy\.sharding(?:_per_value)?<", text):
        i, depth = match.end(), 1
        while i < len(text) and depth and text[i] != "\n":
            char = text[i]
            if char == '"':
                i += 1
                while i < len(text) and text[i] != '"':
                    i += 2 if text[i] == "\\" else 1
            depth += {"<": 1, ">": -1}.get(char, 0)
            i += 1
        if depth == 0:
            found.append(text[match.start() : i])
    return found


# jaxlib accepts these, its verifier rejects them only once they sit on an op; we refuse early.
STRICTER_THAN_JAXLIB = ['"a":(-1)2']
# Shardy newer than the sdy inside jaxlib 0.10.
NEWER_SYNTAX = re.compile(r"unreduced=(max|min)\{")


@pytest.mark.corpus
def test_every_corpus_sharding_round_trips():
    """Each distinct sdy sharding attribute in the corpus prints back exactly as jaxlib does."""
    from jaxlib.mlir import ir

    from hlopar.ir.context import make_context

    found: set[str] = set()
    for path in CORPUS.rglob("*.mlir"):
        for attribute in _extract_attributes(path.read_text(errors="replace")):
            # Inside string attributes (`xla.sdy.sharding = "..."`) quotes are escaped as \22.
            found.add(attribute.replace("\\22", '"') if '"' not in attribute else attribute)
    assert len(found) > 1000
    checked = newer = rejected = 0
    with make_context():
        for text in sorted(found):
            if NEWER_SYNTAX.search(text):
                newer += 1
                continue
            cls = ShardingPerValue if text.startswith("#sdy.sharding_per_value") else TensorSharding
            try:
                expected = str(ir.Attribute.parse(text))
            except Exception:  # an invalid-input test case in the corpus: we must reject it too
                with pytest.raises(ValueError):
                    cls.parse(text)
                rejected += 1
                continue
            if any(s in text for s in STRICTER_THAN_JAXLIB):
                with pytest.raises(ValueError):
                    cls.parse(text)
                continue
            assert cls.parse(text).format() == expected, text
            if expected == text:
                assert cls.parse(text).format() == text
            checked += 1
    assert checked > 1400 and newer < 40 and rejected < 40, (checked, newer, rejected)
