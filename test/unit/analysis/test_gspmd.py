"""GSPMD sharding strings: every form XLA prints, canonical printing, conversion to and from sdy.

XLA's own parser/printer (`jaxlib.xla_client.HloSharding`) and JAX's NamedSharding lowering are
the ground truth.
"""

from __future__ import annotations

from hlopar.runtime.host_devices import use_host_devices

use_host_devices(8)

import math
import random

import jax
import numpy as np
import pytest
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from jaxlib import xla_client as xc

from hlopar.analysis.device_slices import all_device_slices, gspmd_device_slices
from hlopar.analysis.gspmd import (
    GspmdSharding,
    ManualSharding,
    format_gspmd,
    gspmd_to_sdy,
    iota_form,
    parse_gspmd,
    sdy_to_gspmd,
    to_gspmd_sharding,
)
from hlopar.analysis.mesh import DeviceMesh
from hlopar.analysis.sharding import ShardingSpec, TensorSharding


def xla(text: str) -> xc.HloSharding:
    return xc.HloSharding.from_string(text)


# --- parsing and printing ------------------------------------------------------------------

# Strings XLA prints, each exactly as XLA prints it.
XLA_CANONICAL = [
    "{replicated}",
    "{maximal device=3}",
    "{manual}",
    "{unknown}",
    "{unreduced}",
    "{devices=[2,4]<=[8]}",
    "{devices=[4,2]<=[2,4]T(1,0)}",
    "{devices=[1]<=[1]}",
    "{devices=[2,1,4]<=[8] last_tile_dim_replicate}",
    "{devices=[2,1,4]<=[4,2]T(1,0) last_tile_dim_replicate}",
    "{devices=[1,2,4]<=[2,2,2]T(1,0,2) last_tile_dim_replicate}",
    "{devices=[2,2,2]<=[2,2,2]T(0,2,1) last_tile_dims={manual, replicated}}",
    "{devices=[2,1,2,2]<=[8] last_tile_dims={unreduced, replicated}}",
    "{devices=[4,2]<=[8] last_tile_dims={manual}}",
    "{devices=[1,4]<=[4] last_tile_dims={maximal}}",
    "{devices=[2,2]0,2,3,1}",
    "{devices=[3,2]1,0,3,2,5,4}",
    "{{replicated}, {devices=[2]<=[2]}}",
    "{{replicated}, {manual}, {replicated}, {replicated}, {replicated}, /*index=5*/{replicated}, {replicated}}",
    "{}",
    "{replicated shard_as 1}",
    "{maximal device=3 shard_like 2}",
    "{devices=[2]<=[2] shard_as 0}",
]


@pytest.mark.parametrize("text", XLA_CANONICAL)
def test_canonical_strings_round_trip(text):
    assert str(xla(text)) == text  # the list really is XLA's printing
    assert format_gspmd(parse_gspmd(text)) == text
    assert str(GspmdSharding.parse(text)) == text


