"""The experience store's backends by name (`config.store.backend`); imports nothing, so config validation
can list them without loading TensorStore.

memory: the TensorStore memory driver; file: an OCDBT database under WORKDIR/store (or gs://.../store).
"""

STORE_BACKENDS = ("memory", "file")
