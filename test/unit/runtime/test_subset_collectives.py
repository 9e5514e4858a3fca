"""What a collective transport between meshes would stand on (issue 32, not built): in one
`jax.distributed` runtime of three CPU processes (gloo), a collective over the devices of
two of them runs with only those two taking part, and carries the sender's values to the
receiver's devices, while the third process does nothing. A cross-mesh broadcast would be
such a collective over the devices of its sender and receivers (a psum of the sender's
tile against zeros, here). Three jax processes start: ~3 s on 2 cores."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import textwrap

WORKER = textwrap.dedent(
    """
    import os, sys
    process, count, port = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    import jax
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=count, process_id=process,
                               initialization_timeout=60)
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    group = [d for d in jax.devices() if d.process_index in (0, 1)]
    if process in (0, 1):
        mesh = Mesh(np.array(group), ("g",))
        mine = [d for d in group if d.process_index == process]
        tiles = [np.full((1, 4), (k + 1.0) if process == 0 else 0.0, np.float32) for k in range(len(mine))]
        x = jax.make_array_from_single_device_arrays(
            (len(group), 4), NamedSharding(mesh, P("g")), [jax.device_put(t, d) for t, d in zip(tiles, mine)]
        )
        broadcast = jax.jit(jax.shard_map(lambda a: jax.lax.psum(a, "g"), mesh=mesh, in_specs=P("g"), out_specs=P()))
        y = broadcast(x)
        print("result", process, [np.asarray(s.data).tolist() for s in y.addressable_shards], flush=True)
    else:
        print("idle", process, flush=True)
    jax.distributed.shutdown()
    """
)


def test_a_collective_over_two_of_three_processes(tmp_path):
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    env["XLA_FLAGS"] = re.sub(r"--xla_force_host_platform_device_count=\d+", "", env.get("XLA_FLAGS", ""))
    env["XLA_FLAGS"] += " --xla_force_host_platform_device_count=2"
    workers = [
        subprocess.Popen(
            [sys.executable, str(script), str(p), "3", str(port)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for p in range(3)
    ]
    outputs = [w.communicate(timeout=180) for w in workers]
    assert [w.returncode for w in workers] == [0, 0, 0], [err[-2000:] for _, err in outputs]
    lines = [next(line for line in out.splitlines() if line.startswith(("result", "idle"))) for out, _ in outputs]
    # Each of the sender's 2 devices and the receiver's 2 ends with the sum: 1 + 2 from the
    # sender's two tiles, 0 + 0 from the receiver's.
    assert (
        lines[0]
        == lines[1].replace("result 1", "result 0")
        == "result 0 [[[3.0, 3.0, 3.0, 3.0]], [[3.0, 3.0, 3.0, 3.0]]]"
    )
    assert lines[2] == "idle 2"
