"""deploy/Containerfile is consistent with `make deps` and with the manifests. No image is built
here: this machine runs no container engine and reaches no container registry for a base image.
What can be checked without building: every file it copies exists, it copies every file the
`make deps` target reads (and what `pip install -e .` reads), it installs the Makefile's system
packages, runs `make deps` itself on the Python the Makefile demands, and is tagged as the image
every description and every rendered manifest names."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest

from libs.cli.deploy import K8S, STACKS
from libs.launch.config import load_description
from libs.launch.k8s import documents

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
CONTAINERFILE = ROOT / "deploy" / "Containerfile"


def _instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with line continuations joined and comments dropped."""
    text = re.sub(r"\\\n", " ", CONTAINERFILE.read_text())
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


def _copied() -> set[str]:
    sources: set[str] = set()
    for word, args in _instructions():
        if word == "COPY" and "--from=" not in args:
            *srcs, _dest = args.split()
            sources |= {s.rstrip("/") for s in srcs if not s.startswith("--")}
    return sources


def _make_variable(name: str) -> str:
    match = re.search(rf"^{name} :?= (.+)$", (ROOT / "Makefile").read_text(), re.MULTILINE)
    assert match, name
    return match.group(1).strip()


def test_every_copied_file_exists() -> None:
    assert _copied(), "no COPY found"
    for source in _copied():
        assert (ROOT / source).exists(), f"Containerfile copies {source}, which does not exist"


def test_it_copies_what_make_deps_reads() -> None:
    makefile = (ROOT / "Makefile").read_text()
    match = re.search(r"^\$\(STAMP\): (.+)$", makefile, re.MULTILINE)
    assert match, "the deps stamp rule moved"
    needed = set(match.group(1).split())
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    needed.add(pyproject["project"]["readme"])  # `pip install -e .` reads it
    packages = pyproject["tool"]["setuptools"]["packages"]["find"]["include"]
    needed |= {p.rstrip("*") for p in packages}  # libs, services
    missing = needed - _copied()
    assert not missing, f"make deps needs {missing}, which the Containerfile does not copy"


def test_it_runs_make_deps_on_the_python_the_makefile_demands() -> None:
    runs = [args for word, args in _instructions() if word == "RUN"]
    assert any(re.match(r"make deps PYTHON=python3\.11\b", r) for r in runs)
    assert "sys.version_info[:2] == (3, 11)" in (ROOT / "Makefile").read_text()
    images = [args for word, args in _instructions() if word == "ARG" and args.startswith("PYTHON_IMAGE=")]
    assert images == ["PYTHON_IMAGE=python:3.11-slim-bookworm"]


# Shared libraries the serving processes load (Mooncake Store's binding links libibverbs).
RUNTIME_PACKAGES = ("libibverbs1",)


def test_system_packages_come_from_make_deps_and_the_runtime_has_its_libraries() -> None:
    packages = _make_variable("SYSTEM_PACKAGES").split()
    assert set(RUNTIME_PACKAGES) <= set(packages)
    apt = [args for word, args in _instructions() if word == "RUN" and "apt-get install" in args]
    assert len(apt) == 2
    build, runtime = apt
    # The build stage installs no system package of the Makefile's itself: `make deps` does, the
    # same way as on a fresh host (its dpkg check, then apt-get).
    assert not [p for p in packages if re.search(rf"\b{re.escape(p)}\b", build)], build
    assert re.search(r"\bmake\b", build)
    for package in RUNTIME_PACKAGES:
        assert re.search(rf"\b{re.escape(package)}\b", runtime), f"{package} not in the runtime stage: {runtime}"
    assert (
        "apt-get install" in (ROOT / "Makefile").read_text()
        and "dpkg -s $(SYSTEM_PACKAGES)" in (ROOT / "Makefile").read_text()
    )


def test_the_image_tag_is_the_one_descriptions_and_manifests_name() -> None:
    tag = re.search(r"docker build -f deploy/Containerfile -t (\S+) \.", CONTAINERFILE.read_text())
    assert tag, "the build command in the header names the tag"
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    assert tag.group(1) == f"epd:{version}"
    for path in STACKS.glob("*.yaml"):
        assert load_description(path)["image"] == tag.group(1), path
    images = {
        c["image"]
        for path in K8S.rglob("*.yaml")
        for doc in documents(path.read_text())
        if doc["kind"] == "Deployment"
        for c in doc["spec"]["template"]["spec"]["containers"]
    }
    assert images == {tag.group(1)}


def test_the_baked_model_is_the_descriptions_model() -> None:
    model_dir = _make_variable("MODEL_DIR")
    assert any(word == "RUN" and args.startswith("make models") for word, args in _instructions())
    for path in STACKS.glob("*.yaml"):
        assert load_description(path)["model"]["path"] == model_dir, path


def test_the_build_context_keeps_what_it_copies() -> None:
    ignored = {line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines() if line and line[0] != "#"}
    assert ".venv" in ignored and "var" in ignored
    assert not (_copied() & ignored)
