"""Decoder LMs (Qwen2/Llama/Qwen3 family), tokenizers and HF checkpoint I/O.

Kept light: importing this package imports no JAX. Use the submodules:
`config` (ModelConfig), `presets` (PRESETS, get_preset), `tokenizer` (CharTokenizer,
HFTokenizer), `chat_template` (ChatTemplate, load_chat_template), `functional` (init_params,
forward, token_logprobs, init_cache, prefill, decode_step, param_count), `checkpoint`
(from_pretrained, save_pretrained), `hf_directory` (inspect_checkpoint_dir, is_checkpoint_dir),
`synthetic` (make_checkpoint: small random-init HF checkpoints for tests), `tokenizer_files` (the tokenizer
files of an exported model).
"""

from flexmarl_jax.models.config import ModelConfig
from flexmarl_jax.models.presets import PRESETS, get_preset

__all__ = ["PRESETS", "ModelConfig", "get_preset"]
