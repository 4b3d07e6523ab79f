"""Where the training step's time goes at Qwen2.5-0.5B's shape, ours vs torch: the profile behind
`flexmarl bench realshape`'s `train_speedup_vs_torch`.

    flexmarl bench realshape_profile --json profile.json     (about 8 minutes on 2 cores)

Three measurements, float32, 2 threads per side, each side in its own process, medians of 3 after one warm-up:

  step    the bench's training step (4 x 256 tokens, random-init Qwen2.5-0.5B) in phases: ours forward loss,
          forward+backward(+accumulate), optimizer apply; torch forward loss, forward+backward, Adam step
  head    the tied LM head alone (896 -> 151936) with log-softmax and gather, forward and forward+backward
  layers  Qwen2.5-0.5B's decoder layers with a small head (4 layers, vocabulary 1024): forward and
          forward+backward; torch with sdpa and with eager attention; ours also with attention taken out
          (`--no-attention` variant: q * v), which splits the layers' backward into attention and the rest

The step's workload and checkpoint are the bench's own (`benchmarks/flexmarl_benchmarks/realshape.py`).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

BATCH, LENGTH, LAYERS, SMALL_VOCAB = 4, 256, 4, 1024


def _median_seconds(call, repeats: int = 3) -> float:
    call()  # compiles / allocates
    seconds = []
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        seconds.append(time.perf_counter() - start)
    return statistics.median(seconds)


def _pin() -> None:
    os.sched_setaffinity(0, sorted(os.sched_getaffinity(0))[:2])


# ---------------------------------------------------------------------------------------------------- ours
def ours_step(workdir: str) -> dict:
    import jax

    from flexmarl_benchmarks._realshape_ours import OurSide

    side = OurSide(os.path.join(workdir, "checkpoint"), workdir, "float32", "highest")
    trainer, batch = side.make_trainer()
    (placed,) = trainer._place_passes(batch)
    steps = trainer._steps
    forward = jax.jit(lambda trainable, b: steps.loss_and_metrics(trainable, None, b)[0])

    def accumulate():
        trainer._accum = steps.accumulate_step(trainer._trainable, trainer._reference, trainer._accum, placed)
        jax.block_until_ready(trainer._accum)

    def apply():
        trainer._pending_micro_batches = 1  # the accumulator holds gradients from `accumulate` above
        trainer.apply()

    def full_step():
        trainer.accumulate(batch)
        trainer.apply()

    return {"forward_loss_s": _median_seconds(lambda: forward(trainer._trainable, placed).block_until_ready()),
            "forward_backward_s": _median_seconds(accumulate), "optimizer_s": _median_seconds(apply),
            "step_s": _median_seconds(full_step)}


def ours_head(hidden: np.ndarray, weight: np.ndarray, targets: np.ndarray) -> dict:
    import jax
    import jax.numpy as jnp

    from flexmarl_jax.models.functional import token_logprobs
    from flexmarl_jax.models.projection import project

    def loss(x, w):
        return token_logprobs(project("bte,ve->btv", x, w, preferred_element_type=jnp.float32), targets).sum()

    forward, gradient = jax.jit(loss), jax.jit(jax.grad(loss, argnums=(0, 1)))
    x, w = jnp.asarray(hidden), jnp.asarray(weight)
    return {"forward_s": _median_seconds(lambda: forward(x, w).block_until_ready()),
            "forward_backward_s": _median_seconds(lambda: jax.block_until_ready(gradient(x, w)))}


def ours_layers(tokens: np.ndarray, targets: np.ndarray, *, attention: bool) -> dict:
    import jax
    import jax.numpy as jnp

    from flexmarl_jax.models import functional, layers
    from flexmarl_jax.models.presets import get_preset

    if not attention:  # the layer without its attention: isolates the projections, MLP, norms and RoPE
        def no_attention(self, q, k, v, mask):
            return q * jnp.repeat(v, q.shape[2] // k.shape[2], axis=2)

        layers.Attention._attend = no_attention
    config = dataclasses.replace(get_preset("qwen2.5-0.5b"), num_layers=LAYERS, vocab_size=SMALL_VOCAB)
    graphdef, params = functional.init_params(config, seed=0)
    ids, goal = jnp.asarray(tokens, jnp.int32), jnp.asarray(targets, jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(LENGTH, dtype=jnp.int32), (BATCH, LENGTH))
    mask = jnp.ones((BATCH, LENGTH), bool)

    def loss(p):
        return functional.token_logprobs(functional.forward(graphdef, p, ids, positions, mask), goal).sum()

    forward, gradient = jax.jit(loss), jax.jit(jax.grad(loss))
    return {"forward_s": _median_seconds(lambda: forward(params).block_until_ready()),
            "forward_backward_s": _median_seconds(lambda: jax.block_until_ready(gradient(params)))}


# ---------------------------------------------------------------------------------------------------- torch
def torch_step(workdir: str) -> dict:
    from flexmarl_benchmarks._realshape_torch import TorchSide

    side = TorchSide(os.path.join(workdir, "checkpoint"), workdir, "float32", 2, "highest")
    torch = side.torch
    side.model.train()
    optimizer = torch.optim.Adam(side.model.parameters(), lr=1e-6)

    def forward_backward():
        loss = side._loss()
        loss.backward()
        float(loss.detach())

    def full_step():
        forward_backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return {"forward_loss_s": _median_seconds(lambda: float(side._loss().detach())),
            "forward_backward_s": _median_seconds(forward_backward),
            "optimizer_s": _median_seconds(optimizer.step), "step_s": _median_seconds(full_step)}


def torch_head(hidden: np.ndarray, weight: np.ndarray, targets: np.ndarray) -> dict:
    import torch

    x, w = torch.from_numpy(hidden).requires_grad_(), torch.from_numpy(weight).requires_grad_()
    goal = torch.from_numpy(targets)

    def loss():
        logprobs = torch.log_softmax(torch.nn.functional.linear(x, w).float(), -1)
        return logprobs.gather(-1, goal.unsqueeze(-1)).sum()

    def forward_backward():
        x.grad = w.grad = None
        loss().backward()

    with torch.no_grad():
        forward = _median_seconds(lambda: float(loss()))
    return {"forward_s": forward, "forward_backward_s": _median_seconds(forward_backward)}


def torch_layers(tokens: np.ndarray, targets: np.ndarray, *, attention: str) -> dict:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from flexmarl_jax.models.presets import get_preset

    hf = dict(get_preset("qwen2.5-0.5b").to_hf_config(), num_hidden_layers=LAYERS, vocab_size=SMALL_VOCAB)
    torch.manual_seed(0)
    config = AutoConfig.for_model(hf.pop("model_type"), **{k: v for k, v in hf.items()
                                                          if k not in ("architectures", "torch_dtype", "dtype")})
    config._attn_implementation = attention
    model = AutoModelForCausalLM.from_config(config).float().train()
    ids, goal = torch.from_numpy(tokens), torch.from_numpy(targets)

    def loss():
        logprobs = torch.log_softmax(model(input_ids=ids).logits.float(), -1)
        return logprobs.gather(-1, goal.unsqueeze(-1)).sum()

    def forward_backward():
        model.zero_grad(set_to_none=True)
        loss().backward()

    with torch.no_grad():
        forward = _median_seconds(lambda: float(loss()))
    return {"forward_s": forward, "forward_backward_s": _median_seconds(forward_backward)}


# ---------------------------------------------------------------------------------------------------- driver
def _inputs(vocab: int, hidden_size: int):
    rng = np.random.default_rng(0)
    hidden = rng.normal(size=(1, BATCH * LENGTH, hidden_size)).astype(np.float32)
    weight = (0.02 * rng.normal(size=(vocab, hidden_size))).astype(np.float32)
    return (hidden, weight, rng.integers(0, vocab, size=(1, BATCH * LENGTH)),
            rng.integers(0, SMALL_VOCAB, size=(BATCH, LENGTH)), rng.integers(0, SMALL_VOCAB, size=(BATCH, LENGTH)))


def part(name: str, workdir: str) -> dict:
    """One measurement in this (fresh) process."""
    _pin()
    from flexmarl_jax.models.presets import get_preset

    shape = get_preset("qwen2.5-0.5b")
    hidden, weight, head_targets, tokens, targets = _inputs(shape.vocab_size, shape.hidden_size)
    if name.startswith("torch"):
        import torch

        torch.set_num_threads(2)
    return {
        "ours_step": lambda: ours_step(workdir),
        "torch_step": lambda: torch_step(workdir),
        "ours_head": lambda: ours_head(hidden, weight, head_targets),
        "torch_head": lambda: torch_head(hidden, weight, head_targets),
        "ours_layers": lambda: ours_layers(tokens, targets, attention=True),
        "ours_layers_no_attention": lambda: ours_layers(tokens, targets, attention=False),
        "torch_layers_sdpa": lambda: torch_layers(tokens, targets, attention="sdpa"),
        "torch_layers_eager": lambda: torch_layers(tokens, targets, attention="eager"),
    }[name]()


PARTS = ("ours_step", "torch_step", "ours_head", "torch_head", "ours_layers", "ours_layers_no_attention",
         "torch_layers_sdpa", "torch_layers_eager")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", metavar="PATH")
    parser.add_argument("--part", choices=PARTS, help=argparse.SUPPRESS)  # a child process's one measurement
    parser.add_argument("--workdir", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.part:
        print(json.dumps(part(args.part, args.workdir)), flush=True)
        return 0

    from flexmarl_benchmarks import realshape

    env = realshape._worker_env()
    result = {}
    with tempfile.TemporaryDirectory(prefix="flexmarl-profile-") as workdir:
        config = realshape.SHAPES["real"]
        workload_args = argparse.Namespace(seed=0, prompt_len=(24, 32), batch=16, new_tokens=64, train_rows=BATCH,
                                           train_len=LENGTH)
        workload = realshape.make_workload(config, workload_args)
        with open(os.path.join(workdir, "workload.json"), "w") as handle:
            json.dump(dataclasses.asdict(workload), handle)
        realshape.write_train_batch(workload, config.vocab_size, os.path.join(workdir, "train_batch.npz"))
        with open(os.path.join(workdir, "shape.json"), "w") as handle:
            json.dump(config.to_hf_config(), handle)
        subprocess.run([sys.executable, "-m", "flexmarl_benchmarks._realshape_ours", "write",
                        os.path.join(workdir, "checkpoint"), "--config-json", os.path.join(workdir, "shape.json")],
                       check=True, env=env)
        for name in PARTS:
            done = subprocess.run([sys.executable, os.path.abspath(__file__), "--part", name, "--workdir", workdir],
                                  check=True, capture_output=True, text=True, env=env)
            result[name] = json.loads(done.stdout.strip().splitlines()[-1])
            print(f"{name}: {result[name]}", file=sys.stderr, flush=True)
    ours, torch_ = result["ours_layers"], result["torch_layers_sdpa"]
    result["summary"] = {
        "step_ratio_torch_over_ours": result["torch_step"]["step_s"] / result["ours_step"]["step_s"],
        "layers_backward_s": {"ours": ours["forward_backward_s"] - ours["forward_s"],
                              "torch": torch_["forward_backward_s"] - torch_["forward_s"]},
        "layers_backward_without_attention_s": result["ours_layers_no_attention"]["forward_backward_s"]
        - result["ours_layers_no_attention"]["forward_s"],
        "head_forward_backward_s": {"ours": result["ours_head"]["forward_backward_s"],
                                    "torch": result["torch_head"]["forward_backward_s"]},
    }
    print(json.dumps(result["summary"], indent=1))
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(result, handle, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