@pytest.mark.parametrize(
    "text, expected",
    [
        # XLA's own normalizations, which its parser applies too.
        ("{devices=[2,2,2]<=[2,2,2]T(0,1,2)}", "{devices=[2,2,2]<=[8]}"),
        ("{devices=[4,2]<=[2,1,2,2]T(1,0,3,2)}", "{devices=[4,2]<=[2,2,2]T(0,2,1)}"),
        ("{devices=[2,2,2]<=[2,2,2]T(1,2,0)}", "{devices=[2,2,2]<=[2,4]T(1,0)}"),
        ("{devices=[2,2]<=[4] last_tile_dims={replicated}}", "{devices=[2,2]<=[4] last_tile_dim_replicate}"),
        (
            "{devices=[2,2,2]<=[8] last_tile_dims={replicated, manual}}",
            "{devices=[2,2,2]<=[2,2,2]T(0,2,1) last_tile_dims={manual, replicated}}",
        ),
        (
            "{devices=[2,2,2]<=[8] last_tile_dims={replicated, replicated}}",
            "{devices=[2,4]<=[8] last_tile_dim_replicate}",
        ),
        ("{devices=[2,1]<=[2] last_tile_dim_replicate}", "{devices=[2]<=[2]}"),
        ("{devices=[1,1,2]<=[2] last_tile_dim_replicate}", "{replicated}"),
        ("{devices=[1,1]<=[1] last_tile_dim_replicate}", "{replicated}"),
        ("{devices=[1,4]<=[4] last_tile_dims={manual}}", "{manual}"),
        ("{devices=[1,1,4]<=[4] last_tile_dims={unreduced}}", "{unreduced}"),
        ("{devices=[1,2,1]<=[2] last_tile_dims={manual, replicated}}", "{manual}"),
        ("{devices=[1,1,1]<=[1] last_tile_dims={manual, replicated}}", "{devices=[1]<=[1]}"),
        (
            "{devices=[1,1,3]<=[3] last_tile_dims={replicated, unreduced}}",
            "{devices=[1,3]<=[3] last_tile_dims={unreduced}}",
        ),
        ("{devices=[1,3,3]<=[9] last_tile_dims={unreduced, unreduced}}", "{unreduced}"),
        ("{devices=[2]<=[2] last_tile_dims={}}", "{devices=[2]<=[2]}"),
        # Metadata is dropped; spacing and the tuple index comment are free.
        ('{replicated metadata={op_name="a"}}', "{replicated}"),
        ('{devices=[2]<=[2] metadata={op_name="a}" source_file="x.py" source_line=3}}', "{devices=[2]<=[2]}"),
        ('{maximal device=3 shard_as 1 metadata={{op_name="a"}, {op_name="b"}}}', "{maximal device=3 shard_as 1}"),
        (
            "{ devices=[2, 2]<=[4]  last_tile_dims={ manual , replicated } }",
            "{devices=[2,2]<=[4] last_tile_dims={manual, replicated}}",
        ),
        ("{{replicated},{manual}, /*index=2*/ {maximal device=0}}", "{{replicated}, {manual}, {maximal device=0}}"),
        # Explicit device lists print in iota form whenever they are one.
        ("{devices=[2,1,4]0,1,2,3,4,5,6,7}", "{devices=[2,1,4]<=[8]}"),
        ("{devices=[2,2]0,2,1,3}", "{devices=[2,2]<=[2,2]T(1,0)}"),
        ("{devices=[2,2]0,1,2,3 last_tile_dim_replicate}", "{devices=[2,2]<=[4] last_tile_dim_replicate}"),
        (
            "{devices=[2,2,2]0,1,2,3,4,5,6,7 last_tile_dims={replicated, manual}}",
            "{devices=[2,2,2]<=[2,2,2]T(0,2,1) last_tile_dims={manual, replicated}}",
        ),
        # Replicas within a group are sorted, as XLA does.
        ("{devices=[2,2]1,0,3,2 last_tile_dim_replicate}", "{devices=[2,2]<=[4] last_tile_dim_replicate}"),
        ("{devices=[2,4]<=[2,2,2]T(0,2,1) last_tile_dim_replicate}", "{devices=[2,4]<=[8] last_tile_dim_replicate}"),
        (
            "{devices=[1,3,3,2]<=[9,2]T(1,0) last_tile_dims={replicated, replicated}}",
            "{devices=[1,3,6]0,2,4,6,8,10,1,3,5,12,14,16,7,9,11,13,15,17 last_tile_dim_replicate}",
        ),
        ("{devices=[2,2]1,0,2,3 last_tile_dims={manual}}", "{devices=[2,2]1,0,2,3 last_tile_dims={manual}}"),
    ],
)
def test_normalization_matches_xla(text, expected):
    assert format_gspmd(parse_gspmd(text)) == expected
    # (Reparsing XLA's own printing: XLA reads `{devices=[1,3]<=[3] last_tile_dims={unreduced}}`,
    # which it prints, as `{unreduced}`.)
    assert xla(expected) == xla(str(xla(text)))


