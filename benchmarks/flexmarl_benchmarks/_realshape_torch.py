"""The torch side of `flexmarl bench realshape`, one process: transformers `generate` and a torch Adam step.

    python -m flexmarl_benchmarks._realshape_torch serve --checkpoint DIR --workload DIR --dtype float32 --threads 2

Loads the same directory our side loads (`AutoModelForCausalLM.from_pretrained`), on CUDA when torch sees a GPU,
and answers the parent's commands (see `_side_process.py`). The training step is the one our trainer takes
(GRPO clipped surrogate with the same per-token weights, ratio against the same forward pass, no KL, plain Adam).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

from flexmarl_benchmarks import _side_process
from flexmarl_benchmarks._side_process import progress

CLIP_EPS = 0.2  # the GRPO preset's clip on both sides (train/algorithms.LOSS_SETTINGS)


class TorchSide:
    def __init__(self, checkpoint: str, workload_dir: str, dtype_name: str, threads: int, f32_matmul: str):
        import torch
        from transformers import AutoModelForCausalLM
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
        hf_logging.disable_progress_bar()
        torch.set_num_threads(threads)
        torch.set_float32_matmul_precision("highest" if f32_matmul == "highest" else "high")
        self.torch = torch
        self.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        self.dtype_name = dtype_name
        with open(os.path.join(workload_dir, "workload.json")) as handle:
            self.workload = json.load(handle)
        arrays = np.load(os.path.join(workload_dir, "train_batch.npz"))
        self.batch = {name: torch.from_numpy(np.asarray(arrays[name])).to(self.device) for name in
                      ("tokens", "targets", "positions", "attention_mask", "loss_mask", "token_weights", "advantages")}
        start = time.perf_counter()
        self.model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=getattr(torch, dtype_name))
        self.model.to(self.device).eval()
        self._sync()
        self.load_seconds = time.perf_counter() - start
        self.input_ids, self.attention_mask = self._left_padded(self.workload["prompts"])

    def _sync(self) -> None:
        if self.device.type == "cuda":
            self.torch.cuda.synchronize()

    def _left_padded(self, prompts):
        """generate wants decoder-only prompts left-padded: ids and mask [batch, longest prompt]."""
        torch = self.torch
        width = max(len(p) for p in prompts)
        ids = torch.zeros((len(prompts), width), dtype=torch.long)
        mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for row, prompt in enumerate(prompts):
            ids[row, width - len(prompt):] = torch.tensor(prompt)
            mask[row, width - len(prompt):] = 1
        return ids.to(self.device), mask.to(self.device)

    # ------------------------------------------------------------------ commands
    def info(self) -> dict:
        import transformers

        torch = self.torch
        kind = torch.cuda.get_device_name(self.device) if self.device.type == "cuda" else "cpu"
        return {"params": sum(p.numel() for p in self.model.parameters()), "dtype": self.dtype_name,
                "platform": self.device.type, "device_kind": kind, "load_seconds": self.load_seconds,
                "threads": torch.get_num_threads(), "attn_implementation": self.model.config._attn_implementation,
                "torch_version": torch.__version__, "transformers_version": transformers.__version__}

    def rollout(self, new_tokens: int) -> dict:
        """`generate` on the whole prompt batch: temperature-1 sampling, exactly `new_tokens` tokens each."""
        torch = self.torch
        settings = dict(do_sample=True, temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=new_tokens,
                        min_new_tokens=new_tokens, pad_token_id=0, eos_token_id=2)  # min_new_tokens: EOS ignored
        torch.manual_seed(self.workload["seed"])
        with torch.no_grad():
            self._sync()
            start = time.perf_counter()
            output = self.model.generate(input_ids=self.input_ids, attention_mask=self.attention_mask, **settings)
            self._sync()
            seconds = time.perf_counter() - start
        generated = output.shape[1] - self.input_ids.shape[1]
        if generated != new_tokens:
            raise RuntimeError(f"generate returned {generated} new tokens per row, expected {new_tokens}")
        return {"seconds": seconds, "tokens": new_tokens * output.shape[0]}

    def _loss(self):
        torch, batch = self.torch, self.batch
        logits = self.model(input_ids=batch["tokens"], attention_mask=batch["attention_mask"].long(),
                            position_ids=batch["positions"]).logits
        log_probs = torch.log_softmax(logits.float(), dim=-1)
        picked = log_probs.gather(-1, batch["targets"].long().unsqueeze(-1)).squeeze(-1)
        mask = batch["loss_mask"]
        picked = torch.where(mask, picked, torch.zeros_like(picked))
        ratio = torch.exp(picked - picked.detach())  # old log-probs from the same pass, as our trainer does
        advantages = batch["advantages"]
        per_token = -torch.minimum(ratio * advantages, ratio.clamp(1 - CLIP_EPS, 1 + CLIP_EPS) * advantages)
        return (batch["token_weights"] * torch.where(mask, per_token, torch.zeros_like(per_token))).sum()

    def train_round(self, steps: int, warm_up: int) -> dict:
        """A fresh Adam, `warm_up` untimed and `steps` timed forward+backward+step iterations, then the optimizer
        state is freed."""
        torch = self.torch
        self.model.train()
        optimizer = torch.optim.Adam(self.model.parameters(), lr=1e-6)

        def step() -> float:
            self._sync()
            start = time.perf_counter()
            loss = self._loss()
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            value = float(loss.detach())  # waits for the step
            self._sync()
            seconds = time.perf_counter() - start
            if not np.isfinite(value):
                raise RuntimeError(f"non-finite loss {value}")
            return seconds

        warm_up_seconds = [step() for _ in range(warm_up)]
        seconds = [step() for _ in range(steps)]
        self.model.eval()
        optimizer = None  # frees its state (the closure sees None too)
        _side_process.release_freed_memory()
        return {"step_seconds": seconds, "warm_up_seconds": warm_up_seconds, "rss_gb_after": _side_process.rss_gb()}

    def stats(self) -> dict:
        torch = self.torch
        peak_device = torch.cuda.max_memory_allocated(self.device) / 2**30 if self.device.type == "cuda" else None
        return {"peak_rss_gb": _side_process.peak_rss_gb(), "peak_device_gb": peak_device}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m flexmarl_benchmarks._realshape_torch")
    commands = parser.add_subparsers(dest="command", required=True)
    serve = commands.add_parser("serve", help="answer the parent's commands")
    serve.add_argument("--checkpoint", required=True)
    serve.add_argument("--workload", required=True, help="directory with workload.json and train_batch.npz")
    serve.add_argument("--dtype", choices=("float32", "bfloat16"), required=True)
    serve.add_argument("--threads", type=int, required=True)
    serve.add_argument("--f32-matmul", default="highest", choices=("highest", "tensorfloat32"))
    args = parser.parse_args(argv)
    _side_process.pin_to_cores(args.threads)
    side = TorchSide(args.checkpoint, args.workload, args.dtype, args.threads, args.f32_matmul)
    progress(f"loaded {args.dtype} weights in {side.load_seconds:.1f} s on {side.device}")
    return _side_process.serve({"info": side.info, "rollout": side.rollout, "train_round": side.train_round,
                                "stats": side.stats})


if __name__ == "__main__":
    sys.exit(main())
