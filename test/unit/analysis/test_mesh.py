"""DeviceMesh: shape and device queries, sdy text both ways, validation."""

from __future__ import annotations

import re

import numpy as np
import pytest

from hlopar.analysis.mesh import DeviceMesh, format_symbol, quote_string
from hlopar.corpus import corpus_dir

CORPUS = corpus_dir()


def test_of_and_shape_queries():
    mesh = DeviceMesh.of((2, 4), ("x", "y"))
    assert mesh.axes == (("x", 2), ("y", 4))
    assert mesh.axis_names == ("x", "y")
    assert mesh.shape == (2, 4)
    assert mesh.ndim == 2
    assert mesh.size == 8
    assert mesh.axis_size("y") == 4
    assert mesh.axis_index("y") == 1
    assert mesh.device_ids is None
    assert not mesh.is_maximal
    np.testing.assert_array_equal(mesh.devices(), np.arange(8).reshape(2, 4))


def test_default_names():
    assert DeviceMesh.of((2, 2, 2)).axis_names == ("x", "y", "z")
    assert DeviceMesh.of((1, 1, 1, 2)).axis_names == ("axis_0", "axis_1", "axis_2", "axis_3")


def test_transposed_device_order_coords_and_lookup():
    ids = np.arange(8).reshape(2, 4).T  # 4x2, like a JAX mesh over a transposed device array
    mesh = DeviceMesh.of((4, 2), ("x", "y"), device_ids=ids)
    assert mesh.device_ids == (0, 4, 1, 5, 2, 6, 3, 7)
    np.testing.assert_array_equal(mesh.devices(), ids)
    assert mesh.coords(5) == {"x": 1, "y": 1}
    assert mesh.coords(4) == {"x": 0, "y": 1}
    for device in range(8):
        assert mesh.device_at(mesh.coords(device)) == device
    with pytest.raises(ValueError, match="not in mesh"):
        mesh.coords(8)
    with pytest.raises(ValueError, match="out of range"):
        mesh.device_at({"x": 4, "y": 0})
    with pytest.raises(ValueError, match="exactly the axes"):
        mesh.device_at({"x": 0})


def test_iota_device_ids_are_normalized_away():
    assert DeviceMesh((("x", 2),), (0, 1)) == DeviceMesh.of((2,), ("x",))
    assert DeviceMesh((("x", 2),), (0, 1)).device_ids is None
    # ...but not on the maximal mesh, where the id says which device.
    assert DeviceMesh((), (0,)).device_ids == (0,)


def test_empty_and_maximal_meshes():
    empty = DeviceMesh()
    assert empty.size == 1 and empty.shape == () and not empty.is_maximal
    assert empty.coords(0) == {}
    maximal = DeviceMesh((), (3,))
    assert maximal.is_maximal and maximal.size == 1
    assert maximal.coords(3) == {}
    assert int(maximal.devices()) == 3
    assert maximal.device_at({}) == 3


@pytest.mark.parametrize(
    "mesh, text",
    [
        (DeviceMesh.of((2, 4), ("x", "y")), '<["x"=2, "y"=4]>'),
        (DeviceMesh.of((2,), ("x",), device_ids=[1, 0]), '<["x"=2], device_ids=[1, 0]>'),
        (DeviceMesh(), "<[]>"),
        (DeviceMesh((), (3,)), "<[], device_ids=[3]>"),
        (DeviceMesh((("a", 1),)), '<["a"=1]>'),
        (DeviceMesh((("x", 2), ("y", 1)), (1, 0)), '<["x"=2, "y"=1], device_ids=[1, 0]>'),
        (DeviceMesh((('q"uote', 2), ("é", 1))), '<["q\\22uote"=2, "\\C3\\A9"=1]>'),
    ],
)
def test_to_sdy_and_back(mesh, text):
    assert mesh.to_sdy() == text
    assert str(mesh) == text
    assert DeviceMesh.from_sdy(text) == mesh


