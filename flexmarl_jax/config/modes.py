"""The pipeline modes by name (`config.pipeline.mode`); JAX-free, so config validation can list them.

serial: rollout and training colocated, queries one at a time; sync: disaggregated, training after the
whole rollout; flexmarl: disaggregated, micro-batches trained while rollout runs (docs/architecture.md).
"""

PIPELINE_MODES = ("serial", "sync", "flexmarl")
