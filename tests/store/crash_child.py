"""Child process for test_crash_recovery.py: works on a durable store until it is SIGKILLed.

Usage: python crash_child.py WORKDIR TRIAL SEED. Prints one line per operation *after* it returned (so the
parent knows it was committed): "A <ids>" appended, "S <ids>" set (rows now complete), "C <ids>" claimed,
"X <ids>" consumed, "R <ids>" released; "READY" once the store is open.
"""

import random
import sys

import numpy as np

AGENTS = ["solver", "critic"]
LATE = ("response_tokens", "behaviour_logprobs")


def expected_values(sample_id: str) -> dict:
    """Final data values of a row, derived from its sample id (the parent checks stored rows against it)."""
    seed = sum(ord(c) * (i + 7) for i, c in enumerate(sample_id))
    length = seed % 300 + 1  # up to 300 tokens: blobs of many KB, so kills land inside data writes too
    return {
        "prompt_tokens": (np.arange(seed % 5 + 1) + seed).astype(np.int32),
        "response_tokens": (np.arange(length) * 7 + seed).astype(np.int32),
        "behaviour_logprobs": (-np.arange(length) / (seed % 9 + 1)).astype(np.float32),
        "reward": np.float32(seed % 17),
        "advantage": np.float32(seed % 5 - 2.5),
    }


def expected_versions(input_id: str) -> dict:
    number = int(input_id.rsplit("g", 1)[1])
    return {"solver": 0} if number % 2 else {"solver": 0, "critic": 0}


def columns_for(sample_ids, names):
    values = [expected_values(s) for s in sample_ids]
    return {
        n: [v[n] for v in values] if np.ndim(values[0][n]) else np.array([v[n] for v in values])
        for n in names
    }


def main(workdir: str, trial: int, seed: int) -> None:
    from flexmarl_jax.store import ExperienceStore

    rng = random.Random(seed)
    # Odd trials free consumed rows' sequence values (blob deletes inside the same transactions).
    store = ExperienceStore.open(workdir, agents=AGENTS, backend="file", free_consumed_values=trial % 2 == 1)
    print("READY", flush=True)
    pending: list[list[str]] = []
    number = 0
    while True:
        op = rng.random()
        if op < 0.45:
            size = rng.randint(1, 4)
            input_id = f"t{trial}g{number}"
            number += 1
            ids = [f"{input_id}_0_{t}" for t in range(size)]
            late = rng.random() < 0.5
            names = [n for n in expected_values("x") if not (late and n in LATE)]
            store.append_rows(
                "solver",
                input_ids=[input_id] * size,
                trajectory_ids=list(range(size)),
                group_size=size,
                policy_versions=expected_versions(input_id),
                columns=columns_for(ids, names),
            )
            print("A", *ids, flush=True)
            if late:
                pending.append(ids)
        elif op < 0.6 and pending:
            ids = pending.pop(rng.randrange(len(pending)))
            store.set_columns("solver", ids, columns_for(ids, LATE))
            print("S", *ids, flush=True)
        else:
            batch = store.claim_micro_batch("solver", 12, current_versions=0, allow_partial=True)
            if batch is None:
                continue
            print("C", *batch.sample_ids, flush=True)
            fate = rng.random()
            if fate < 0.6:
                store.mark_consumed(batch)
                print("X", *batch.sample_ids, flush=True)
            elif fate < 0.8:
                store.release(batch)
                print("R", *batch.sample_ids, flush=True)
            # else: keep the lease until the kill


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))
