"""`FlexEngine`: our decoder LM behind JetStream's `Engine` API.

Slot design. The decode state holds `max_concurrent_decodes` rows ("slots"). Each slot
carries its KV cache row, the logits for its *next* token, the position that token
will occupy, how many tokens it has generated, its sampling settings and its own PRNG
key. `prefill` runs the prompt once and keeps the last prompt position's logits;
`insert` copies that prefix into one or more slots (the n samples of one prompt share
one prefill; `prefill_batch` prefills several same-bucket prompts in one call);
`generate` samples one token per slot from the stored logits, records its behaviour
log-prob, and runs one decode step so the slot holds the logits for the
token after it. So the first `generate` after `insert` emits the first new token,
exactly as JetStream's Driver expects. (The prefix and the decode state are in decode_state.py.)

Compiles stay bounded: prefill and insert compile once per (prompt-length bucket,
prefill batch size), generate once per slot bucket (the leading slots it steps). Sampling settings,
seeds and slot indices are traced values.
Per-slot randomness is `fold_in(key(seed, sample_index), tokens_generated)`, so a
sequence's tokens do not depend on which slot it landed in or who else is decoding.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from flexmarl_jax.mesh.meshes import make_mesh
from flexmarl_jax.models import functional
from flexmarl_jax.models.config import ModelConfig
from flexmarl_jax.models.lora import AdaptedParams, AdapterBatch, LoraSpec, adapter_row, write_adapter_row
from flexmarl_jax.rollout import engine_api
from flexmarl_jax.rollout.decode_state import GREEDY, MIN_SLOT_BUCKET, DecodeState, Prefix, SlotSampling
from flexmarl_jax.rollout.engine_shape import EngineShapeFromConfig
from flexmarl_jax.rollout.engine_tokenizer import FlexTokenizer
from flexmarl_jax.rollout.results import LogProbResultTokens
from flexmarl_jax.rollout.sampling import sample_tokens
from flexmarl_jax.rollout.settings import EngineConfig


class FlexEngine(EngineShapeFromConfig, engine_api.Engine):
    """Our model behind JetStream's Engine API (see the module docstring for the slot design).

    Args:
      model_config: shapes of the model.
      graphdef: the NNX graph definition from `functional.init_params` (static under jit).
      engine_config: slots, prompt buckets and cache length.
      tokenizer: our Tokenizer (models/tokenizer.py); drives stop tokens and the Driver's tokenizer.
      mesh: the engine's (sub-)mesh; the decode state lives replicated on it. Defaults to device 0.
      params: what `load_params()` returns (optional): the model's params, or `AdaptedParams` (models/lora.py),
        one frozen base and a table of LoRA adapters, for an engine that serves several agents of one base at
        once; each prompt then names its adapter (`prefill_batch(adapters=)`) and its slots decode with it.
      default_sampling: used when `prefill` is called without `sampling` (JetStream's Driver does).
      cache_dtype: dtype of the KV cache; default the dtype of `params` (float32 without params), so a
        bfloat16 agent's cache takes half the memory and attention reads it without casts.
    """

    def __init__(
        self,
        model_config: ModelConfig,
        graphdef: Any,
        engine_config: EngineConfig,
        tokenizer: Any,
        *,
        mesh: Mesh | None = None,
        params: Any = None,
        default_sampling: SlotSampling = GREEDY,
        cache_dtype: Any = None,
    ):
        self.model_config = model_config
        self.graphdef = graphdef
        self.config = engine_config
        self.tokenizer = tokenizer
        self._mesh = mesh if mesh is not None else make_mesh(jax.devices()[:1], fsdp=1)
        self._params = params
        self.default_sampling = default_sampling
        if cache_dtype is None:
            base = params.base if isinstance(params, AdaptedParams) else params
            cache_dtype = jax.tree.leaves(base)[0].dtype if base is not None else jnp.float32
        self.cache_dtype = jnp.dtype(cache_dtype)
        self._replicated = NamedSharding(self._mesh, PartitionSpec())
        cache_sharding = functional.cache_shardings(
            self._mesh, engine_config.max_concurrent_decodes, model_config, engine_config.cache_length
        )
        rep = self._replicated
        state_shardings = DecodeState(
            cache={"k": cache_sharding, "v": cache_sharding}, next_logits=rep, positions=rep, generated=rep,
            temperature=rep, top_k=rep, top_p=rep, seed=rep, sample_index=rep, adapter=rep,
        )
        # Every entry point hands the decode state back with the shardings `init_decode_state` gives it. Left to
        # XLA, a one-device mesh's outputs come back as SingleDeviceSharding: a fresh state and a stepped one are
        # then two cache keys, and the first insert into a fresh state compiled again after `warm_up`.
        self._init_state_jit = jax.jit(self._init_state_impl, out_shardings=state_shardings)
        self._prefill_jit = jax.jit(self._prefill_impl)
        # Donating the decode state lets XLA update the KV cache in place.
        self._insert_jit = jax.jit(self._insert_impl, donate_argnums=(1,), out_shardings=state_shardings)
        # `live` (static) is the number of leading slots stepped: one compile per slot bucket.
        self._generate_jit = jax.jit(self._generate_impl, donate_argnums=(1,), static_argnums=(2,),
                                     out_shardings=(state_shardings, rep))
        self._move_jit = jax.jit(self._move_impl, donate_argnums=(0,), out_shardings=state_shardings)
        # The table goes in donated, so replacing one adapter writes its row in place; the row index is traced.
        self._write_adapter_jit = jax.jit(write_adapter_row, donate_argnums=(0,))

    # ----------------------------------------------------------------- Engine API
    def load_params(self, *args, **kwargs) -> Any:
        if self._params is None:
            raise ValueError("FlexEngine was built without params; pass params= or use your own loader")
        return self._params

    def prefill(
        self,
        *,
        params: Any,
        existing_prefix: Prefix | None = None,
        padded_tokens: jax.Array | np.ndarray,
        true_length: int,
        sampling: SlotSampling | None = None,
        adapter: int = 0,
    ) -> Prefix:
        """Runs the prompt [bucket] (right-padded, `true_length` real tokens) through the model.

        `sampling` (our extension) fixes how the samples of this prompt will be drawn;
        without it the engine's `default_sampling` applies. `adapter` (our extension): its row of the
        adapter table, with `AdaptedParams`.
        """
        if existing_prefix is not None:
            raise NotImplementedError("FlexEngine does not continue from an existing prefix")
        padded_tokens = np.asarray(padded_tokens, dtype=np.int32)
        if padded_tokens.ndim != 1:
            raise ValueError(f"padded_tokens shape {padded_tokens.shape} must be [bucket]")
        return self.prefill_batch(params, padded_tokens[None], [int(true_length)], [sampling], [adapter])

    def prefill_batch(self, params: Any, padded_tokens, true_lengths, samplings, adapters=None) -> Prefix:
        """Prefills several prompts of one bucket in one call (our extension of the API).

        padded_tokens: [rows, bucket] right-padded; true_lengths: [rows]; samplings: one
        SlotSampling (or None for the default) per row. `rows` must be one of
        `config.prefill_batch_sizes` (pad with dummy rows), so compiles stay bounded. adapters: with
        `AdaptedParams`, each row's row of the adapter table (default all 0); the slots it is inserted into
        decode with that adapter.
        """
        padded_tokens = np.asarray(padded_tokens, dtype=np.int32)
        rows = padded_tokens.shape[0] if padded_tokens.ndim == 2 else -1
        if rows not in self.config.prefill_batch_sizes or padded_tokens.shape[1] not in self.config.prefill_buckets:
            raise ValueError(
                f"padded_tokens shape {padded_tokens.shape} must be [rows, bucket] with rows in "
                f"{self.config.prefill_batch_sizes} and bucket in {self.config.prefill_buckets}"
            )
        true_lengths = np.asarray(true_lengths, dtype=np.int32)
        if true_lengths.shape != (rows,) or len(samplings) != rows:
            raise ValueError(f"need {rows} true_lengths and samplings, got {true_lengths.shape} / {len(samplings)}")
        if np.any(true_lengths < 1) or np.any(true_lengths > padded_tokens.shape[1]):
            raise ValueError(f"true_lengths {true_lengths.tolist()} must be in [1, {padded_tokens.shape[1]}]")
        adapters = _adapter_rows(params, adapters, rows)
        samplings = [s or self.default_sampling for s in samplings]
        settings = (
            np.asarray([s.temperature for s in samplings], np.float32),
            np.asarray([s.top_k for s in samplings], np.int32),
            np.asarray([s.top_p for s in samplings], np.float32),
            np.asarray([s.seed % (2**31) for s in samplings], np.int32),
        )
        return self._prefill_jit(params, padded_tokens, true_lengths, *settings, adapters)

    def insert(self, prefix: Prefix, decode_state: DecodeState, slot: int, *, sample_index: int = 0,
               row: int = 0) -> DecodeState:
        """Puts prompt `row` of `prefix` into `slot` (JetStream API); `sample_index` picks the
        sample's random stream."""
        return self.insert_many(prefix, decode_state, [slot], [sample_index], [row])

    def insert_many(self, prefix: Prefix, decode_state: DecodeState, slots, sample_indices,
                    rows=None) -> DecodeState:
        """Puts prefix rows into several slots at once (the n samples of a prompt share its prefill).

        slots / sample_indices / rows: equal-length int sequences; slot ids distinct in
        [0, max_concurrent_decodes); rows (default all 0) index the prefix's prompts.
        """
        slots = [int(s) for s in slots]
        rows = [0] * len(slots) if rows is None else [int(r) for r in rows]
        prefix_rows = prefix.true_length.shape[0]
        if len(slots) != len(sample_indices) or len(slots) != len(rows) or not slots:
            raise ValueError(f"need matching non-empty slots {slots}, sample_indices {list(sample_indices)} "
                             f"and rows {rows}")
        if len(set(slots)) != len(slots) or not all(0 <= s < self.max_concurrent_decodes for s in slots):
            raise ValueError(f"slots {slots} must be distinct and in [0, {self.max_concurrent_decodes})")
        if not all(0 <= r < prefix_rows for r in rows):
            raise ValueError(f"rows {rows} must be in [0, {prefix_rows})")
        # Fixed-size index vectors (unused entries point past the end and are dropped) keep
        # one compiled insert per (bucket, prefix rows) whatever the number of samples.
        size = self.max_concurrent_decodes
        slot_vector = np.full((size,), size, dtype=np.int32)
        index_vector = np.zeros((size,), dtype=np.int32)
        row_vector = np.zeros((size,), dtype=np.int32)
        slot_vector[: len(slots)] = slots  # the used entries come first (the insert loop relies on it)
        index_vector[: len(slots)] = [int(i) for i in sample_indices]
        row_vector[: len(slots)] = rows
        return self._insert_jit(prefix, decode_state, slot_vector, index_vector, row_vector)

    def generate(self, params: Any, decode_state: DecodeState, live_slots: int | None = None
                 ) -> tuple[DecodeState, LogProbResultTokens]:
        """One token for every slot (inactive slots compute garbage that callers ignore).

        `live_slots` (our extension): every occupied slot is below it, so only the leading slots need a
        step. The engine steps the smallest slot bucket that covers it (`slot_bucket`); the result still
        has a row per slot, invalid past the bucket. A step costs about linearly in the slots stepped on a
        CPU, so a tail of a few sequences no longer pays for all of them.
        """
        return self._generate_jit(params, decode_state, self.slot_bucket(live_slots))

    def replace_adapter(self, params: AdaptedParams, index: int, adapter, spec: LoraSpec) -> AdaptedParams:
        """`params` with row `index` of its adapter table replaced by `adapter` (a LoRA agent's new version;
        its rank at most the table's), the base and every other row untouched. The table is written in place:
        `params` must not be used afterwards. Slots decoding with another row are unaffected; a slot decoding
        with row `index` would continue on the new weights, so a caller replaces only rows no slot uses
        (rollout/loop.py keeps a spare row per agent for this)."""
        if not isinstance(params, AdaptedParams):
            raise TypeError(f"replace_adapter needs AdaptedParams (a base and an adapter table), got "
                            f"{type(params).__name__}")
        row = adapter_row(params.table, index, adapter, spec)
        table = self._write_adapter_jit(params.table, np.int32(index), row, np.float32(spec.scale))
        return AdaptedParams(params.base, table)

    def move_slots(self, decode_state: DecodeState, sources, destinations) -> DecodeState:
        """Moves what slots `sources` hold into the free slots `destinations` (our extension). The loop moves
        its last occupied slots into free ones below them when that lets `generate` step a smaller slot bucket.
        A slot's random stream does not depend on its place, so a moved sequence samples exactly as it would
        have stayed."""
        sources, destinations = [int(s) for s in sources], [int(d) for d in destinations]
        size = self.max_concurrent_decodes
        if (len(sources) != len(destinations) or len(set(sources + destinations)) != 2 * len(sources)
                or not all(0 <= s < size for s in sources + destinations)):
            raise ValueError(f"sources {sources} and destinations {destinations} must be equally many distinct "
                             f"slots in [0, {size})")
        # Fixed-size vectors (unused entries past the end) keep one compile whatever the number of moves.
        source_vector = np.full((size,), size, np.int32)
        destination_vector = np.full((size,), size, np.int32)
        source_vector[: len(sources)] = sources
        destination_vector[: len(sources)] = destinations
        return self._move_jit(decode_state, source_vector, destination_vector)

    def slot_bucket(self, live_slots: int | None) -> int:
        """Leading slots one generate steps for `live_slots` occupied: a power of two of at least
        MIN_SLOT_BUCKET, or all of them (few buckets keep the compiles bounded)."""
        slots = self.max_concurrent_decodes
        if live_slots is None or live_slots >= slots:
            return slots
        return min(slots, max(MIN_SLOT_BUCKET, 1 << max(0, live_slots - 1).bit_length()))

    def slot_buckets(self) -> tuple[int, ...]:
        """Every bucket `slot_bucket` can return, smallest first."""
        return tuple(sorted({self.slot_bucket(n) for n in range(1, self.max_concurrent_decodes + 1)}))

    def init_decode_state(self, *args, **kwargs) -> DecodeState:
        return self._init_state_jit()

    def get_prefix_destination_sharding(self) -> Any:
        return self._replicated

    def get_tokenizer(self) -> engine_api.TokenizerParameters:
        return engine_api.TokenizerParameters(path=f"flexmarl:{type(self.tokenizer).__name__}", extra_ids=0)

    def build_tokenizer(self, metadata: engine_api.TokenizerParameters) -> FlexTokenizer:
        return FlexTokenizer(self.tokenizer, self.config)

    @property
    def mesh(self) -> Mesh:
        return self._mesh

    # ----------------------------------------------------------------- helpers
    def warm_up(self, params: Any) -> None:
        """Compiles every entry point (prefill and insert per bucket and prefill batch size, generate per slot
        bucket, the slot move)."""
        state = self.init_decode_state()
        for bucket in self.config.prefill_buckets:
            for rows in self.config.prefill_batch_sizes:
                prefix = self.prefill_batch(params, np.zeros((rows, bucket), np.int32), [1] * rows, [None] * rows)
                state = self.insert(prefix, state, 0)
        for bucket in self.slot_buckets():
            state, result = self.generate(params, state, bucket)
        if self.max_concurrent_decodes > 1:
            state = self.move_slots(state, [1], [0])
        jax.block_until_ready(result.data)

    def compiled_cache_sizes(self) -> dict[str, int]:
        """Number of compiled variants per jitted entry point (for no-recompile checks)."""
        return {
            "prefill": self._prefill_jit._cache_size(),
            "insert": self._insert_jit._cache_size(),
            "generate": self._generate_jit._cache_size(),
        }

    # ----------------------------------------------------------------- jitted bodies
    def _init_state_impl(self) -> DecodeState:
        slots, vocab = self.max_concurrent_decodes, self.model_config.vocab_size
        zeros_i32 = jnp.zeros((slots,), jnp.int32)
        return DecodeState(
            cache=functional.init_cache(self.model_config, slots, self.config.cache_length, self.cache_dtype),
            next_logits=jnp.zeros((slots, vocab), jnp.float32),
            positions=zeros_i32,
            generated=zeros_i32,
            temperature=jnp.zeros((slots,), jnp.float32),
            top_k=zeros_i32,
            top_p=jnp.ones((slots,), jnp.float32),
            seed=zeros_i32,
            sample_index=zeros_i32,
            adapter=zeros_i32,
        )

    def _prefill_impl(self, params, padded_tokens, true_lengths, temperature, top_k, top_p, seed,
                      adapter) -> Prefix:
        rows, bucket = padded_tokens.shape
        mask = jnp.arange(bucket)[None, :] < true_lengths[:, None]
        cache = functional.init_cache(self.model_config, rows, bucket, self.cache_dtype)
        base, adapters = _base_and_adapters(params, adapter)
        logits, cache = functional.prefill(self.graphdef, base, padded_tokens, mask, cache,
                                           logits_at=true_lengths - 1, adapters=adapters)
        next_logits = logits[:, 0]
        return Prefix(
            cache=cache,
            next_logits=next_logits.astype(jnp.float32),
            true_length=true_lengths,
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            seed=seed,
            adapter=adapter,
        )

    def _insert_impl(self, prefix: Prefix, state: DecodeState, slots, sample_indices, rows) -> DecodeState:
        count = jnp.sum(slots < self.max_concurrent_decodes)

        # The KV rows go in one slot at a time (a loop with a traced trip count): broadcasting the
        # prefix to every target slot first would materialise [layers, slots, bucket, ...] per insert.
        def copy_into_slot(i, carry):
            cache, next_logits = carry
            slot, row = slots[i], rows[i]
            new_cache = {}
            for name, full in cache.items():
                source = prefix.cache[name]
                one_row = jax.lax.dynamic_slice_in_dim(source, row, 1, axis=1).astype(full.dtype)
                new_cache[name] = jax.lax.dynamic_update_slice(full, one_row, (0, slot, 0, 0, 0))
            logits_row = jax.lax.dynamic_slice_in_dim(prefix.next_logits, row, 1, axis=0)
            next_logits = jax.lax.dynamic_update_slice(next_logits, logits_row, (slot, 0))
            return new_cache, next_logits

        cache, next_logits = jax.lax.fori_loop(0, count, copy_into_slot, (state.cache, state.next_logits))

        def put(vector, per_row):
            return vector.at[slots].set(per_row[rows].astype(vector.dtype), mode="drop")

        return DecodeState(
            cache=cache,
            next_logits=next_logits,
            positions=put(state.positions, prefix.true_length),
            generated=state.generated.at[slots].set(0, mode="drop"),
            temperature=put(state.temperature, prefix.temperature),
            top_k=put(state.top_k, prefix.top_k),
            top_p=put(state.top_p, prefix.top_p),
            seed=put(state.seed, prefix.seed),
            sample_index=state.sample_index.at[slots].set(sample_indices, mode="drop"),
            adapter=put(state.adapter, prefix.adapter),
        )

    def _generate_impl(self, params, state: DecodeState, live: int) -> tuple[DecodeState, LogProbResultTokens]:
        # Only the leading `live` slots step. The KV cache goes whole into the decode step, which writes the
        # live rows in place (the state is donated) and reads only them; the per-slot vectors are sliced.
        slots = self.max_concurrent_decodes
        head = jax.tree.map(lambda a: a[:live], state.replace(cache={}))
        keys = jax.vmap(_slot_key)(head.seed, head.sample_index, head.generated)
        tokens, logprobs = sample_tokens(keys, head.next_logits, head.temperature, head.top_k, head.top_p)
        # Finished-but-not-yet-refilled slots keep stepping; clamp so they never index past the cache.
        write_positions = jnp.minimum(head.positions, self.config.cache_length - 1)
        base, adapters = _base_and_adapters(params, head.adapter)
        logits, cache = functional.decode_step(self.graphdef, base, tokens, write_positions, state.cache,
                                               adapters=adapters)
        generated = head.generated + 1
        valid = head.positions < self.config.cache_length
        result = LogProbResultTokens.pack(tokens, logprobs, generated, valid, *self._raw_logprobs(head, tokens))

        def put(full, part):
            return part if live == slots else full.at[:live].set(part.astype(full.dtype))

        new_state = state.replace(
            cache=cache,
            next_logits=put(state.next_logits, logits.astype(jnp.float32)),
            positions=put(state.positions, head.positions + 1),
            generated=put(state.generated, generated),
        )
        # Rows past the bucket report nothing (valid 0).
        return new_state, result.replace(data=put(jnp.zeros((slots,) + result.data.shape[1:], result.data.dtype),
                                                   result.data))

    def _raw_logprobs(self, head: DecodeState, tokens: jax.Array) -> tuple[jax.Array, ...]:
        """(raw log-prob of each drawn token [live], top ids [live, K], their raw log-probs [live, K]) under the
        model's own distribution, before temperature and top-k/top-p (what an OpenAI client's `logprobs` means);
        nothing when the config reports none (`top_logprobs` = 0), so training rollouts pay nothing for it."""
        top = self.config.top_logprobs
        if top == 0:
            return ()
        raw = jax.nn.log_softmax(head.next_logits, axis=-1)
        drawn = jnp.take_along_axis(raw, tokens[:, None], axis=-1)[:, 0]
        top_logprobs, top_ids = jax.lax.top_k(raw, top)
        return drawn, top_ids, top_logprobs

    def _move_impl(self, state: DecodeState, sources, destinations) -> DecodeState:
        count = jnp.sum(sources < self.max_concurrent_decodes)

        def move_one(i, cache):  # one slot's KV rows at a time, in place in the donated cache
            return {name: jax.lax.dynamic_update_slice_in_dim(
                        full, jax.lax.dynamic_slice_in_dim(full, sources[i], 1, axis=1), destinations[i], axis=1)
                    for name, full in cache.items()}

        cache = jax.lax.fori_loop(0, count, move_one, state.cache)
        vectors = jax.tree.map(lambda a: a.at[destinations].set(a[jnp.minimum(sources, a.shape[0] - 1)], mode="drop"),
                               state.replace(cache={}))
        return vectors.replace(cache=cache)


def _base_and_adapters(params, rows) -> tuple[Any, AdapterBatch | None]:
    """(the base params, the `AdapterBatch` of `rows` [B]) of `AdaptedParams`; (params, None) otherwise."""
    if isinstance(params, AdaptedParams):
        return params.base, AdapterBatch(params.table.weights, params.table.scales, rows)
    return params, None


def _adapter_rows(params, adapters, rows: int) -> np.ndarray:
    """Each prompt's row of the adapter table, checked against the table (only row 0 without one)."""
    count = params.adapters if isinstance(params, AdaptedParams) else 1
    vector = np.zeros((rows,), np.int32) if adapters is None else np.asarray(adapters, np.int32)
    if vector.shape != (rows,) or vector.min() < 0 or vector.max() >= count:
        have = f"an adapter table of {count}" if isinstance(params, AdaptedParams) else "no adapter table"
        raise ValueError(f"adapters {np.asarray(adapters).tolist()} must be {rows} indices in [0, {count}) "
                         f"(the params have {have})")
    return vector


def _slot_key(seed, sample_index, step):
    """The PRNG key of one slot at one step: independent of slot placement and batch mates."""
    key = jax.random.fold_in(jax.random.key(seed.astype(jnp.uint32)), sample_index)
    return jax.random.fold_in(key, step)


__all__ = ["GREEDY", "MIN_SLOT_BUCKET", "DecodeState", "FlexEngine", "FlexTokenizer", "Prefix", "SlotSampling"]
