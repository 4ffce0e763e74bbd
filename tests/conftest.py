"""The suite's cost tiers. Every test carries exactly one of these markers (registered in
pyproject.toml; a module sets `pytestmark`, a module that mixes tiers marks each test):

- `unit`: starts no process and loads no model (pure Python, fakes, in-process objects and servers);
- `integration`: starts at most one peer (a service process, a transfer peer, a Mooncake store, a
  tool such as buf) or loads a model in-process;
- `stack`: starts whole stacks: several service processes at once;
- `vllm`: starts or imports a vLLM engine.

`make test-fast` runs `unit or integration`; `make test` runs everything (but `bench`). Benchmarks
(`bench`) need no tier. A test with none or with more than one fails the collection, naming it."""

from __future__ import annotations

import os

import pytest

TIERS = ("unit", "integration", "stack", "vllm")

# The vLLM services the suite starts run eager unless a test says otherwise: compiling the language
# model (the services' default) makes every engine start slower. The families' stacks
# (tests/backends/test_vllm_families.py) run compiled, as deployed; EPD_ENFORCE_EAGER=false in the
# environment runs the whole suite compiled.
os.environ.setdefault("EPD_ENFORCE_EAGER", "true")


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects: every collected test is checked
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    wrong: list[str] = []
    for item in items:
        tiers = [mark.name for mark in item.iter_markers() if mark.name in TIERS]
        if len(tiers) > 1 or (not tiers and item.get_closest_marker("bench") is None):
            wrong.append(f"  {item.nodeid}: {', '.join(tiers) if tiers else 'no tier'}")
    if wrong:
        raise pytest.UsageError(
            f"{len(wrong)} test(s) need exactly one tier marker of {', '.join(TIERS)} "
            "(tests/conftest.py says what each means):\n" + "\n".join(wrong)
        )
