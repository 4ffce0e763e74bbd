"""`epd deploy render`: Kubernetes manifests from the stack descriptions (deploy/stacks).

epd deploy render                        # write var/k8s/base and one overlay per deploy/stacks/*.yaml
epd deploy render --stack my.yaml --out k8s/   # one description, where you want it
epd deploy render --check                # exit 1 and list what differs from the committed deploy/k8s
epd deploy render --out deploy/k8s       # re-render the committed manifests (after editing a description)

The committed deploy/k8s is the project's own rendering, checked in CI; a plain render never
writes over it (nor over a file it did not render) but into var/k8s, as `helm template
--output-dir` writes where it is told.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from libs.launch.config import DescriptionError, load_description
from libs.launch.k8s import HEADER, render
from libs.launch.process import ROOT

STACKS = ROOT / "deploy" / "stacks"
K8S = ROOT / "deploy" / "k8s"  # the committed rendering: what --check compares with
OUT = Path("var/k8s")  # where a render goes unless --out says otherwise


def rendered(stacks: list[Path], out: Path) -> dict[Path, str]:
    return render([load_description(path) for path in stacks], out)


def drift(files: dict[Path, str], out: Path) -> list[str]:
    """What differs between `files` and the tree under `out`: changed, missing and stale files."""
    problems = [f"{p}: differs" for p, text in files.items() if p.exists() and p.read_text() != text]
    problems += [f"{p}: missing" for p in files if not p.exists()]
    if out.exists():
        problems += [f"{p}: not rendered from any description" for p in sorted(out.rglob("*.yaml")) if p not in files]
    return problems


def _ours(path: Path) -> bool:
    """A file an earlier render wrote (it starts with the header every rendered file carries)."""
    try:
        with path.open() as f:
            return f.readline().startswith(HEADER.split("{", 1)[0])
    except (OSError, UnicodeDecodeError):
        return False


def cmd_render(ns: argparse.Namespace) -> int:
    stacks = ns.stack or sorted(STACKS.glob("*.yaml"))
    out: Path = ns.out or (K8S if ns.check else OUT)
    try:
        files = rendered(stacks, out)
    except DescriptionError as exc:
        print(f"epd deploy render: {exc}", file=sys.stderr)
        return 2
    if ns.check:
        problems = drift(files, out)
        for line in problems:
            print(line, file=sys.stderr)
        print(f"{len(files)} files, {len(problems)} out of date", file=sys.stderr)
        return 1 if problems else 0
    # Overlays of descriptions since removed go too, but only files a render wrote.
    stale = [p for p in sorted(out.rglob("*.yaml")) if p not in files and _ours(p)] if out.exists() else []
    for path in stale:
        path.unlink()
    for path, text in files.items():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    overlays = sorted({p.parent for p in files if p.parent.parent.name == "overlays"})
    print(f"wrote {len(files)} files under {out}" + (f" ({len(stale)} stale ones removed)" if stale else ""))
    for overlay in overlays:
        print(f"  kubectl apply -k {overlay}")
    return 0


def add_parser(sub: Any) -> None:
    deploy = sub.add_parser("deploy", help="deployment tools").add_subparsers(dest="deploy_command", required=True)
    render_cmd = deploy.add_parser("render", help="Kubernetes manifests from the stack descriptions")
    render_cmd.add_argument("--stack", type=Path, action="append", help="a description (default: deploy/stacks/*.yaml)")
    render_cmd.add_argument(
        "--out",
        type=Path,
        default=None,
        help=f"output directory (default: {OUT}; with --check: the committed deploy/k8s)",
    )
    render_cmd.add_argument(
        "--check", action="store_true", help="write nothing; exit 1 if the files under --out differ from a render"
    )
    render_cmd.set_defaults(func=cmd_render)
