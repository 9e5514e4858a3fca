"""One training step with its arguments and results in any order: what the roles analysis
and the planner must not tell apart (test_training_roles, test_api)."""

import jax
import jax.numpy as jnp


def flat_adam_step(w1, w2, m1, m2, v1, v2, count, x, y, key):
    """A training step with every leaf its own argument and result: two same-shaped
    weights with Adam's moments (six 8x8 state tensors a type cannot tell apart), a step
    count, a batch, a dropout key; returns the loss, an accuracy metric, the new state."""

    def loss_fn(ws):
        h = jnp.tanh(x @ ws[0])
        h = jnp.where(jax.random.bernoulli(key, 0.9, h.shape), h / 0.9, 0.0)
        logits = h @ ws[1]
        labels = jax.nn.one_hot(y, 8)
        return -jnp.mean(jnp.sum(labels * jax.nn.log_softmax(logits), -1)), logits

    (loss, logits), grads = jax.value_and_grad(loss_fn, has_aux=True)((w1, w2))
    count = count + 1
    new = []
    for w, m, v, g in zip((w1, w2), (m1, m2), (v1, v2), grads):
        m = 0.9 * m + 0.1 * g
        v = 0.999 * v + 0.001 * g * g
        step = 1e-3 * (m / (1 - 0.9**count)) / (jnp.sqrt(v / (1 - 0.999**count)) + 1e-8)
        new.append((w - step, m, v))
    accuracy = jnp.mean(jnp.argmax(logits, -1) == y)
    (w1, m1, v1), (w2, m2, v2) = new
    return loss, accuracy, w1, w2, m1, m2, v1, v2, count, jax.random.split(key)[0]


FLAT_ARGS = ("w1", "w2", "m1", "m2", "v1", "v2", "count", "x", "y", "key")
FLAT_RESULTS = ("loss", "accuracy", "w1", "w2", "m1", "m2", "v1", "v2", "count", "key")


def reordered_step_text(arg_order, result_order, debug_info: bool = True) -> str:
    """`flat_adam_step` taking `FLAT_ARGS[k]` for k in `arg_order` and returning
    `FLAT_RESULTS[k]` for k in `result_order`, lowered to StableHLO text."""

    def permuted(*args):
        results = flat_adam_step(**{FLAT_ARGS[k]: a for k, a in zip(arg_order, args)})
        return tuple(results[k] for k in result_order)

    shapes = {"x": ((16, 8), jnp.float32), "y": ((16,), jnp.int32), "count": ((), jnp.int32), "key": ((2,), jnp.uint32)}
    specs = [jax.ShapeDtypeStruct(*shapes.get(FLAT_ARGS[k], ((8, 8), jnp.float32))) for k in arg_order]
    return jax.jit(permuted, keep_unused=True).lower(*specs).as_text(debug_info=debug_info)