def test_rank_zero_one_device_tiling():
    # XLA prints this (for {devices=[1,1]<=[1] last_tile_dims={maximal, replicated}}) but
    # its parser refuses it; we read it back.
    assert format_gspmd(parse_gspmd("{devices=[1,1]<=[1] last_tile_dims={maximal, replicated}}")) == "{devices=[]<=[1]}"
    assert str(xla("{devices=[1,1]<=[1] last_tile_dims={maximal, replicated}}")) == "{devices=[]<=[1]}"
    assert format_gspmd(parse_gspmd("{devices=[]<=[1]}")) == "{devices=[]<=[1]}"


def test_parsed_structure():
    gs = parse_gspmd("{devices=[2,1,4]<=[4,2]T(1,0) last_tile_dim_replicate}")
    assert gs.kind == "tiled"
    assert gs.tile_shape == (2, 1, 4)
    assert gs.rank == 2 and gs.data_tile_shape == (2, 1)
    assert gs.last_tile_dims == ("replicated",)
    assert gs.devices == (0, 2, 4, 6, 1, 3, 5, 7)
    assert gs == GspmdSharding.tiled((2, 1, 4), np.arange(8).reshape(4, 2).T, ("replicated",))
    assert parse_gspmd("{maximal device=5}") == GspmdSharding.maximal(5)
    assert parse_gspmd("{manual}") == GspmdSharding.manual()
    assert parse_gspmd("{replicated}") == GspmdSharding.replicated()
    tup = parse_gspmd("{{replicated}, {devices=[2]1,0}}")
    assert tup.kind == "tuple" and tup.elements == (GspmdSharding.replicated(), GspmdSharding.tiled((2,), (1, 0)))
    assert parse_gspmd("{}") == GspmdSharding.tuple_of(())


def test_explicit_printing_on_request():
    gs = parse_gspmd("{devices=[2,2]<=[2,2]T(1,0) last_tile_dim_replicate}")
    assert format_gspmd(gs, iota=False) == "{devices=[2,2]0,2,1,3 last_tile_dim_replicate}"


def test_iota_form():
    assert iota_form(range(8)) == ((8,), ())
    assert iota_form([0]) == ((1,), ())
    assert iota_form([0, 2, 1, 3]) == ((2, 2), (1, 0))
    assert iota_form(np.arange(8).reshape(2, 2, 2).transpose(1, 0, 2).ravel().tolist()) == ((2, 2, 2), (1, 0, 2))
    assert iota_form(np.arange(24).reshape(2, 3, 4).transpose(2, 0, 1).ravel().tolist()) == ((6, 4), (1, 0))
    assert iota_form([0, 3, 1, 4, 2, 5]) == ((2, 3), (1, 0))
    assert iota_form([1, 0]) is None
    assert iota_form([0, 2, 3, 1]) is None
    assert iota_form([4, 5]) is None


@pytest.mark.parametrize(
    "text, message",
    [
        ("", "empty"),
        ("replicated", "expected '{'"),
        ("{devices=[2,2]0,1,2}", "needs 4 devices"),
        ("{devices=[2]0,0}", "distinct"),
        ("{devices=[2]<=[3]}", "does not hold"),
        ("{devices=[2,2]<=[2,2]T(0,0)}", "not a permutation"),
        ("{maximal}", "device=N"),
        ("{replicated device=1}", "takes no devices"),
        ("{replicated manual}", "both"),
        ("{tiled}", "unknown sharding attribute"),
        ("{devices=[2]<=[2] last_tile_dims={bogus}}", "unknown last tile dim kind"),
        ("{devices=[2]<=[2] last_tile_dim_replicate}", None),  # valid: collapses to replicated
        ("{devices=[2]<=[2]", "expected"),
        ("{replicated} {replicated}", "trailing"),
        ('{replicated metadata={op_name="a}', "unterminated"),
        ("{devices=[2]-1,0}", "non-negative"),
    ],
)
def test_parse_errors(text, message):
    if message is None:
        assert format_gspmd(parse_gspmd(text)) == "{replicated}"
        return
    with pytest.raises(ValueError, match=message):
        parse_gspmd(text)


