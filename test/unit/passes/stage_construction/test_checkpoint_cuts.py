"""A checkpointed Transformer cut into stages inside a block, through `hlopar.parallelize`.

The step is written as the JAX docs write one: a Python loop over blocks, each under
`jax.checkpoint`, optax Adam. `jax.named_scope("hlopar_layer_N")` markers put the first
block's last addition (`+ fc2_bias` and the residual) in layer 1 with everything after it,
the rest in layer 0, and stage construction makes the two layers two stages: the cut falls
inside a checkpointed block. The checkpoint's `optimization_barrier` (the block's inputs and
the incoming cotangent) then sits in stage 0's backward while the bias gradient it feeds was
placed with its bias in stage 1: the program used to fail at run time ("read before it is
made"); `op_layers.consistent_layers` moves the gradient to the barrier's layer. One
step on 2 x 4 CPU devices, 2 microbatches, equals one device (loss 1e-5, parameters by
update, `numerics.assert_adam_step_close`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
import scan_steps
from numerics import assert_adam_step_close

import hlopar

CLUSTER = hlopar.Cluster.local(num_hosts=2, devices_per_host=4, device_kind="cpu")
BLOCKS = 2
TX = optax.adam(scan_steps.LR)


def block(x, p, index: int):
    """scan_steps' block, its output projection's bias and residual in the layer after it."""
    b, t, d = x.shape
    with jax.named_scope(f"hlopar_layer_{min(index, 1)}"):
        h = scan_steps._layer_norm(x, p["ln1_scale"], p["ln1_bias"])
        q, k, v = jnp.split(h @ p["qkv"] + p["qkv_bias"], 3, axis=-1)
        q, k, v = (a.reshape(b, t, scan_steps.HEADS, d // scan_steps.HEADS) for a in (q, k, v))
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(d // scan_steps.HEADS)
        scores = jnp.where(jnp.tril(jnp.ones((t, t), bool)), scores, -1e9)
        y = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(scores, axis=-1), v).reshape(b, t, d)
        x = x + y @ p["proj"] + p["proj_bias"]
        h = scan_steps._layer_norm(x, p["ln2_scale"], p["ln2_bias"])
        h = jax.nn.gelu(h @ p["fc1"] + p["fc1_bias"]) @ p["fc2"]
    with jax.named_scope("hlopar_layer_1"):
        return x + h + p["fc2_bias"]


def loss_fn(params, tokens, targets):
    with jax.named_scope("hlopar_layer_0"):
        x = params["embed"][tokens] + params["pos"]
    for index, p in enumerate(params["blocks"]):
        x = jax.checkpoint(block, static_argnums=2)(x, p, index)
    with jax.named_scope("hlopar_layer_1"):
        x = scan_steps._layer_norm(x, params["ln_f_scale"], params["ln_f_bias"])
        return scan_steps._cross_entropy(x @ params["head"], targets)


def step(params, opt_state, batch):
    loss, grads = jax.value_and_grad(loss_fn)(params, batch["tokens"], batch["targets"])
    updates, opt_state = TX.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss


def test_a_cut_inside_a_checkpointed_block_equals_one_device(ray_cluster):
    stacked = scan_steps.init_gpt(0, BLOCKS)
    params = {**stacked, "blocks": [jax.tree_util.tree_map(lambda a: a[i], stacked["blocks"]) for i in range(BLOCKS)]}  # noqa: B023
    args = (params, TX.init(params), scan_steps.batch())
    parallel = hlopar.parallelize(
        step, cluster=CLUSTER, method="pipeline", num_microbatches=2, schedule="1f1b", verbose=False
    )
    try:
        results = parallel(*args)
        stages = parallel.planned.plan["stages"]["stages"]
        assert [s["layers"] for s in stages] == [[0, 0], [1, 1]], "no cut inside the block: the test proves less"
        program = parallel.planned.program
        for stage in (0, 1):  # one backward fragment per stage: nothing runs out of order
            assert sum(f.stage == stage and f.role == "backward" for f in program.fragments) == 1
        want = jax.jit(step)(*args)
        assert abs(float(results[2]) - float(want[2])) <= 1e-5 * abs(float(want[2]))
        assert_adam_step_close(results, want, params, lambda tree: tree[0], rtol=1e-5)
    finally:
        parallel.close()
