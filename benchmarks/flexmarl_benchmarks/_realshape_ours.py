"""Our side of `flexmarl bench realshape`, one process: `FlexEngine` rollout and the `AgentTrainer` step.

    python -m flexmarl_benchmarks._realshape_ours write DIR --shape real --seed 0
    python -m flexmarl_benchmarks._realshape_ours serve --checkpoint DIR --workload DIR --dtype float32 --threads 2

`write` saves a random-init model with `save_pretrained` (both sides then load that directory). `serve` loads
it with `from_pretrained` and answers the parent's commands (see `_side_process.py`); the parent interleaves
them with the torch side's.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import numpy as np

from flexmarl_benchmarks import _side_process
from flexmarl_benchmarks._side_process import progress
from flexmarl_benchmarks._views import engine_config, loss_config, optimizer_config, trainer_config


def random_params(config, seed: int):
    """(graphdef, params) of `config` drawn with numpy on the host: weights uniform with our initialiser's
    standard deviation, norm scales 1, biases 0. At 0.5B parameters this takes seconds, where
    `functional.init_params` (threefry, compiled without optimisation) takes minutes on a 2-core CPU."""
    from flax import nnx

    from flexmarl_jax.models import functional

    graphdef, abstract = functional.abstract_model(config)
    rng = np.random.default_rng(seed)
    half_width = np.float32(0.02 * 3**0.5)  # uniform(-a, a) has standard deviation a / sqrt(3)
    leaves = []
    for path, variable in nnx.to_flat_state(abstract):
        name = str(path[-1])
        if name == "scale":
            value = np.ones(variable.shape, np.float32)
        elif name.endswith("bias"):
            value = np.zeros(variable.shape, np.float32)
        else:
            value = (rng.random(variable.shape, dtype=np.float32) * 2 - 1) * half_width
        leaves.append((path, variable.replace(value)))
    return graphdef, nnx.from_flat_state(leaves)


def write_checkpoint(directory: str, config_json: str, seed: int) -> None:
    """Random-init weights of the shape in `config_json` (a ModelConfig as HF config.json) -> `directory`."""
    from flexmarl_jax.models import functional
    from flexmarl_jax.models.checkpoint import save_pretrained
    from flexmarl_jax.models.config import ModelConfig

    with open(config_json) as handle:
        config = ModelConfig.from_hf_config(json.load(handle))
    start = time.perf_counter()
    model = random_params(config, seed)
    save_pretrained(model, directory)
    progress(f"wrote {functional.param_count(model[1]) / 1e6:.1f}M random parameters to {directory} "
             f"in {time.perf_counter() - start:.1f} s")


class OurSide:
    """Loaded weights plus the engine and trainer built from them; the handlers are the parent's commands."""

    def __init__(self, checkpoint: str, workload_dir: str, dtype_name: str, f32_matmul: str):
        import jax
        import jax.numpy as jnp

        from flexmarl_jax.models.checkpoint import from_pretrained

        if jax.default_backend() != "cpu" and dtype_name == "float32":
            jax.config.update("jax_default_matmul_precision", f32_matmul)  # "highest": no TF32 on GPUs
        with open(os.path.join(workload_dir, "workload.json")) as handle:
            self.workload = json.load(handle)
        self.batch_arrays = dict(np.load(os.path.join(workload_dir, "train_batch.npz")))
        self.dtype_name = dtype_name
        start = time.perf_counter()
        self.model_config, self.graphdef, self.params = from_pretrained(checkpoint, dtype=jnp.dtype(dtype_name))
        jax.block_until_ready(self.params)
        self.load_seconds = time.perf_counter() - start
        self.engine = None

    # ------------------------------------------------------------------ commands
    def info(self) -> dict:
        import jax

        from flexmarl_jax.models import functional
        from flexmarl_jax.rollout import jetstream_compat

        device = jax.devices()[0]
        return {"params": functional.param_count(self.params), "dtype": self.dtype_name,
                "platform": device.platform, "device_kind": device.device_kind, "load_seconds": self.load_seconds,
                "threads": len(os.sched_getaffinity(0)), "jetstream_engine_base": jetstream_compat.JETSTREAM_AVAILABLE,
                "jax_version": jax.__version__}

    def _requests(self, new_tokens: int):
        from flexmarl_jax.rollout.engine import SlotSampling
        from flexmarl_jax.rollout.loop import RolloutRequest

        seed = self.workload["seed"]
        return [RolloutRequest(tuple(prompt), max_new_tokens=new_tokens, ignore_eos=True,
                               sampling=SlotSampling(temperature=1.0, seed=seed + index))
                for index, prompt in enumerate(self.workload["prompts"])]

    def _engine(self):
        if self.engine is None:
            from flexmarl_jax.models.tokenizer import CharTokenizer
            from flexmarl_jax.rollout.engine import FlexEngine

            prompts = self.workload["prompts"]
            bucket = 1 << (max(len(p) for p in prompts) - 1).bit_length()
            # One bucket and a prefill batch of all prompts: the loop prefills them in one call, as generate does.
            config = engine_config(max_concurrent_decodes=len(prompts), max_prefill_length=bucket,
                                   max_decode_length=self.workload["new_tokens"], prefill_buckets=(bucket,),
                                   prefill_batch_sizes=tuple(sorted({1, len(prompts)})))
            # The token ids are random; the tokenizer only supplies the pad id (EOS is ignored).
            self.engine = FlexEngine(self.model_config, self.graphdef, config, CharTokenizer())
        return self.engine

    def rollout(self, new_tokens: int) -> dict:
        """Every prompt once through the in-process loop, `new_tokens` sampled tokens each (EOS ignored)."""
        from flexmarl_jax.rollout.loop import RolloutLoop

        loop = RolloutLoop(self._engine(), self.params)
        requests = self._requests(new_tokens)
        start = time.perf_counter()
        results = loop.generate(requests)
        seconds = time.perf_counter() - start
        lengths = {len(r.token_ids) for rs in results for r in rs}
        if lengths != {new_tokens}:
            raise RuntimeError(f"expected {new_tokens} tokens per sequence, got lengths {sorted(lengths)}")
        return {"seconds": seconds, "tokens": new_tokens * len(requests), "steps": loop.steps}

    def rollout_breakdown(self, repeats: int = 5) -> dict:
        """Median ms of one batched prefill (all prompts) and of one generate step over all slots."""
        import jax

        from flexmarl_jax.rollout.engine_tokenizer import pad_prompt

        engine = self._engine()
        prompts = self.workload["prompts"]
        padded = np.stack([pad_prompt(p, engine.config, 0)[0] for p in prompts])
        lengths = [len(p) for p in prompts]
        state = engine.init_decode_state()
        prefills, steps = [], []
        for _ in range(repeats):
            start = time.perf_counter()
            prefix = engine.prefill_batch(self.params, padded, lengths, [None] * len(prompts))
            jax.block_until_ready(prefix.next_logits)
            prefills.append(time.perf_counter() - start)
            start = time.perf_counter()
            state, result = engine.generate(self.params, state)
            result.convert_to_numpy()
            steps.append(time.perf_counter() - start)
        return {"prefill_ms": statistics.median(prefills) * 1e3, "generate_step_ms": statistics.median(steps) * 1e3}

    def make_trainer(self):
        """(a trainer that owns the weights, donated; the training micro-batch): the bench's GRPO + Adam step."""
        from flexmarl_jax.train.batch import MicroBatch
        from flexmarl_jax.train.trainer import AgentTrainer

        rows, length = self.workload["train_rows"], self.workload["train_len"]
        config = trainer_config(micro_batch_size=rows, max_len=length,
                                loss=loss_config(name="grpo", aggregation="token_mean"),
                                optimizer=optimizer_config(name="adam", learning_rate=1e-6, max_grad_norm=None),
                                donate_params=True)
        trainer = AgentTrainer("bench", self.model_config, config, initial=(self.graphdef, self.params))
        self.params = None
        return trainer, MicroBatch(**self.batch_arrays, agent="bench")

    def train_round(self, steps: int, warm_up: int) -> dict:
        """Builds a trainer on the current weights, runs `warm_up` untimed and `steps` timed accumulate+apply
        steps, then frees its state.

        The optimizer state lives only for the round, so the torch side's round never shares the host with it.
        A new trainer compiles its steps again, so every round starts with untimed warm-up steps (the parent asks
        both sides for the same number). In the first bfloat16 round two of them compile both variants of the
        apply step: optax's moments start in bfloat16 and turn float32 after the first update.
        """
        self.engine = None  # the rollout is over: nothing else holds the weights, so they may be donated
        trainer, batch = self.make_trainer()

        def step() -> float:
            start = time.perf_counter()
            trainer.accumulate(batch)
            metrics = trainer.apply()  # returns host floats: the step has finished
            seconds = time.perf_counter() - start
            if not np.isfinite(metrics["loss"]):
                raise RuntimeError(f"non-finite loss {metrics['loss']}")
            return seconds

        warm_up_seconds = [step() for _ in range(warm_up)]
        seconds = [step() for _ in range(steps)]
        self.params = trainer.params
        trainer = batch = None  # frees the optimizer state and accumulator (the closure sees None too)
        _side_process.release_freed_memory()
        return {"step_seconds": seconds, "warm_up_seconds": warm_up_seconds, "rss_gb_after": _side_process.rss_gb()}

    def stats(self) -> dict:
        import jax

        device = jax.devices()[0]
        memory = device.memory_stats() if device.platform != "cpu" else None
        peak_device = memory.get("peak_bytes_in_use") / 2**30 if memory else None
        return {"peak_rss_gb": _side_process.peak_rss_gb(), "peak_device_gb": peak_device}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m flexmarl_benchmarks._realshape_ours")
    commands = parser.add_subparsers(dest="command", required=True)
    write = commands.add_parser("write", help="write a random-init checkpoint")
    write.add_argument("directory")
    write.add_argument("--config-json", required=True, help="the model shape as an HF config.json")
    write.add_argument("--seed", type=int, default=0)
    serve = commands.add_parser("serve", help="answer the parent's commands")
    serve.add_argument("--checkpoint", required=True)
    serve.add_argument("--workload", required=True, help="directory with workload.json and train_batch.npz")
    serve.add_argument("--dtype", choices=("float32", "bfloat16"), required=True)
    serve.add_argument("--threads", type=int, required=True)
    serve.add_argument("--f32-matmul", default="highest", choices=("highest", "tensorfloat32"))
    args = parser.parse_args(argv)
    if args.command == "write":
        write_checkpoint(args.directory, args.config_json, args.seed)
        return 0
    _side_process.pin_to_cores(args.threads)  # before JAX starts its thread pools
    side = OurSide(args.checkpoint, args.workload, args.dtype, args.f32_matmul)
    progress(f"loaded {args.dtype} weights in {side.load_seconds:.1f} s")
    return _side_process.serve({"info": side.info, "rollout": side.rollout, "breakdown": side.rollout_breakdown,
                                "train_round": side.train_round, "stats": side.stats})


if __name__ == "__main__":
    sys.exit(main())
