"""Agent-centric allocation: 4 agents on 2 slices train exactly like 4 agents on 4 slices."""

import gc
import threading

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from flexmarl_jax.orchestrator.allocation import TrainerResidency
from flexmarl_jax.train.slice_pool import TrainingSlicePool
from flexmarl_jax.transfer import StateStore

AGENTS = ("solver", "verifier", "corrector", "summarizer")
MICRO_BATCHES = {"solver": 3, "verifier": 3, "corrector": 1, "summarizer": 2}  # skewed work per iteration
OPTIMIZER = optax.adam(1e-2)


def initial_state(agent: str, mesh):
    """A generic trainer state: params (FSDP-sharded), optax state, gradient accumulator, counters."""
    rng = np.random.default_rng(AGENTS.index(agent))
    params = {"w1": rng.standard_normal((16, 32)).astype(np.float32) * 0.3,
              "b1": np.zeros(32, np.float32),
              "w2": rng.standard_normal((32, 4)).astype(np.float32) * 0.3}
    specs = {"w1": P("fsdp"), "b1": P(), "w2": P("fsdp")}
    params = {k: jax.device_put(v, NamedSharding(mesh, specs[k])) for k, v in params.items()}
    return {"params": params, "opt_state": OPTIMIZER.init(params),
            "accum": jax.tree.map(jnp.zeros_like, params), "policy_version": 0}


def micro_batch(agent: str, iteration: int, number: int):
    rng = np.random.default_rng(hash((agent, iteration, number)) % 2**32)
    return rng.standard_normal((8, 16)).astype(np.float32), rng.standard_normal((8, 4)).astype(np.float32)


def loss(params, x, y):
    hidden = jnp.tanh(x @ params["w1"] + params["b1"])
    return jnp.mean((hidden @ params["w2"] - y) ** 2)


@jax.jit
def _accumulate(arrays, x, y):
    grads = jax.grad(loss)(arrays["params"], x, y)
    return dict(arrays, accum=jax.tree.map(jnp.add, arrays["accum"], grads))


@jax.jit
def _apply(arrays):
    updates, opt_state = OPTIMIZER.update(arrays["accum"], arrays["opt_state"], arrays["params"])
    return dict(arrays, params=optax.apply_updates(arrays["params"], updates), opt_state=opt_state,
                accum=jax.tree.map(jnp.zeros_like, arrays["accum"]))


def _arrays(state):
    return {k: v for k, v in state.items() if k != "policy_version"}


def accumulate(state, x, y):
    """Adds one micro-batch's gradient; ``policy_version`` stays a Python int (a non-array leaf)."""
    return dict(_accumulate(_arrays(state), x, y), policy_version=state["policy_version"])


def apply(state):
    return dict(_apply(_arrays(state)), policy_version=state["policy_version"])


def train(num_slices: int, *, iterations: int = 2, offload_tier="host", park=True, storage_root=None):
    """Every agent runs its micro-batches in its own thread, competing for the slices; apply at the end."""
    pool = TrainingSlicePool.from_devices(jax.devices()[:8], num_slices)
    residency = TrainerResidency(StateStore(storage_root=storage_root), pool, offload_tier=offload_tier,
                                 park_on_release=park)
    for agent in AGENTS:
        residency.register(agent, initial_state(agent, pool.slices[0].mesh))
    barrier = threading.Barrier(len(AGENTS))
    errors = []

    def work(agent):
        try:
            for iteration in range(iterations):
                for number in range(MICRO_BATCHES[agent]):
                    with residency.session(agent, timeout=60) as active:
                        x, y = micro_batch(agent, iteration, number)
                        active.state = accumulate(active.state, x, y)
                        assert all(set(leaf.devices()) <= active.slice.devices
                                   for leaf in jax.tree.leaves(active.state) if isinstance(leaf, jax.Array))
                barrier.wait(timeout=60)  # every micro-batch of the iteration is consumed: apply together
                with residency.session(agent, timeout=60) as active:
                    version = active.state["policy_version"] + 1
                    active.state = dict(apply(active.state), policy_version=version)
                barrier.wait(timeout=60)
        except BaseException as error:  # surfaced in the main thread
            errors.append(error)
            barrier.abort()

    threads = [threading.Thread(target=work, args=(agent,)) for agent in AGENTS]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    if errors:
        raise errors[0]
    residency.suspend_all()
    return {agent: residency.read(agent) for agent in AGENTS}, residency


def relative_difference(a, b) -> float:
    """||a - b|| / ||b|| over the whole parameter tree.

    Slices of different sizes shard the contraction dims differently, so partial sums are added in a
    different order: equal up to float rounding, not bit for bit.
    """
    diff = sum(float(np.sum((np.asarray(x, np.float64) - np.asarray(y, np.float64)) ** 2))
               for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True))
    norm = sum(float(np.sum(np.asarray(y, np.float64) ** 2)) for y in jax.tree.leaves(b))
    return (diff / norm) ** 0.5