def _random_gspmd_text(rng: random.Random) -> tuple[str, bool]:
    """A random tiled sharding string and whether it uses the iota form."""
    data = [rng.choice([1, 1, 2, 3, 4]) for _ in range(rng.randrange(0, 4))]
    kinds = [rng.choice(["replicated", "manual", "unreduced", "maximal"]) for _ in range(rng.randrange(0, 3))]
    subgroups = [rng.choice([1, 2, 2, 3]) for _ in kinds]
    tile = data + subgroups
    if not tile:
        tile, kinds = [2], []
    n = math.prod(tile)
    use_iota = rng.random() < 0.7
    if use_iota:
        reshape = _random_factorization(rng, n)
        perm = list(range(len(reshape)))
        rng.shuffle(perm)
        devices = f"<=[{','.join(map(str, reshape))}]" + (f"T({','.join(map(str, perm))})" if len(perm) > 1 else "")
    else:
        ids = list(range(n))
        rng.shuffle(ids)
        devices = ",".join(map(str, ids))
    suffix = ""
    if kinds == ["replicated"] and rng.random() < 0.5:
        suffix = " last_tile_dim_replicate"
    elif kinds:
        suffix = " last_tile_dims={" + ", ".join(kinds) + "}"
    return f"{{devices=[{','.join(map(str, tile))}]{devices}{suffix}}}", use_iota


def _random_factorization(rng: random.Random, n: int) -> list[int]:
    factors, rest = [], n
    while rest > 1:
        divisors = [d for d in range(2, rest + 1) if rest % d == 0]
        factors.append(rng.choice(divisors))
        rest //= factors[-1]
    return factors or [1]


def test_random_shardings_print_like_xla():
    rng = random.Random(1)
    checked = 0
    for _ in range(600):
        text, use_iota = _random_gspmd_text(rng)
        try:
            expected = xla(text)
        except Exception:  # e.g. a one-device explicit list, which XLA refuses
            continue
        mine = format_gspmd(parse_gspmd(text))
        if use_iota and "<=" in str(expected):
            assert mine == str(expected), text
        # Otherwise XLA printed an explicit list: after sorting replicas it sometimes keeps the
        # list explicit although it is still an iota, which we print in iota form.
        if "devices=[]" in mine:  # printed by XLA too, but its parser refuses it
            continue
        assert xla(mine) == xla(str(expected)), (text, mine)
        assert xla(format_gspmd(parse_gspmd(text), iota=False)) == xla(str(expected))
        checked += 1
    assert checked > 500


# --- GSPMD -> sdy -> GSPMD -----------------------------------------------------------------


def _round_trip(text: str, shape: tuple[int, ...]) -> tuple[DeviceMesh, TensorSharding | ManualSharding]:
    gs = parse_gspmd(text)
    mesh, sharding = gspmd_to_sdy(gs, len(shape))
    back, canonical = sdy_to_gspmd(mesh, sharding, len(shape)), format_gspmd(gs)
    if format_gspmd(parse_gspmd(canonical)) == canonical:
        assert back == canonical
    else:  # XLA prints a form that it reads back as another (see GspmdSharding._is_canonical)
        assert parse_gspmd(back) == parse_gspmd(canonical)
    tensor = sharding.sharding if isinstance(sharding, ManualSharding) else sharding
    assert all_device_slices(shape, tensor, mesh) == gspmd_device_slices(shape, gs), text
    return mesh, sharding


def test_to_sdy_factors_iota_into_mesh_axes():
    mesh, sharding = _round_trip("{devices=[4,2]<=[2,4]T(1,0)}", (8, 6))
    assert mesh.to_sdy() == '<["axis_0"=2, "axis_1"=4]>'
    assert sharding.format() == '#sdy.sharding<@mesh, [{"axis_1"}, {"axis_0"}]>'
    # A dimension split over several axes, the device order still the iota.
    mesh, sharding = _round_trip("{devices=[4,2]<=[4,2]T(1,0)}", (8, 6))
    assert mesh.to_sdy() == '<["axis_0"=2, "axis_1"=2, "axis_2"=2]>'
    assert sharding.format() == '#sdy.sharding<@mesh, [{"axis_2", "axis_0"}, {"axis_1"}]>'


