"""Rollout: FlexEngine (JetStream Engine API), the continuous-batching loop, engine instances and the
engine-backed generation backend.

Import the submodules you need (`engine`, `loop`, `instance`, `backend`); this package file imports
nothing heavy, because JetStream pulls in TensorFlow (see `jetstream_compat`). `settings` is pure Python
for config validation.
"""
