"""`epd deploy render` as a user runs it: a plain render writes a new directory (var/k8s under the
working directory), never the committed deploy/k8s; `--check` still compares with deploy/k8s;
stale files of an earlier render go, files it did not write stay; every stack gets a namespace of
its own, and two stacks that would share one are refused."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from libs.cli.deploy import K8S, STACKS
from libs.cli.main import main
from libs.launch.config import load_description

pytestmark = pytest.mark.unit


def _epd(args: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as done:
        main(args)
    out, err = capsys.readouterr()
    return int(done.value.code or 0), out, err


def _tree(root: Path) -> dict[Path, float]:
    return {p: p.stat().st_mtime_ns for p in root.rglob("*") if p.is_file()}


def test_render_writes_var_k8s_and_leaves_the_committed_manifests(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)
    committed = _tree(K8S)
    code, out, _ = _epd(["deploy", "render"], capsys)
    assert code == 0
    assert _tree(K8S) == committed  # untouched
    out_dir = Path("var/k8s")
    assert (out_dir / "base" / "kustomization.yaml").exists()
    names = sorted(load_description(p).name for p in STACKS.glob("*.yaml"))
    assert sorted(p.name for p in (out_dir / "overlays").iterdir()) == names
    # It says where it wrote and how to apply each overlay.
    assert f"under {out_dir}" in out
    assert all(f"kubectl apply -k {out_dir / 'overlays' / name}" in out for name in names)
    # The same files as the committed rendering: the directory is the only difference.
    for path in K8S.rglob("*.yaml"):
        assert (out_dir / path.relative_to(K8S)).read_text() == path.read_text()

    code, _, err = _epd(["deploy", "render", "--check"], capsys)  # against deploy/k8s, from anywhere
    assert code == 0, err


def test_a_rerender_removes_its_stale_files_only(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)
    out_dir = tmp_path / "k8s"
    assert _epd(["deploy", "render", "--out", str(out_dir)], capsys)[0] == 0
    stale = out_dir / "overlays" / "gone" / "router.yaml"  # an overlay of a description since removed
    stale.parent.mkdir()
    stale.write_text((out_dir / "base" / "kustomization.yaml").read_text())  # a rendered file's header
    own = out_dir / "overlays" / "mine.yaml"  # the user's
    own.write_text("kind: ConfigMap\n")
    code, out, _ = _epd(["deploy", "render", "--out", str(out_dir)], capsys)
    assert code == 0 and "1 stale" in out
    assert not stale.exists() and own.exists()


def test_each_stack_deploys_to_a_namespace_of_its_own(tmp_path: Path) -> None:
    namespaces = {}
    for path in STACKS.glob("*.yaml"):
        desc = load_description(path)
        namespaces[desc.name] = desc["kubernetes"]["namespace"]
        kustomization = yaml.safe_load((K8S / "overlays" / desc.name / "kustomization.yaml").read_text())
        assert kustomization["namespace"] == namespaces[desc.name]
        assert "namespace.yaml" in kustomization["resources"]
    assert namespaces == {name: f"epd-{name}" for name in namespaces}  # the default: epd-<name>


def test_two_stacks_in_one_namespace_are_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    stacks = []
    for name in ("one", "two"):
        doc = yaml.safe_load((STACKS / "colocated.yaml").read_text())
        doc["name"] = name
        doc["kubernetes"] = {"namespace": "shared"}
        stacks.append(tmp_path / f"{name}.yaml")
        stacks[-1].write_text(yaml.safe_dump(doc))
    args = ["deploy", "render", "--out", str(tmp_path / "out")]
    code, _, err = _epd([*args, "--stack", str(stacks[0]), "--stack", str(stacks[1])], capsys)
    assert code == 2
    assert "kubernetes.namespace 'shared'" in err and "give each its own kubernetes.namespace" in err
    assert not (tmp_path / "out").exists()