@pytest.mark.parametrize(
    "text",
    [
        '#sdy.mesh<["x"=2], device_ids=[1, 0]>',
        'mesh<["x"=2], device_ids=[1, 0]>',
        '["x"=2], device_ids=[1, 0]',
        '  < [ "x" = 2 ] , device_ids = [ 1,0 ] >  ',
        '<["x"=2], device_ids=[1, 0]>',
    ],
)
def test_from_sdy_accepts_prefixes_and_spacing(text):
    assert DeviceMesh.from_sdy(text) == DeviceMesh.of((2,), ("x",), device_ids=(1, 0))


def test_from_sdy_drops_explicit_iota_like_shardy():
    assert DeviceMesh.from_sdy('<["a"=2, "b"=2], device_ids=[0, 1, 2, 3]>').to_sdy() == '<["a"=2, "b"=2]>'


@pytest.mark.parametrize(
    "args, message",
    [
        (((("x", 2), ("x", 2)),), "duplicate mesh axis names"),
        (((("x", 0),),), "positive size"),
        (((("x", -2),),), "positive size"),
        (((("", 2),),), "non-empty strings"),
        (((("x", 2.0),),), "must be an integer"),
        (((("x", 2),), (0, 1, 2)), "has 2 devices but 3 device ids"),
        (((("x", 2),), (1, 1)), "distinct"),
        (((("x", 2),), (-1, 0)), "non-negative"),
        (((), (0, 1)), "has 1 devices but 2"),
        ((("x",),), r"\(name, size\) pair"),
    ],
)
def test_validation(args, message):
    with pytest.raises(ValueError, match=message):
        DeviceMesh(*args)


def test_of_validation():
    with pytest.raises(ValueError, match="differ in length"):
        DeviceMesh.of((2, 2), ("x",))


def test_ids_that_are_not_a_permutation_have_no_sdy_text():
    mesh = DeviceMesh.of((2,), ("x",), device_ids=(4, 6))  # a submesh of physical devices
    assert mesh.coords(6) == {"x": 1}
    with pytest.raises(ValueError, match="permutation"):
        mesh.to_sdy()
    with pytest.raises(ValueError, match="permutation"):
        DeviceMesh.from_sdy('<["x"=2], device_ids=[2, 1]>')


@pytest.mark.parametrize(
    "text",
    [
        '<["x"=2>',
        '<["x"=2]',
        '<["x"]>',
        "<[x=2]>",
        '<["x"=2], devices=[1, 0]>',
        '<["x"=2], device_ids=[1, 0]> trailing',
        '<["x"=2, "x"=2]>',
        '<["x"=0]>',
        '<["x"=2], device_ids=[1, 1]>',
        '<["x"=2], device_ids=[-1, 0]>',
        "<[], device_ids=[0, 1]>",
        '<["unterminated=2]>',
    ],
)
def test_from_sdy_rejects(text):
    with pytest.raises(ValueError, match="invalid sdy mesh"):
        DeviceMesh.from_sdy(text)


def test_quoting_helpers():
    assert quote_string("x") == '"x"'
    assert quote_string('a"b\\c\n') == '"a\\22b\\\\c\\0A"'
    assert format_symbol("mesh_1.a$") == "@mesh_1.a$"
    assert format_symbol("my-mesh") == '@"my-mesh"'
    assert format_symbol("1mesh") == '@"1mesh"'


def _corpus_meshes() -> list[str]:
    found: set[str] = set()
    for path in CORPUS.rglob("*.mlir"):
        text = path.read_text(errors="replace")
        for match in re.finditer(r'(?:sdy\.mesh @[\w.$"-]+ = |#sdy\.mesh)(<[^\n]*?\]>)', text):
            found.add(match.group(1))
    return sorted(found)


@pytest.mark.corpus
def test_every_corpus_mesh_matches_jaxlib():
    """Each distinct mesh in the corpus: we print what jaxlib prints, and reject what it rejects."""
    from jaxlib.mlir import ir

    from hlopar.ir.context import make_context

    meshes = _corpus_meshes()
    assert len(meshes) > 50
    with make_context():
        for text in meshes:
            try:
                expected = str(ir.Attribute.parse("#sdy.mesh" + text)).removeprefix("#sdy.mesh")
            except Exception:  # jaxlib rejects it: so must we
                with pytest.raises(ValueError):
                    DeviceMesh.from_sdy(text)
                continue
            assert DeviceMesh.from_sdy(text).to_sdy() == expected, text
