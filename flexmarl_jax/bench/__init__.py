"""Benchmarks behind `flexmarl bench NAME`; each module exposes `main(argv) -> int` and writes `--json PATH`.

They live inside the package (not only in the repo's benchmarks/ folder) because the google-jetstream wheel
installs a top-level `benchmarks` package that would shadow ours.
"""
