"""`flexmarl train`'s persistent compilation cache: where it goes, that "" turns it off, and that a second
process loads a program the first one compiled instead of compiling it again."""

import os
import subprocess
import sys
import textwrap

import pytest

from flexmarl_jax.compile_cache import JAX_VARIABLE, compile_cache_folder

# One process: point the cache at argv[1], compile one program, print how many cache hits and misses JAX saw.
_COMPILE_ONCE = textwrap.dedent("""
    import sys
    import jax
    import jax.numpy as jnp
    from flexmarl_jax.compile_cache import enable_compile_cache

    counts = {"hit": 0, "miss": 0}
    def count(event, **_):
        if event == "/jax/compilation_cache/cache_hits":
            counts["hit"] += 1
        elif event == "/jax/compilation_cache/cache_misses":
            counts["miss"] += 1
    jax.monitoring.register_event_listener(count)
    print("folder", enable_compile_cache(sys.argv[1]))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)  # cache even this small program
    jax.jit(lambda x: jnp.tanh(x @ x.T).sum())(jnp.ones((64, 64))).block_until_ready()
    print("hits", counts["hit"], "misses", counts["miss"])
""")


def test_the_environment_variable_wins_and_empty_turns_it_off(monkeypatch, tmp_path):
    monkeypatch.setenv(JAX_VARIABLE, str(tmp_path / "from_env"))
    assert compile_cache_folder("~/elsewhere") == str(tmp_path / "from_env")
    assert compile_cache_folder("") == str(tmp_path / "from_env")
    monkeypatch.delenv(JAX_VARIABLE)
    assert compile_cache_folder("") is None
    monkeypatch.setenv("HOME", str(tmp_path))
    assert compile_cache_folder("~/.cache/flexmarl/jax") == str(tmp_path / ".cache" / "flexmarl" / "jax")


@pytest.mark.timeout(120)
def test_a_second_process_loads_what_the_first_compiled(tmp_path):
    folder = tmp_path / "cache"
    environment = {key: value for key, value in os.environ.items() if key != JAX_VARIABLE}
    runs = [subprocess.run([sys.executable, "-c", _COMPILE_ONCE, str(folder)], env=environment,
                           capture_output=True, text=True, timeout=100) for _ in range(2)]
    for run in runs:
        assert run.returncode == 0, run.stderr[-2000:]
    first, second = (run.stdout.split() for run in runs)
    assert first[:2] == ["folder", str(folder)]
    misses = int(first[5])
    assert first[2:5] == ["hits", "0", "misses"] and misses >= 1  # compiled (the program and jnp.ones) and written
    assert len([entry for entry in folder.iterdir() if entry.name.endswith("-cache")]) == misses
    assert second[2:] == ["hits", str(misses), "misses", "0"]  # every one loaded, none compiled