def test_to_sdy_replicated_tile_dim_becomes_unused_axis():
    mesh, sharding = _round_trip("{devices=[2,1,4]<=[4,2]T(1,0) last_tile_dim_replicate}", (4, 3))
    assert mesh.to_sdy() == '<["axis_0"=4, "axis_1"=2]>'
    assert sharding.format() == '#sdy.sharding<@mesh, [{"axis_1"}, {}]>'


def test_to_sdy_falls_back_to_device_ids():
    # The tile boundaries (2 | 3) and the iota's (3 | 2) do not nest.
    mesh, sharding = _round_trip("{devices=[2,3]<=[2,3]T(1,0)}", (4, 6))
    assert mesh.to_sdy() == '<["axis_0"=2, "axis_1"=3], device_ids=[0, 3, 1, 4, 2, 5]>'
    assert sharding.format() == '#sdy.sharding<@mesh, [{"axis_0"}, {"axis_1"}]>'
    mesh, sharding = _round_trip("{devices=[2,1,2]1,3,0,2 last_tile_dim_replicate}", (5, 1))
    assert mesh.to_sdy() == '<["axis_0"=2, "axis_1"=2], device_ids=[1, 3, 0, 2]>'
    assert sharding.format() == '#sdy.sharding<@mesh, [{"axis_0"}, {}]>'


def test_to_sdy_unreduced_and_manual():
    mesh, sharding = _round_trip("{devices=[2,1,2,2]<=[8] last_tile_dims={unreduced, replicated}}", (4, 4))
    assert sharding.format() == '#sdy.sharding<@mesh, [{"axis_0"}, {}], unreduced={"axis_1"}>'
    mesh, sharding = _round_trip("{devices=[2,2,2]<=[2,2,2]T(0,2,1) last_tile_dims={manual, replicated}}", (4,))
    assert isinstance(sharding, ManualSharding) and sharding.kind == "manual"
    assert mesh.to_sdy() == '<["axis_0"=2, "axis_1"=2, "axis_2"=2]>'
    assert sharding.manual_axes == ("axis_2",)
    assert sharding.sharding.format() == '#sdy.sharding<@mesh, [{"axis_0"}]>'


def test_to_sdy_whole_tensor_kinds():
    mesh, sharding = gspmd_to_sdy("{replicated}", 2)
    assert (mesh.to_sdy(), sharding.format()) == ("<[]>", "#sdy.sharding<@mesh, [{}, {}]>")
    assert sdy_to_gspmd(mesh, sharding) == "{replicated}"
    mesh, sharding = gspmd_to_sdy("{maximal device=3}", 1, mesh_name="maximal_mesh_3")
    assert (mesh.to_sdy(), sharding.format()) == ("<[], device_ids=[3]>", "#sdy.sharding<@maximal_mesh_3, [{}]>")
    assert sdy_to_gspmd(mesh, sharding) == "{maximal device=3}"
    mesh, sharding = gspmd_to_sdy("{manual}", 1)
    assert isinstance(sharding, ManualSharding) and sharding.manual_axes == ()
    assert sdy_to_gspmd(mesh, sharding) == "{manual}"
    mesh, sharding = gspmd_to_sdy("{unknown}", 2)
    assert sharding.format() == "#sdy.sharding<@mesh, [{?}, {?}]>"
    assert sdy_to_gspmd(mesh, sharding) == "{replicated}"
    # One device: the same layout as replicated, printed the way JAX prints it.
    mesh, sharding = gspmd_to_sdy("{devices=[1]<=[1]}")
    assert (mesh, sdy_to_gspmd(mesh, sharding)) == (DeviceMesh(), "{replicated}")


