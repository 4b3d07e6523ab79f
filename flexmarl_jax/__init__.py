"""flexmarl-jax: multi-agent LLM reinforcement learning on JAX (FlexMARL rollout-training co-design).

Kept import-light on purpose: `flexmarl --help` and config validation must not pull in JAX or TensorFlow.
"""

__version__ = "0.1.0"
