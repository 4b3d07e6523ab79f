"""One process of `test_ordered_issue.py`'s 2-process run (argv: coordinator port, process id, skew)."""

import json
import sys
import threading
import time

from flexmarl_jax.config import ConfigError, DistributedConfig, RunConfig, check_devices, load_config
from flexmarl_jax.distributed.ordered_issue import OrderedIssuer
from flexmarl_jax.distributed.runtime import join_processes

port, process_id, order = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
processes = join_processes(DistributedConfig(enabled=True, coordinator_address=f"127.0.0.1:{port}",
                                             num_processes=2, process_id=process_id, init_timeout_s=60))

import jax  # noqa: E402 - after joining
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec  # noqa: E402

# The placement check counts every process's devices: 6 fit on 2 x 4, 9 do not (though 4 are local).
config = RunConfig.from_config(load_config("configs/tiny.py:smoke"))
check_devices(config, processes.global_devices)  # 3 agents x (1 + 1) = 6 devices
try:
    check_devices(config.__class__.from_config({**config.to_dict(), "mesh": {
        **config.to_dict()["mesh"], "train_devices_per_agent": 2}}), processes.global_devices)
    too_many = None
except ConfigError as error:
    too_many = str(error)

# A mesh of two devices, one on each process: every computation on it is a collective between the processes.
devices = jax.devices()
spanning = Mesh(np.array([devices[0], devices[processes.local_devices]]), ("data",))
sharding = NamedSharding(spanning, PartitionSpec("data"))
values = jax.make_array_from_callback((2, 1024), sharding, lambda index: np.arange(2048.0).reshape(2, 1024)[index])
computations = {  # different reductions: issued in different orders, their collectives would pair up wrongly
    "sum": jax.jit(lambda x: jnp.sum(x, axis=0), out_shardings=NamedSharding(spanning, PartitionSpec())),
    "max": jax.jit(lambda x: jnp.max(x * 3.0, axis=0), out_shardings=NamedSharding(spanning, PartitionSpec())),
}
# Threads finish in opposite orders on the two processes: "sum" first on process 0, "max" first on process 1.
delays = {"sum": 0.0, "max": 0.4} if process_id == 0 else {"sum": 0.4, "max": 0.0}
issuer = OrderedIssuer()
issuer.expect(["sum", "max"] if order == "schedule" else [])
results, submitted = {}, []


def work(name):
    time.sleep(delays[name])
    submitted.append(name)
    results[name] = np.asarray(issuer.run(name, lambda: computations[name](values).addressable_data(0)))


threads = [threading.Thread(target=work, args=(name,)) for name in computations]
for thread in threads:
    thread.start()
for thread in threads:
    thread.join(60)
issuer.close()
expected = {"sum": np.arange(2048.0).reshape(2, 1024).sum(0), "max": np.arange(1024.0, 2048.0) * 3.0}
print(json.dumps({"process": processes.process_index, "count": processes.process_count,
                  "global_devices": processes.global_devices, "local_devices": processes.local_devices,
                  "too_many": too_many, "submitted": submitted, "issued": issuer.issued,
                  "errors": {name: float(np.max(np.abs(results[name] - expected[name]))) for name in expected}}))
