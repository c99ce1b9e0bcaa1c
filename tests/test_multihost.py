"""Multi-host data parallelism, simulated: two CPU processes under ``jax.distributed`` (gloo),
two devices each, one 4-device mesh. Both processes end with the one-process full-batch
gradients, bitwise alike, with ``check_vma`` (the backward sums at one scale) and without it
(``jax_adaloss.pmean``)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap

import jax
import numpy as np
from test_collectives import uneven_batch, weighted_loss

import jax_adaloss

WORKER = textwrap.dedent("""
    import sys
    pid, port, out = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    sys.path.insert(0, {tests!r})
    import jax
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address=f"localhost:{{port}}", num_processes=2, process_id=pid)
    import numpy as np
    from jax.sharding import NamedSharding, PartitionSpec as P
    from test_collectives import uneven_batch, weighted_loss
    import jax_adaloss
    assert jax.device_count() == 4 and jax.local_device_count() == 2
    cls, params, x, y, w = uneven_batch()
    loss = weighted_loss(cls)
    mesh = jax.make_mesh((4,), ("data",))
    half = slice(pid * 32, (pid + 1) * 32)  # this process's rows
    batch = [jax.make_array_from_process_local_data(NamedSharding(mesh, P("data")), np.asarray(a)[half])
             for a in (x, y, w)]
    spec = (P(), P("data"), P("data"), P("data"))
    vma = lambda p, x, y, w: jax_adaloss.unscale_tree(jax_adaloss.grad(loss)(p, x, y, w))
    pm = lambda p, x, y, w: jax_adaloss.unscale_tree(
        jax_adaloss.pmean(jax_adaloss.grad(loss)(p, x, y, 4.0 * w), "data"))
    got = {{}}
    for name, body, check in (("vma", vma, True), ("pmean", pm, False)):
        f = jax.shard_map(body, mesh=mesh, in_specs=spec, out_specs=P(), check_vma=check)
        g = jax.jit(f)(params, *batch)
        for k, leaf in enumerate(jax.tree.leaves(g)):
            got[f"{{name}}{{k}}"] = np.asarray(leaf.addressable_data(0))
    np.savez(out, **got)
    print("OK", pid)
""")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def test_two_processes_hold_the_one_process_gradients(tmp_path):
    script = tmp_path / "worker.py"
    script.write_text(WORKER.format(tests=os.path.dirname(__file__)))
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2", JAX_PLATFORMS="cpu")
    port = str(_free_port())
    procs = [subprocess.Popen([sys.executable, str(script), str(pid), port, str(tmp_path / f"p{pid}.npz")],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for pid in range(2)]
    outs = [p.communicate(timeout=600) for p in procs]
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0 and "OK" in out, err[-4000:]
    got = [np.load(tmp_path / f"p{pid}.npz") for pid in range(2)]
    cls, params, x, y, w = uneven_batch()
    ref = [np.asarray(a, np.float64) for a in jax.tree.leaves(
        jax_adaloss.unscale_tree(jax.jit(jax_adaloss.grad(weighted_loss(cls)))(params, x, y, w)))]
    for name in ("vma", "pmean"):
        for k, r in enumerate(ref):
            a, b = got[0][f"{name}{k}"], got[1][f"{name}{k}"]
            np.testing.assert_array_equal(a, b, err_msg=f"{name} leaf {k}: processes differ")
            assert np.abs(a - r).max() <= 5e-3 * np.abs(r).max(), (name, k)
