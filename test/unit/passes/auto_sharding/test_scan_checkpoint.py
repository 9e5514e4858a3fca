"""`jax.checkpoint` around each block of a scanned stack: auto-sharding lays out the training
state (stacked parameters, optimizer state) as it does for the same stack without it, with
the loops kept (hlopar-auto-sharding on the imported step) and unrolled
(hlopar-unstack-layer-scans first, as method="auto" does). The runs of the checkpointed
stacks equal one device in test/unit/runtime/test_scan_pipelines.py (pipelined) and
test/unit/passes/split_microbatches/test_scan_split.py (split into microbatches)."""

from __future__ import annotations

import math
import re

import jax
import pytest
import scan_steps

from hlopar.ir.module import parse_module, print_module
from hlopar.passes.base import PassContext
from hlopar.passes.pipeline import Pipeline

STEPS = {"gpt_scan": scan_steps.gpt_scan, "flax_scan": scan_steps.flax_scan}


def _state_layouts(name: str, remat: bool, unstack: bool) -> tuple[list[tuple[int, str]], str]:
    """(elements, sharding) of each of @main's arguments other than the batch, after
    auto-sharding on 2x4, and the IR."""
    step, args = STEPS[name](remat=remat)
    module = parse_module(jax.jit(step).lower(*args).as_text())
    passes = "hlopar-import," + ("hlopar-unstack-layer-scans," if unstack else "")
    Pipeline.parse(f"builtin.module({passes}hlopar-auto-sharding{{mesh-shape=2x4 latency=0,0}})", module.context).run(
        module, PassContext()
    )
    text = print_module(module)
    signature = re.search(r"func\.func public @main\((.*?)\) -> \(", text, re.S).group(1)
    arguments = re.split(r", (?=%arg\d+:)", signature)
    batch = len(jax.tree_util.tree_leaves(args[-1]))
    found = []
    for argument in arguments[: len(arguments) - batch]:
        dims = re.match(r"%arg\d+: tensor<((?:\d+x)*)\w+>", argument).group(1)
        layout = re.search(r"#sdy\.sharding<@\w+, \[.*?\]>", argument)
        found.append((math.prod(int(d) for d in dims.split("x") if d), layout.group(0) if layout else ""))
    return found, text


# Below this many elements (LayerNorm scales and biases, 16 floats here) sharding or not costs
# next to nothing either way: ties the solver may break differently.
SMALL = 256


def _pieces(layout: str) -> int:
    """How many mesh axes split a tensor (each axis has 2 or 4 devices here, each used once)."""
    return len(re.findall(r'"\w+"', layout))


@pytest.mark.parametrize("unstack", [False, True], ids=["loop", "unrolled"])
@pytest.mark.parametrize("name", list(STEPS))
def test_checkpointed_stack_shards_the_state_as_its_unchecked_twin(name, unstack):
    """The same weight tensors sharded, each over the same mesh axes. Not always along the
    same dim: a projection split by rows or by columns costs nearly the same, and the
    checkpointed step's second forward, which reshards the activations once more, may tip it
    either way (seen: the unrolled GPT's attention projections row-split in one plan and
    column-split in the other, which way round changing with unrelated passes)."""
    checked, text = _state_layouts(name, True, unstack)
    twin, _ = _state_layouts(name, False, unstack)
    assert "stablehlo.optimization_barrier" in text
    assert len(checked) == len(twin) > 0 and [n for n, _ in checked] == [n for n, _ in twin]
    weights = [i for i, (n, _) in enumerate(twin) if n >= SMALL]
    assert len(weights) >= 10
    assert [('"' in checked[i][1]) for i in weights] == [('"' in twin[i][1]) for i in weights]
    assert sum('"' in twin[i][1] for i in weights) > len(weights) // 2  # most weights sharded
    assert [_pieces(checked[i][1]) for i in weights] == [_pieces(twin[i][1]) for i in weights]
