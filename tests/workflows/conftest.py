"""Fixtures for workflow tests: scripted backends that shut their thread pools down."""

import pytest

from flexmarl_jax.workflows.scripted import ScriptedBackend


@pytest.fixture
def make_backend():
    backends = []

    def make(agents, **kwargs):
        backend = ScriptedBackend(agents, **kwargs)
        backends.append(backend)
        return backend

    yield make
    for backend in backends:
        backend.shutdown()