@pytest.mark.timeout(120)
def test_four_agents_on_two_slices_match_four_agents_on_four_slices():
    on_four, _ = train(num_slices=4)
    on_two, residency_two = train(num_slices=2)
    # Offload at every release: every activation swaps the state in from host (Orbax storage as the
    # offload tier is covered by tests/transfer/test_store.py; it is slow here on the CI machine).
    eager, residency_eager = train(num_slices=2, park=False)
    for agent in AGENTS:
        assert on_two[agent]["policy_version"] == eager[agent]["policy_version"] == 2
        assert relative_difference(on_two[agent]["params"], on_four[agent]["params"]) < 1e-6
        assert relative_difference(eager[agent]["params"], on_four[agent]["params"]) < 1e-6
        assert residency_eager.location(agent) == ("host", None)
        # The params changed (the comparison would pass vacuously if training did nothing).
        start = initial_state(agent, TrainingSlicePool.from_devices(jax.devices()[:8], 2).slices[0].mesh)
        assert relative_difference(on_two[agent]["params"], start["params"]) > 1e-3
    # 2 slices for 4 agents forces swaps; eager offload swaps at every activation.
    assert residency_two.stats.swapped_in > 0 and residency_two.stats.swapped_out > 0
    total_sessions = 2 * (sum(MICRO_BATCHES.values()) + len(AGENTS))
    assert residency_eager.stats.activations == residency_eager.stats.swapped_in == total_sessions


def live_bytes_on(devices) -> int:
    gc.collect()  # arrays dropped by earlier tests must not be counted (or vanish mid-test)
    return sum(a.nbytes for a in jax.live_arrays() if not a.is_deleted() and a.devices() & devices)


def test_suspend_frees_the_slice_and_resume_continues_identically():
    pool = TrainingSlicePool.from_devices(jax.devices()[:8], 2)
    residency = TrainerResidency(StateStore(), pool)
    slice0 = pool.slices[0].devices
    baseline = live_bytes_on(slice0)
    residency.register("solver", initial_state("solver", pool.slices[1].mesh))
    reference = initial_state("solver", pool.slices[1].mesh)  # trained without any swap, for comparison
    with residency.session("solver") as active:
        assert active.slice.index == 0 and active.moved_from == "host"
        active.state = accumulate(active.state, *micro_batch("solver", 0, 0))
    reference = accumulate(reference, *micro_batch("solver", 0, 0))
    assert residency.location("solver") == ("device", 0)  # parked on its slice after release
    assert live_bytes_on(slice0) > baseline
    residency.suspend("solver")
    assert residency.location("solver") == ("host", None)
    assert live_bytes_on(slice0) == baseline  # no live buffer of the state is left on the slice
    with residency.session("solver") as active:
        assert active.moved_from == "host"
        active.state = apply(accumulate(active.state, *micro_batch("solver", 0, 1)))
    reference = apply(accumulate(reference, *micro_batch("solver", 0, 1)))
    resumed = residency.read("solver")
    for x, y in zip(jax.tree.leaves(resumed), jax.tree.leaves(reference), strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-6, atol=1e-7)


def test_same_slice_is_preferred_and_nothing_moves():
    pool = TrainingSlicePool.from_devices(jax.devices()[:8], 2)
    residency = TrainerResidency(StateStore(), pool)
    residency.register("solver", initial_state("solver", pool.slices[0].mesh))
    residency.register("verifier", initial_state("verifier", pool.slices[0].mesh))
    with residency.session("solver") as first:
        arrays = jax.tree.leaves(first.state["params"])
    with residency.session("verifier") as other:
        assert other.slice.index == 1  # the free slice nobody's state is parked on
    with residency.session("solver") as again:
        assert again.lease.reused and again.moved_from == "slice"
        assert all(x is y for x, y in zip(jax.tree.leaves(again.state["params"]), arrays, strict=True))
    assert residency.stats.reused == 1 and residency.stats.swapped_in == 2


@pytest.mark.timeout(30)
def test_blocking_acquire_waits_then_times_out_with_holders_named():
    pool = TrainingSlicePool.from_devices(jax.devices()[:4], 2)
    pool.acquire("a")
    pool.acquire("b")
    with pytest.raises(TimeoutError) as error:
        pool.acquire("c", timeout=0.05)
    assert "slice0=a" in str(error.value) and "slice1=b" in str(error.value)
    granted = []
    waiter = threading.Thread(target=lambda: granted.append(pool.acquire("c", timeout=10)))
    waiter.start()
    pool.release("b")
    waiter.join(timeout=10)
    assert granted and granted[0].slice.index == 1 and not granted[0].reused
    with pytest.raises(RuntimeError, match="already holds training slice"):
        pool.acquire("a")
    with pytest.raises(RuntimeError, match="holds no training slice"):
        pool.release("b")


