"""One of 2 processes x 2 fake CPU devices: two independent computations on a mesh of all 4 devices, called back
to back ITERATIONS times through `cpu_completion.completed`; prints a JSON report on its last line.

argv: PORT PROCESS_ID ITERATIONS"""

import json
import sys

import jax
import numpy as np

port, process_id, iterations = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
jax.config.update("jax_cpu_collectives_implementation", "gloo")
jax.config.update("jax_cpu_enable_async_dispatch", False)  # as distributed/runtime.py joins a run
jax.distributed.initialize(f"127.0.0.1:{port}", 2, process_id)

from jax.sharding import Mesh, NamedSharding, PartitionSpec  # noqa: E402

from flexmarl_jax.distributed.cpu_completion import completed, needs_completion  # noqa: E402
from flexmarl_jax.transfer.across_processes import from_host  # noqa: E402

mesh = Mesh(np.array(jax.devices()), ("x",))
rows, whole = NamedSharding(mesh, PartitionSpec("x")), NamedSharding(mesh, PartitionSpec())
double = completed(jax.jit(lambda a: a * 2, out_shardings=whole))  # an all-gather of 4 KiB
increment = completed(jax.jit(lambda b: b + 1, out_shardings=whole))  # an all-gather of 256 B, unrelated
big, small = np.arange(1024, dtype=np.float32), np.arange(64, dtype=np.float32)
a, b = from_host(big, rows), from_host(small, rows)
wrong = 0
for iteration in range(iterations):
    doubled, incremented = double(a), increment(b)
    if iteration % 100 == 99:  # checked on the first local device only: reading it waits for that device alone
        wrong += int(not np.array_equal(np.asarray(doubled.addressable_data(0)), big * 2))
        wrong += int(not np.array_equal(np.asarray(incremented.addressable_data(0)), small + 1))
wrong += sum(int(not np.array_equal(np.asarray(shard.data), big * 2)) for shard in doubled.addressable_shards)
wrong += sum(int(not np.array_equal(np.asarray(shard.data), small + 1)) for shard in incremented.addressable_shards)
print(json.dumps({"process": jax.process_index(), "local_devices": jax.local_device_count(),
                  "needs_completion": needs_completion(mesh), "iterations": iterations, "wrong": wrong}))
