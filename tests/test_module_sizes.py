"""The library stays in small modules with one job each: none over 500 lines (issue 33's limit)."""

import pathlib

LIBRARY = pathlib.Path(__file__).resolve().parent.parent / "flexmarl_jax"
MAX_LINES = 500


def test_no_library_module_is_over_500_lines():
    sizes = {str(path.relative_to(LIBRARY)): len(path.read_text().splitlines()) for path in LIBRARY.rglob("*.py")}
    assert len(sizes) > 100  # the walk found the package
    assert {name: lines for name, lines in sizes.items() if lines > MAX_LINES} == {}
