"""Make PyPI's CUDA-linked torchvision importable next to the CPU-only torch, without editing it.

Why: vLLM's Qwen-VL models and transformers' Qwen-VL image/video processors import torchvision
unconditionally, and transformers imports it wherever it is installed. PyPI's torchvision 0.28.0
is linked against libtorch_cuda: its C extension does not load here, and `import torchvision`
then fails while registering fake kernels ("operator torchvision::nms does not exist").
Defining the two operator schemas it registers kernels for (`torchvision::nms`, `::qnms`; no
kernel) lets the import succeed. The pure-Python transforms work; detection ops (nms, roi_align)
stay unavailable, and nothing here uses them.

When: before torchvision is imported, in *every* interpreter of the venv - vLLM on CPU spawns
fresh ones (EngineCore and Worker with `spawn`, model inspection as `python -m ...registry`), and
a vLLM plugin would run too late. So `make deps` writes a `.pth` file into the venv
(`python -m libs.torchvision_guard --install-pth`) that puts a lazy import hook on `sys.meta_path`
at interpreter start: nothing is imported until something asks for torchvision, then torch is
imported and the schemas defined, and the hook removes itself. The `.pth` loads this file by its
absolute path, so it works whatever `PYTHONPATH` says (other checkouts, spawned children), and is
silent when the file is gone.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
import sysconfig
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

PTH_NAME = "epd_torchvision_guard.pth"
_SCHEMAS = (
    "nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
    "qnms(Tensor qdets, Tensor scores, float iou_threshold) -> Tensor",
)
_library: Any = None  # the torch.library.Library: dropping it would unregister the schemas
outcome = "not-run"  # what install() did last: absent / already-imported / native-ok / stubbed


def install() -> str:
    """Prepare torch for an import of torchvision; returns what was done."""
    global _library, outcome
    if "torchvision" in sys.modules:
        outcome = "already-imported"
        return outcome
    if _library is not None:
        return outcome
    spec = importlib.machinery.PathFinder.find_spec("torchvision")  # the path finder: not our hook again
    if spec is None or not spec.submodule_search_locations:
        outcome = "absent"
        return outcome
    import torch

    if _defined(torch):  # another copy of this module (the .pth's) got here first
        outcome = "stubbed"
        return outcome
    root = Path(next(iter(spec.submodule_search_locations)))
    for extension in sorted(root.glob("_C*.so")):
        try:
            torch.ops.load_library(str(extension))  # type: ignore[no-untyped-call]
        except OSError:
            break  # CUDA-linked: fall through to the schemas
        outcome = "native-ok"  # a torchvision built for this torch: nothing to stub
        return outcome
    library = torch.library.Library("torchvision", "FRAGMENT")  # type: ignore[no-untyped-call]
    for schema in _SCHEMAS:
        library.define(schema)  # type: ignore[no-untyped-call]
    _library = library
    outcome = "stubbed"
    return outcome


def _defined(torch: Any) -> bool:
    try:
        torch.ops.torchvision.nms  # noqa: B018  (resolves only when the schema exists)
    except (AttributeError, RuntimeError):
        return False
    return True


class _ImportHook(importlib.abc.MetaPathFinder):
    """Runs `install()` the first time torchvision is looked up, then steps aside."""

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname == "torchvision":
            remove_import_hook()
            with contextlib.suppress(Exception):  # never break the import; torchvision reports its own error
                install()
        return None  # the regular finders import it


def install_import_hook() -> None:
    """Put the lazy hook first on `sys.meta_path` (idempotent)."""
    if "torchvision" in sys.modules or any(isinstance(f, _ImportHook) for f in sys.meta_path):
        return
    sys.meta_path.insert(0, _ImportHook())


def remove_import_hook() -> None:
    sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, _ImportHook)]


def pth_line(module_file: Path) -> str:
    """The `.pth` line: load this file by absolute path and install the hook; silent on any error
    (a moved checkout must not break every interpreter of the venv)."""
    code = (
        "try:\n"
        "    import importlib.util as u\n"
        f"    s = u.spec_from_file_location('epd_torchvision_guard', {str(module_file)!r})\n"
        "    m = u.module_from_spec(s)\n"
        "    s.loader.exec_module(m)\n"
        "    import sys; sys.modules['epd_torchvision_guard'] = m\n"
        "    m.install_import_hook()\n"
        "except Exception:\n"
        "    pass\n"
    )
    return f"import sys; exec({code!r})\n"


def write_pth(site_packages: Path | None = None) -> Path:
    """Write the `.pth` into the running interpreter's site-packages (the venv's)."""
    target = Path(site_packages or sysconfig.get_paths()["purelib"]) / PTH_NAME
    tmp = target.with_suffix(".tmp")
    tmp.write_text(pth_line(Path(__file__).resolve()))
    os.replace(tmp, target)
    return target


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m libs.torchvision_guard", description=__doc__.splitlines()[0])
    parser.add_argument("--install-pth", action="store_true", help="write the start-up hook into this venv")
    parser.add_argument("--check", action="store_true", help="import torchvision through the guard; print outcome")
    ns = parser.parse_args(argv)
    if ns.install_pth:
        print(f"wrote {write_pth()}")
    if ns.check:
        result = install()
        importlib.import_module("torchvision")
        print(f"torchvision imports ({result})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
