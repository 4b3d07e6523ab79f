"""Checksums of the store: random bytes written into a live value of a store data file are detected, and a
claim never returns a value that changed on disk (it fails the rows, naming them)."""

import os
import shutil

import numpy as np
import pytest
import tensorstore as ts

from flexmarl_jax.store import ExperienceStore, RowState, StoreCorrupted
from tests.corruption import overwrite_with_noise

GROUPS, GROUP_SIZE = 6, 4


def _filled_store(workdir) -> None:
    """A file store of one agent: GROUPS groups appended one at a time (each append: one blob per sequence
    column and fresh zarr chunks), values long enough to be stored out of line."""
    store = ExperienceStore.open(workdir, agents=["solver"], backend="file")
    rng = np.random.default_rng(0)
    for group in range(GROUPS):
        store.append_rows("solver", input_ids=[f"q{group}"] * GROUP_SIZE, trajectory_ids=range(GROUP_SIZE),
                          group_size=GROUP_SIZE, policy_versions={"solver": 0},
                          columns={"reward": rng.random(GROUP_SIZE).astype(np.float32),
                                   "advantage": rng.standard_normal(GROUP_SIZE).astype(np.float32),
                                   "prompt_tokens": [rng.integers(3, 90, 40) for _ in range(GROUP_SIZE)],
                                   "response_tokens": [rng.integers(3, 90, 64) for _ in range(GROUP_SIZE)],
                                   "behaviour_logprobs": [-rng.random(64).astype(np.float32)
                                                          for _ in range(GROUP_SIZE)]})
    store.close()


def _live_values(store_dir: str) -> list[tuple[str, str, int, int]]:
    """(key, data file, offset, length) of every value the newest OCDBT version stores out of line (values of
    at most 100 bytes sit inside B+tree nodes, which OCDBT checksums itself)."""
    kv = ts.KvStore.open({"driver": "file", "path": store_dir + "/"}).result()
    found = []

    def walk(location: str) -> None:
        for entry in ts.ocdbt.dump(kv, location).result()["entries"]:
            if "location" in entry:  # an interior node's child
                walk(entry["location"])
            elif "indirect_value" in entry:
                _, _, path, offset, length = entry["indirect_value"].split(":")
                found.append((bytes(entry["key"]).decode(), path, int(offset), int(length)))

    walk(ts.ocdbt.dump(kv).result()["versions"][-1]["root"]["location"])
    return found


def _read_everything(workdir) -> None:
    store = ExperienceStore.open(workdir, backend="file", must_exist=True)
    store.read_rows("solver")
    while store.claim_micro_batch("solver", GROUP_SIZE, current_versions=0) is not None:
        pass


@pytest.mark.timeout(120)
def test_random_bytes_in_a_live_store_value_are_detected_in_10_of_10_trials(tmp_path):
    original = tmp_path / "original"
    _filled_store(original)
    values = _live_values(str(original / "store"))
    kinds = {"blob" if "/blobs/" in key else "chunk" if "/c/" in key else "metadata" for key, *_ in values}
    assert kinds == {"blob", "chunk", "metadata"}, kinds
    detected = []
    for trial in range(10):
        rng = np.random.default_rng(100 + trial)
        workdir = tmp_path / f"trial{trial}"
        shutil.copytree(original, workdir)
        key, path, offset, length = values[rng.integers(len(values))]
        size = int(min(8, length))
        position = offset + int(rng.integers(length - size + 1))
        overwrite_with_noise(os.path.join(workdir, "store", path), position, size, rng)
        try:
            _read_everything(workdir)
        except StoreCorrupted as error:
            detected.append((key, str(error)))
        except ValueError as error:  # TensorStore refusing a damaged zarr.json when it opens the array
            assert key.endswith("zarr.json"), (key, error)
            detected.append((key, str(error)))
    assert len(detected) == 10, detected



@pytest.mark.timeout(120)
def test_a_claim_fails_the_rows_of_a_corrupted_value_and_never_returns_them(tmp_path):
    _filled_store(tmp_path)
    damaged = [v for v in _live_values(str(tmp_path / "store")) if "/blobs/response_tokens/" in v[0]][2]
    key, path, offset, length = damaged
    with open(os.path.join(tmp_path, "store", path), "r+b") as handle:
        handle.seek(offset + length - 3)  # the last row's last token of the third group
        handle.write(b"\xff\xfe\xfd")

    store = ExperienceStore.open(tmp_path, backend="file", must_exist=True)
    claimed = []
    with pytest.raises(StoreCorrupted, match=r"table of agent 'solver'; rows 'q2_0_3'") as failure:
        while (batch := store.claim_micro_batch("solver", GROUP_SIZE, current_versions=0)) is not None:
            claimed.append(batch)
    assert failure.value.sample_ids == ("q2_0_3",)
    assert [b.group_ids for b in claimed] == [("q0_0",), ("q1_0",)]  # the groups before it, intact
    # The damaged row's group is dropped (durably), never handed out; the groups after it still are.
    assert store.row_states("solver", [f"q2_0_{t}" for t in range(GROUP_SIZE)]) == [RowState.DROPPED] * GROUP_SIZE
    rest = store.claim_micro_batch("solver", 3 * GROUP_SIZE, current_versions=0)
    assert rest.group_ids == ("q3_0", "q4_0", "q5_0")
    reopened = ExperienceStore.open(tmp_path, backend="file", must_exist=True)
    assert reopened.counters("solver")["dropped"] == GROUP_SIZE


def test_a_store_written_before_checksums_is_refused_by_its_format(tmp_path):
    ExperienceStore.open(tmp_path, agents=["solver"], backend="file").close()
    kv = ts.KvStore.open({"driver": "ocdbt", "base": f"file://{tmp_path}/store/"}).result()
    old = bytes(kv.read("schema.json").result().value).replace(b"flexmarl-store/2", b"flexmarl-store/1")
    kv.write("schema.json", old).result()
    del kv["schema.crc32"]
    with pytest.raises(ValueError, match="store format 'flexmarl-store/1' is not 'flexmarl-store/2'"):
        ExperienceStore.open(tmp_path, backend="file", must_exist=True)
