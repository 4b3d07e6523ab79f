"""Config files (`get_config(variant=None) -> ml_collections.ConfigDict`), big_vision style.

This folder is the one copy of the config files. The package sees it as `flexmarl_jax.configs` (a symbolic
link inside the package), so `flexmarl train` finds the embedded default after an install; pass
`--config=configs/NAME.py[:variant]` to pick a file by path. Each file lists its variants in `VARIANTS`.
"""
