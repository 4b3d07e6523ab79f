"""Several processes, one per host, in one run (docs/architecture.md, "Several hosts").

- `runtime.py`: `join_processes(config.distributed)`: our own probe of the coordinator, then JAX's distributed
  runtime (`jax.distributed.initialize`) with the config's timeouts; gloo collectives on CPU hosts;
- `coordinator_probe.py`: waiting for process 0's coordinator port, so an unreachable coordinator is one clear
  error within `distributed.init_timeout_s`;
- `ordered_issue.py`: every computation on a mesh that spans processes is issued from one thread, in one order
  that every process computes alike;
- `cpu_completion.py`: on CPU hosts, such a computation returns once every local device has done its part;
- `barrier.py`: a barrier of the runtime's key-value service (behind a checkpoint's manifest);
- `leader.py`: process 0 writes the run's files; `leader_value` gives every process its word.

Pure Python at import (this package file): `runtime.py` imports JAX only inside `join_processes`.
"""