def test_to_sdy_errors():
    with pytest.raises(ValueError, match="needs the tensor rank"):
        gspmd_to_sdy("{replicated}")
    with pytest.raises(ValueError, match="rank 2, not 3"):
        gspmd_to_sdy("{devices=[2,2]<=[4]}", 3)
    with pytest.raises(ValueError, match="tuple"):
        gspmd_to_sdy("{{replicated}}", 1)
    with pytest.raises(ValueError, match="unreduced"):
        gspmd_to_sdy("{unreduced}", 1)
    with pytest.raises(ValueError, match="maximal subgroups"):
        gspmd_to_sdy("{devices=[1,4]<=[4] last_tile_dims={maximal}}")


def test_random_round_trips_keep_every_tile():
    rng = random.Random(2)
    checked = 0
    for _ in range(300):
        text, _ = _random_gspmd_text(rng)
        gs = parse_gspmd(text)
        if gs.kind != "tiled" or "maximal" in gs.last_tile_dims or math.prod(gs.tile_shape) == 1:
            continue
        shape = tuple(rng.choice([t, 2 * t, t + 1, max(t - 1, 0), 7]) for t in gs.data_tile_shape)
        _round_trip(text, shape)
        checked += 1
    assert checked > 150


# --- sdy -> GSPMD --------------------------------------------------------------------------


def test_sdy_to_gspmd_examples():
    mesh = DeviceMesh.of((2, 4), ("x", "y"))
    assert sdy_to_gspmd(mesh, ShardingSpec.of("x", None)) == "{devices=[2,1,4]<=[8] last_tile_dim_replicate}"
    assert sdy_to_gspmd(mesh, ShardingSpec.of("y", "x")) == "{devices=[4,2]<=[2,4]T(1,0)}"
    assert sdy_to_gspmd(mesh, ShardingSpec.replicated(3)) == "{replicated}"
    sub = TensorSharding.parse('#sdy.sharding<@mesh, [{"y":(2)2}, {"x", "y":(1)2}]>')
    # dim 0 = minor half of y, dim 1 = x then the major half of y; x and y's major half are
    # adjacent in device order, so XLA merges them: [2,2,2]T(2,0,1) prints as [4,2]T(1,0).
    assert sdy_to_gspmd(mesh, sub) == str(xla("{devices=[2,4]<=[2,2,2]T(2,0,1)}")) == "{devices=[2,4]<=[4,2]T(1,0)}"
    # Explicitly replicated axes replicate like unused ones; open dims change nothing.
    loose = TensorSharding.parse('#sdy.sharding<@mesh, [{"x", ?}p0, {?}], replicated={"y"}>')
    assert sdy_to_gspmd(mesh, loose, 2) == sdy_to_gspmd(mesh, ShardingSpec.of("x", None))
    inline = TensorSharding.parse('#sdy.sharding<mesh<["x"=2], device_ids=[1, 0]>, [{"x"}]>')
    assert sdy_to_gspmd(None, inline) == "{devices=[2]1,0}"
    assert to_gspmd_sharding(None, inline).devices == (1, 0)


def test_sdy_to_gspmd_errors():
    mesh = DeviceMesh.of((2, 4), ("x", "y"))
    with pytest.raises(ValueError, match="rank 1, not 2"):
        sdy_to_gspmd(mesh, ShardingSpec.of("x"), 2)
    with pytest.raises(ValueError, match="used twice"):
        sdy_to_gspmd(mesh, TensorSharding.parse('#sdy.sharding<@m, [{"x"}], replicated={"x"}>'))
    with pytest.raises(ValueError, match="needs a mesh"):
        sdy_to_gspmd(None, ShardingSpec.of("x"))
    with pytest.raises(ValueError, match="manual axes"):
        sdy_to_gspmd(mesh, ManualSharding((), TensorSharding.from_spec("m", ShardingSpec.of("x"))))


