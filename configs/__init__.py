"""Config files (`get_config(variant=None) -> ml_collections.ConfigDict`), big_vision style.

Shipped inside the package as `flexmarl_jax.configs` so that `flexmarl train` finds the embedded default
after any install; pass `--config=configs/tiny.py[:variant]` to pick a file by path.
"""
