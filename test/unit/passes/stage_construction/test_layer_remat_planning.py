"""Per-layer rematerialization chosen by stage construction on a real program (issue 15).

The tiny GPT's architecture at 64 tokens x 16 sequences (activations outweigh its weights),
2 hosts x 4 CPU devices, 2 microbatches, `remat=auto`: at 4 MiB a device both stages keep
their activations, at 3 MiB the first one is rematerialized as a whole (its span's
activations of one microbatch still fit), at 2.5 MiB only the per-layer form fits, on both
stages. Then the marks: each such backward fragment carries `hlopar.remat = "layers"`, the
ops of those stages' forward and backward keep `hlopar.layer` (the stage's layers; not the
constants, which stage construction copies into each fragment reading them), nothing else keeps a clustering attribute, and `hlopar-rematerialize`
recomputes layer by layer behind barriers.
"""

from __future__ import annotations

import functools
import json
import re

import pytest

from hlopar.ir.module import parse_module, print_module
from hlopar.models.gpt import GPTConfig, train_step
from hlopar.passes.base import PassContext
from hlopar.passes.pipeline import Pipeline
from hlopar.passes.rematerialize import RematerializePass


@functools.cache
def _text() -> str:
    return train_step(
        GPTConfig(hidden_size=64, num_layers=2, num_heads=4, seq_len=64, vocab_size=128, batch_size=16)
    ).lower()


def _planned(memory: str, tmp_path) -> tuple[list[dict], object]:
    module = parse_module(_text())
    report = tmp_path / f"stages-{memory}.json"
    Pipeline.parse(
        "builtin.module(hlopar-import,hlopar-cluster-operators,hlopar-stage-construction{schedule=1f1b "
        f"num-hosts=2 devices-per-host=4 microbatches=2 remat=auto memory-per-device={memory} "
        f"report={report}}})",
        module.context,
    ).run(module, PassContext())
    return json.loads(report.read_text())["stages"], module


@pytest.mark.parametrize(
    "memory,forms", [("4MiB", [None, None]), ("3MiB", ["stage", None]), ("2500KiB", ["layers", "layers"])]
)
def test_auto_takes_per_layer_where_only_it_fits(tmp_path, memory, forms):
    stages, _ = _planned(memory, tmp_path)
    assert [s["layers"] for s in stages] == [[0, 1], [2, 4]]
    assert [s["remat_form"] for s in stages] == forms
    assert [s["remat"] for s in stages] == [f is not None for f in forms]


def test_per_layer_stages_keep_their_layers_and_are_recomputed_per_layer(tmp_path):
    stages, module = _planned("2500KiB", tmp_path)
    text = print_module(module)
    assert "hlopar.role" not in text
    fragments = re.split(r"(?m)^    (?=%\S+ = mpmd\.fragment)", text)[1:]
    for fragment in fragments:
        header = fragment.splitlines()[0]
        layers = {int(n) for n in re.findall(r"hlopar\.layer = (\d+)", fragment)}
        assert not re.search(r"stablehlo\.constant \{hlopar\.layer", fragment), header
        if "_update" in header:
            assert "hlopar.layer" not in fragment, header
            continue
        stage = int(re.search(r"stage=(\d+)", header).group(1))
        first, last = stages[stage]["layers"]
        assert layers == set(range(first, last + 1)), header
        assert ('{hlopar.remat = "layers"}' in header) == ('"(1)' in header), header
    RematerializePass().run(module, PassContext())
    text = print_module(module)
    # One barrier per layer recomputed after backward ops ran: the stages' layers less the first
    # recomputed (layer 1 of stage 0, layer 4 of stage 1).
    assert text.count("stablehlo.optimization_barrier") == 3
