"""Which installed NIXL build this process uses: the one rule every NIXL import follows (the
project's agents, and the patch of vLLM's agent in libs/backends/vllm/kv_connector.py).

NIXL ships one wheel per device stack (`nixl_cu12`, `nixl_cu13`, `nixl_rocm`) and a meta package
`nixl` that aliases `nixl._api` etc. to the build matching the CUDA the process uses. vLLM imports
`nixl._api`; our agents must load the very same build (one UCX, one binding), so the rule is:
`EPD_NIXL_PACKAGE` when set, else whatever the meta package picked, else the first build installed.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import os
from types import ModuleType

ENV = "EPD_NIXL_PACKAGE"
BUILDS = ("nixl_cu13", "nixl_cu12", "nixl_rocm")


@functools.cache
def nixl_package() -> str:
    """The NIXL build package's name (e.g. "nixl_cu12"); ImportError naming what was tried."""
    chosen = os.environ.get(ENV, "").strip()
    if chosen:
        if importlib.util.find_spec(chosen) is None:
            raise ImportError(f"{ENV}={chosen}: no such package installed")
        return chosen
    if importlib.util.find_spec("nixl") is not None:
        # The meta package resolves its build when imported (by the CUDA version in use).
        api = importlib.import_module("nixl._api")
        return api.__name__.rsplit(".", 1)[0]
    for name in BUILDS:
        if importlib.util.find_spec(name) is not None:
            return name
    raise ImportError(f"no NIXL build installed (tried {ENV}, nixl, {', '.join(BUILDS)}); docs/transfer.md")


def nixl_module(submodule: str) -> ModuleType:
    """`<build>.<submodule>` of the chosen build, e.g. nixl_module("_api")."""
    return importlib.import_module(f"{nixl_package()}.{submodule}")
