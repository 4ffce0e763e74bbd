"""Backends by name, imported only when chosen: `start(role, name, settings)` imports
`libs.backends.<name>.<role>` (so vLLM, slow to import, is loaded only by a service that runs it)
and calls its module-level `start(settings)`, the backend's async factory (`api.py`)."""

from __future__ import annotations

import importlib
from typing import Any

ROLES = ("encoder", "prefill", "decode", "pd", "colocated")
# The roles each engine implements. vLLM has no colocated backend (its encoder runs
# encoder-only and writes into the service's pool: libs/backends/vllm/encoder.py).
AVAILABLE: dict[str, tuple[str, ...]] = {
    "reference": ROLES,
    "vllm": ("encoder", "prefill", "decode", "pd"),
}


def module_name(role: str, name: str) -> str:
    """The module that implements `role` on engine `name`; ValueError when there is none."""
    if role not in ROLES:
        raise ValueError(f"unknown role {role!r}; expected one of {', '.join(ROLES)}")
    if name not in AVAILABLE:
        raise ValueError(f"unknown engine {name!r}; expected one of {', '.join(AVAILABLE)}")
    if role not in AVAILABLE[name]:
        offered = ", ".join(e for e, roles in AVAILABLE.items() if role in roles)
        raise ValueError(f"the {name} engine has no {role} backend; the {role} service runs on: {offered}")
    return f"libs.backends.{name}.{role}"


async def start(role: str, name: str, settings: Any) -> Any:
    """Import the backend of `role` on engine `name` and start it from the service's settings."""
    module = importlib.import_module(module_name(role, name))
    return await module.start(settings)
