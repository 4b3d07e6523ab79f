"""The RL algorithms by name (`config.train.algorithm`); JAX-free, so config validation can list them.

`flexmarl_jax.train.algorithms` registers one loss preset per name and checks at import that its registry
holds exactly these names.
"""

ALGORITHM_NAMES = ("grpo", "drgrpo", "dapo", "ppo")
