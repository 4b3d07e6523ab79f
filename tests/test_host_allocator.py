"""host_allocator: with the thresholds fixed, blocks freed below the top of the heap leave the process."""

import subprocess
import sys

import pytest

# Raises glibc's dynamic mmap threshold with one freed 24 MiB block, then allocates 48 blocks of 8 MiB (touched,
# so they count in RSS), frees all but the last and prints how much of them the process still holds.
_PROBE = """
import sys
from flexmarl_jax import host_allocator
if sys.argv[1] == "fixed":
    assert host_allocator.return_freed_blocks_to_the_os()
def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096
bytearray(24 << 20)  # allocated and freed at once: glibc raises its threshold to 24 MiB
before = rss()
blocks = [bytearray(b"x") * (8 << 20) for _ in range(48)]
held = blocks.pop()
del blocks
print((rss() - before) / 2**20)
"""


def _held_mib(mode: str) -> float:
    result = subprocess.run([sys.executable, "-c", _PROBE, mode], capture_output=True, text=True, check=True)
    return float(result.stdout)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's allocator")
def test_freed_blocks_leave_the_process_only_with_fixed_thresholds():
    from flexmarl_jax import host_allocator

    if not host_allocator.return_freed_blocks_to_the_os():
        pytest.skip("the C library is not glibc")
    default, fixed = _held_mib("default"), _held_mib("fixed")
    assert default > 200, default  # the heap keeps what was freed below the last block (376 MiB of it)
    assert fixed < 40, fixed  # only the block still held (8 MiB) and noise