def test_busy_accounting_gives_utilization():
    now = [0.0]
    pool = TrainingSlicePool.from_devices(jax.devices()[:4], 2, clock=lambda: now[0])
    pool.acquire("a")            # slice 0 busy 0..3
    now[0] = 1.0
    pool.acquire("b")            # slice 1 busy 1..2
    now[0] = 2.0
    pool.release("b")
    now[0] = 3.0
    pool.release("a")
    now[0] = 4.0
    assert pool.busy_seconds() == [3.0, 1.0]
    assert pool.utilization() == pytest.approx(4.0 / 8.0)
    assert pool.utilization(0.0, 2.0) == pytest.approx(3.0 / 4.0)


def test_pool_rejects_overlapping_slices_and_bad_splits():
    devices = jax.devices()[:4]
    from jax.sharding import Mesh
    overlapping = [Mesh(np.asarray(devices[:2]).reshape(2, 1), ("fsdp", "tp")),
                   Mesh(np.asarray(devices[1:3]).reshape(2, 1), ("fsdp", "tp"))]
    with pytest.raises(ValueError, match="disjoint"):
        TrainingSlicePool(overlapping)
    with pytest.raises(ValueError, match="num_slices=3 must be >= 1 and divide the 4 devices"):
        TrainingSlicePool.from_devices(devices, 3)
    with pytest.raises(ValueError, match="offload_tier='disk'"):
        TrainerResidency(StateStore(), TrainingSlicePool.from_devices(devices, 2), offload_tier="disk")


@pytest.mark.timeout(120)
def test_agent_trainer_state_moves_between_slices_at_iteration_boundaries():
    """The integration with train.AgentTrainer: one trainer per (agent, slice); state moves between them.

    AgentTrainer exposes its state only at iteration boundaries (checkpoint_state refuses while gradients
    are pending), so this swaps between iterations; swapping between micro-batches needs the gradient
    accumulator in the exported state too.
    """
    import dataclasses

    from flexmarl_jax.models import functional
    from flexmarl_jax.models.presets import get_preset
    from tests.train.conftest import make_trainer, random_rows, rel_err, run_iteration

    micro = 8
    config = dataclasses.replace(get_preset("tiny"), num_layers=1)
    initial = functional.init_params(config, seed=0)
    pool = TrainingSlicePool.from_devices(jax.devices()[:4], 2)  # 2 x 2 devices: keeps compiles short
    trainers = {}

    def trainer_on(agent, mesh):
        if (agent, mesh) not in trainers:
            trainers[agent, mesh] = make_trainer(config, initial, micro, agent=agent, mesh=mesh)
        return trainers[agent, mesh]

    residency = TrainerResidency(
        StateStore(), pool, offload_tier="host", park_on_release=False,
        target_for=lambda agent, mesh: {"trainer": trainer_on(agent, mesh).checkpoint_shardings(),
                                        "policy_version": None})
    start = trainer_on("solver", pool.slices[1].mesh)
    residency.register("solver", {"trainer": start.checkpoint_state(), "policy_version": 0})
    rows = [random_rows(16, seed=21), random_rows(16, seed=22)]

    def train_one_iteration(active, iteration):
        trainer = trainer_on("solver", active.mesh)
        trainer.load_checkpoint_state(active.state["trainer"], active.state["policy_version"])
        run_iteration(trainer, rows[iteration], micro)
        trainer.apply()
        active.state = {"trainer": trainer.checkpoint_state(), "policy_version": trainer.policy_version}

    pool.acquire("blocker")  # slice 0
    with residency.session("solver") as active:
        assert active.slice.index == 1
        train_one_iteration(active, 0)
    pool.release("blocker")  # slice 0 released after slice 1: slice 1 is now the least recently used
    pool.acquire("other")  # takes slice 1, so the solver resumes on slice 0 from host
    with residency.session("solver") as active:
        assert active.slice.index == 0 and active.moved_from == "host"
        train_one_iteration(active, 1)

    uninterrupted = make_trainer(config, initial, micro, mesh=pool.slices[0].mesh)
    for iteration in range(2):
        run_iteration(uninterrupted, rows[iteration], micro)
        uninterrupted.apply()
    resumed = residency.read("solver")
    assert resumed["policy_version"] == 2
    assert rel_err(resumed["trainer"]["trainable"], uninterrupted.checkpoint_state()["trainable"]) < 1e-6
    assert rel_err(resumed["trainer"]["opt_state"], uninterrupted.checkpoint_state()["opt_state"]) < 1e-6
