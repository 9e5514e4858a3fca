#!/usr/bin/env python3
"""XLA:CPU cannot serialize a loaded executable again (jaxlib 0.10), shown without hlopar.

    python tools/repro_reserialize.py

Compiles a small step with `jax.jit` (two scalar `power` fusions, as an Adam update has),
serializes it, loads the bytes, serializes the loaded executable and loads those: the
second bytes are shorter (the kernels' object code is gone), load without an error, and
the first call fails with "NOT_FOUND: Function <fusion> not found". The first bytes run.
Why `codegen/executable_cache.py` ships and writes only the bytes XLA made when it
compiled. Prints the sizes and each call's outcome; exits 0 when the bug shows.
"""

from __future__ import annotations

import sys

import jax
import jax.numpy as jnp
from jax._src.lib import _jax
from jax.extend import backend


def step(x, count):
    return x / (1 - 0.9 ** count.astype(jnp.float32)) + 0.999 ** count.astype(jnp.float32)


def main() -> int:
    client, device = backend.get_backend(), jax.devices()[0]
    devices = _jax.DeviceList((device,))
    arguments = [jax.device_put(jnp.ones((8, 16)), device), jax.device_put(jnp.int32(3), device)]
    compiled = jax.jit(step).lower(*arguments).compile().runtime_executable()
    first = client.serialize_executable(compiled)
    loaded = client.deserialize_executable(first, devices, None)
    second = client.serialize_executable(loaded)
    print(f"compiled, serialized: {len(first)} bytes; loaded, serialized again: {len(second)} bytes")
    failed = False
    for name, data in (("first bytes", first), ("second bytes", second)):
        try:
            out = client.deserialize_executable(data, devices, None).execute_sharded(arguments)
            value = float(out.disassemble_into_single_device_arrays()[0][0].ravel()[0])
            print(f"{name}: ran, {value:.4f}")
        except jax.errors.JaxRuntimeError as error:
            print(f"{name}: {error}")
            failed |= name == "second bytes"
    return 0 if failed else 1


if __name__ == "__main__":
    sys.exit(main())
