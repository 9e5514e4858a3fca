"""What every model of the zoo hands out: a training step, lowerable with abstract shapes.

A `TrainStep` bundles a model's parameter initializer, its loss (a MEAN over the batch, which
the pipeline code relies on when it splits a batch into microbatches), a batch generator and
the Adam optimizer into one pure function

    step(params, opt_state, batch) -> (new_params, new_opt_state, loss)

and lowers it with `jax.ShapeDtypeStruct` arguments only:

    text = train_step.lower()   # StableHLO text of jax.jit(step).lower(*abstract_args())

That text (``module @jit_step { func.func public @main ... }``) is what ``hlopar-opt`` and
the passes take as input. Since no argument is ever materialized, a 39B-parameter model's
IR is produced in seconds and in a few hundred MB of host memory.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import jax
import jax.numpy as jnp

from hlopar.models.adam import AdamConfig, AdamState, adam_update, init_adam

PyTree = Any
Params = PyTree
Batch = Mapping[str, jax.Array]


class UnknownModelError(LookupError):
    """An unknown model family or configuration name; the message lists the valid ones."""

    def __str__(self) -> str:  # LookupError would quote the message like a dict key
        return str(self.args[0]) if self.args else ""


@dataclass(frozen=True)
class ParamSpec:
    """How to create one parameter: its shape and dtype, and a normal(0, std) draw (`std` set)
    or a constant `value` (`std` None).

    Models describe their parameters as a pytree of specs (a `ParamSpec` is a pytree leaf);
    the abstract parameters of any size follow without tracing anything, and `materialize`
    makes real ones for small configurations.
    """

    shape: tuple[int, ...]
    dtype: str
    std: float | None = None
    value: float = 0.0

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    def abstract(self) -> jax.ShapeDtypeStruct:
        return jax.ShapeDtypeStruct(self.shape, jnp.dtype(self.dtype))


def abstract_params(specs: PyTree) -> PyTree:
    """The `jax.ShapeDtypeStruct` tree of a `ParamSpec` tree."""
    return jax.tree_util.tree_map(lambda s: s.abstract(), specs)


def materialize(specs: PyTree, rng: jax.Array) -> PyTree:
    """Real parameters for a `ParamSpec` tree.

    All normal draws come from one flat `jax.random.normal` vector cut into pieces: one
    random-number generator in the program instead of one per parameter, which keeps the
    compile time of `init` small (XLA compiles each generator separately).
    """
    leaves, treedef = jax.tree_util.tree_flatten(specs)
    total = sum(s.size for s in leaves if s.std is not None)
    flat = jax.random.normal(rng, (total,), jnp.float32) if total else None
    out, offset = [], 0
    for s in leaves:
        dtype = jnp.dtype(s.dtype)
        if s.std is None:
            out.append(jnp.full(s.shape, s.value, dtype))
        else:
            piece = jax.lax.slice(flat, (offset,), (offset + s.size,)).reshape(s.shape)
            out.append((s.std * piece).astype(dtype))
            offset += s.size
    return jax.tree_util.tree_unflatten(treedef, out)


@dataclass(frozen=True, eq=False)  # compared and hashed by identity, like a function
class TrainStep:
    """One model configuration's training step, ready to run (small configs) or lower (any).

    Fields:
      name: ``"<family>-<config>"``, e.g. ``"gpt-1.3B"``.
      config: the model's config dataclass.
      param_specs: the parameters as a pytree of `ParamSpec`.
      loss_fn: ``loss_fn(params, batch) -> scalar``, the mean loss over the batch.
      make_batch: ``make_batch(rng) -> batch``, a dict of real arrays (synthetic data).
      optimizer: Adam's hyper-parameters.
    """

    name: str
    config: Any
    param_specs: PyTree
    loss_fn: Callable[[Params, Batch], jax.Array]
    make_batch: Callable[[jax.Array], Batch]
    optimizer: AdamConfig = field(default_factory=AdamConfig)

    def init(self, rng: jax.Array) -> Params:
        """Real parameters drawn from `rng`; only sensible for small configurations."""
        return self._jitted_init(rng)

    @cached_property
    def _jitted_init(self) -> Callable:
        specs = self.param_specs
        return jax.jit(lambda rng: materialize(specs, rng))

    def init_opt_state(self, params: Params) -> AdamState:
        """Adam state for `params` (with a master copy under mixed precision)."""
        return init_adam(params, self.optimizer.master_dtype)

    def step(self, params: Params, opt_state: AdamState, batch: Batch):
        """Loss, gradients by `jax.value_and_grad`, one Adam update. Pure; `jax.jit` it."""
        loss, grads = jax.value_and_grad(self.loss_fn)(params, batch)
        opt = self.optimizer
        new_params, new_opt_state = adam_update(
            grads, opt_state, params, lr=opt.learning_rate, b1=opt.b1, b2=opt.b2, eps=opt.eps
        )
        return new_params, new_opt_state, loss

    @cached_property
    def jitted_step(self) -> Callable:
        """`jax.jit(self.step)`, built once per TrainStep (so repeated calls hit jit's cache)."""
        return jax.jit(self.step)

    def abstract_args(self) -> tuple[PyTree, AdamState, Batch]:
        """``(params, opt_state, batch)`` as `jax.ShapeDtypeStruct` pytrees; allocates nothing."""
        key = jax.eval_shape(lambda: jax.random.key(0))
        params = abstract_params(self.param_specs)
        opt_state = jax.eval_shape(lambda p: init_adam(p, self.optimizer.master_dtype), params)
        batch = jax.eval_shape(self.make_batch, key)
        return params, opt_state, batch

    def lower(self, *, debug_info: bool = False, donate: bool = False) -> str:
        """StableHLO text of ``jax.jit(step).lower(*abstract_args())`` (``.as_text()``).

        This text is the input ``hlopar-opt`` takes. With ``debug_info=True`` every op carries
        its location, whose name includes the ``layer_<i>`` scope of the layer it belongs to.
        With ``donate=True`` the parameters and optimizer state are donated, as a training
        loop writes it (``jax.jit(step, donate_argnums=(0, 1))``): each argument is marked
        ``tf.aliasing_output`` with its new value, and the update runs in place.
        """
        donate_argnums = (0, 1) if donate else ()
        lowered = jax.jit(self.step, donate_argnums=donate_argnums).lower(*self.abstract_args())
        return lowered.as_text(debug_info=debug_info)

    def param_count(self) -> int:
        """Number of parameters, from the specs (nothing is traced or allocated)."""
        return sum(spec.size for spec in jax.tree_util.tree_leaves(self.param_specs))


@dataclass(frozen=True)
class ModelFamily:
    """A model family of the zoo: its named configurations and its `train_step` builder."""

    name: str
    configs: Mapping[str, Any]
    train_step: Callable[..., TrainStep]
    config_type: type

    def get(self, config: str) -> TrainStep:
        """The training step of a named configuration."""
        return self.train_step(config)


def resolve_config(family: str, configs: Mapping[str, Any], config_type: type, config):
    """A config instance from a name in `configs` or an instance of `config_type`."""
    if isinstance(config, config_type):
        return config
    if isinstance(config, str) and config in configs:
        return configs[config]
    names = ", ".join(configs)
    raise UnknownModelError(f"unknown {family} configuration {config!r}; known: {names}")


def config_label(configs: Mapping[str, Any], config) -> str:
    """The name of `config` in `configs`, or ``"custom"``."""
    for name, value in configs.items():
        if value == config:
            return name
    return "custom"


def count_ops(stablehlo_text: str) -> int:
    """Number of value-defining op lines (``%x = ...``) in StableHLO text."""
    return sum(1 for line in stablehlo_text.splitlines() if line.lstrip().startswith("%"))


def keys(rng: jax.Array, n: int) -> list[jax.Array]:
    """`n` independent keys from `rng` (a list, so callers can pop them)."""
    return list(jax.random.split(rng, n))


def dtype_of(name: str) -> jnp.dtype:
    """A config's dtype name (``"float32"``, ``"float16"``, ``"bfloat16"``) as a dtype."""
    return jnp.dtype(name)


def train_step_for(
    family: str, configs: Mapping[str, Any], config, *, param_specs, loss_fn, make_batch, optimizer: AdamConfig | None
) -> TrainStep:
    """A model module's `TrainStep` from its three functions of the config.

    ``param_specs(cfg)``, ``loss_fn(cfg, params, batch)``, ``make_batch(cfg, rng)``.
    """
    return TrainStep(
        name=f"{family}-{config_label(configs, config)}",
        config=config,
        param_specs=param_specs(config),
        loss_fn=lambda params, batch: loss_fn(config, params, batch),
        make_batch=jax.jit(lambda rng: make_batch(config, rng)),
        optimizer=optimizer or AdamConfig(),
    )