def test_sub_axes_keep_every_tile():
    mesh = DeviceMesh.of((4, 6), ("x", "y"), device_ids=np.random.default_rng(0).permutation(24))
    for text in [
        '#sdy.sharding<@m, [{"x":(1)2}, {"y":(2)3}], unreduced={"x":(2)2}>',
        '#sdy.sharding<@m, [{"y":(3)2, "x"}, {}], replicated={"y":(1)3}>',
        '#sdy.sharding<@m, [{"y"}, {"x":(2)2}]>',
    ]:
        sharding = TensorSharding.parse(text)
        gs = to_gspmd_sharding(mesh, sharding)
        for shape in [(12, 12), (7, 5)]:
            assert all_device_slices(shape, sharding, mesh) == gspmd_device_slices(shape, gs), text
        back_mesh, back = gspmd_to_sdy(gs)
        assert to_gspmd_sharding(back_mesh, back) == gs


# --- against JAX ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def cpu_devices():
    devices = jax.devices("cpu")
    assert len(devices) >= 8, "conftest.py gives every unit test 8 CPU devices"
    return devices[:8]


def _jax_meshes(devices) -> list[Mesh]:
    d = np.array(devices)
    return [
        Mesh(d, ("x",)),
        Mesh(d.reshape(2, 4), ("x", "y")),
        Mesh(d.reshape(2, 4).T, ("x", "y")),  # transposed device order
        Mesh(d.reshape(2, 2, 2), ("x", "y", "z")),
        Mesh(d.reshape(2, 2, 2).transpose(2, 0, 1), ("x", "y", "z")),
        Mesh(d.reshape(1, 8), ("x", "y")),
        Mesh(d[[3, 1, 7, 5, 0, 2, 6, 4]].reshape(4, 2), ("x", "y")),
    ]


SPECS = [
    P(),
    P("x"),
    P(None, "x"),
    P("y"),
    P("y", "x"),
    P(("x", "y")),
    P(("y", "x")),
    P(None, ("y", "x")),
    P("z"),
    P(("z", "x"), "y"),
    P("x", None, "z"),
    P(None, None, ("y", "z", "x")),
]


def _spec(p: P, ndim: int) -> ShardingSpec:
    dims = [() if e is None else (e,) if isinstance(e, str) else tuple(e) for e in p]
    return ShardingSpec(tuple(dims + [()] * (ndim - len(dims))))


def test_sdy_to_gspmd_matches_jax(cpu_devices):
    checked = 0
    for jmesh in _jax_meshes(cpu_devices):
        for p in SPECS:
            if not set(_spec(p, 3).used_axes) <= set(jmesh.axis_names):
                continue
            for ndim in sorted({max(len(p), 1), 3}):
                expected = jax_hlo = NamedSharding(jmesh, p)._to_xla_hlo_sharding(ndim)
                spec = _spec(p, ndim)
                # JAX writes logical ids: positions in the mesh's device order.
                logical = DeviceMesh.of(jmesh.devices.shape, jmesh.axis_names)
                assert sdy_to_gspmd(logical, spec, ndim) == str(expected), (jmesh, p)
                # With physical ids, the same tiles land on the devices JAX places them on.
                ids = [d.id for d in jmesh.devices.flat]
                physical = DeviceMesh.of(jmesh.devices.shape, jmesh.axis_names, device_ids=ids)
                gs = to_gspmd_sharding(physical, spec)
                if jax_hlo.is_tiled():
                    jax_gs = parse_gspmd(str(jax_hlo))
                    placed = GspmdSharding(
                        "tiled", jax_gs.tile_shape, [ids[i] for i in jax_gs.devices], jax_gs.last_tile_dims
                    )
                    assert gs == placed.canonical(), (jmesh, p)
                checked += 1
    assert checked > 60


def test_unreduced_matches_jax(cpu_devices):
    jmesh = Mesh(np.array(cpu_devices).reshape(2, 2, 2), ("x", "y", "z"), axis_types=(AxisType.Explicit,) * 3)
    expected = NamedSharding(jmesh, P("x", None, unreduced={"y"}))._to_xla_hlo_sharding(2)
    sharding = TensorSharding.parse('#sdy.sharding<@mesh, [{"x"}, {}], unreduced={"y"}>')
    assert sdy_to_gspmd(DeviceMesh.of((2, 2, 2), ("x", "y", "z")), sharding) == str(expected)
