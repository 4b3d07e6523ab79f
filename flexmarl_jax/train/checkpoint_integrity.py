"""Checksums of finished checkpoints: a manifest of every file's CRC-32, written once Orbax has finalized a step
and verified before the step is restored.

Why a manifest of ours: Orbax 0.12.8 writes each array as zarr3 whose codecs it fixes itself (``bytes``, then
``zstd``; only the shard *index* carries TensorStore's ``crc32c`` codec, see ``_build_zarr3_metadata`` in
orbax/checkpoint/_src/serialization/tensorstore_utils.py), with no option to add ``crc32c`` to the chunk data,
and the OCDBT data files holding those chunks checksum their B+tree nodes and manifest but not out-of-line
values. So random bytes in a data file restore without an error (as NaNs or wrong numbers). Hashing whole files
also covers every other file of the step (metadata, the JSON ``meta`` item) and is independent of the mesh.

The manifest is the last thing a save writes, so a step without one is a save that did not finish: it is never
restored (``CheckpointCorrupted``), the same as a step whose bytes changed.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import zlib

from etils import epath

from flexmarl_jax import workdir_paths

MANIFEST = "integrity.json"  # in the step directory: {"format", "files": {relative path: {"size", "crc32"}}}
FORMAT = "flexmarl-checkpoint-integrity/1"
_READ_BYTES = 16 << 20


class CheckpointCorrupted(RuntimeError):
    """A checkpoint step failed verification (changed, missing or extra files, or no manifest)."""


def _files(step_dir: str) -> list[str]:
    """Every file under ``step_dir`` except the manifest, as sorted relative paths (local or an object store)."""
    found = []
    if workdir_paths.is_local(step_dir):
        for root, _, names in os.walk(step_dir):
            found += [os.path.relpath(os.path.join(root, name), step_dir) for name in names]
    else:
        base = epath.Path(step_dir)
        found = [str(item.relative_to(base)) for item in base.rglob("*") if item.is_file()]
    return sorted(relative for relative in found if relative != MANIFEST)


def _crc32(path: epath.Path) -> tuple[int, int]:
    """(size, CRC-32) of one file, read in slices (zlib releases the GIL, so files hash in parallel)."""
    crc, size = 0, 0
    with path.open("rb") as handle:
        while chunk := handle.read(_READ_BYTES):
            crc = zlib.crc32(chunk, crc)
            size += len(chunk)
    return size, crc


def _checksums(step_dir: str, relatives: list[str]) -> dict[str, dict[str, int]]:
    workers = max(1, min(8, os.cpu_count() or 1, len(relatives)))
    base = epath.Path(step_dir)
    with concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="checkpoint-crc") as pool:
        sums = pool.map(lambda relative: _crc32(base / relative), relatives)
        return {relative: {"size": size, "crc32": crc} for relative, (size, crc) in zip(relatives, sums, strict=True)}


def write_manifest(step_dir: str | os.PathLike) -> None:
    """Records the size and CRC-32 of every file of a finalized step; durable when it returns (fsynced when
    local; an object store's write is durable and whole once it returns)."""
    step_dir = os.fspath(step_dir)
    payload = json.dumps({"format": FORMAT, "files": _checksums(step_dir, _files(step_dir))}, indent=0,
                         sort_keys=True)
    if not workdir_paths.is_local(step_dir):
        epath.Path(step_dir, MANIFEST).write_text(payload)
        return
    path = os.path.join(step_dir, MANIFEST)
    with open(path + ".tmp", "w") as handle:
        handle.write(payload)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(path + ".tmp", path)
    directory = os.open(step_dir, os.O_RDONLY)
    try:
        os.fsync(directory)
    finally:
        os.close(directory)


def verify(step_dir: str | os.PathLike) -> None:
    """Raises CheckpointCorrupted (naming the step and what differs) unless every file of the step has the size
    and CRC-32 its manifest recorded, and no file was added or removed."""
    step_dir = os.fspath(step_dir)
    try:
        payload = json.loads(epath.Path(step_dir, MANIFEST).read_text())
        recorded = payload["files"]
        if payload.get("format") != FORMAT:
            raise ValueError(f"format {payload.get('format')!r} is not {FORMAT!r}")
    except FileNotFoundError:
        raise CheckpointCorrupted(f"checkpoint {step_dir} has no {MANIFEST}: its save did not finish") from None
    except (ValueError, KeyError, TypeError) as error:  # a manifest that is itself damaged
        raise CheckpointCorrupted(f"checkpoint {step_dir}: unreadable {MANIFEST} ({error})") from None
    present = _files(step_dir)
    problems = [f"{name} is missing" for name in sorted(set(recorded) - set(present))]
    problems += [f"{name} was not saved with it" for name in sorted(set(present) - set(recorded))]
    found = _checksums(step_dir, [name for name in present if name in recorded])
    problems += [f"{name} has size {sums['size']} and CRC-32 {sums['crc32']:08x}, saved as "
                 f"{recorded[name]['size']} and {recorded[name]['crc32']:08x}"
                 for name, sums in found.items() if sums != recorded[name]]
    if problems:
        raise CheckpointCorrupted(f"checkpoint {step_dir} fails verification: {'; '.join(problems[:3])}"
                                  + (f" (and {len(problems) - 3} more)" if len(problems) > 3 else ""))
