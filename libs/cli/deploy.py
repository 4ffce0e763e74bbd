"""`epd deploy render`: Kubernetes manifests (deploy/k8s) from the stack descriptions (deploy/stacks).

epd deploy render            # write deploy/k8s/base and one overlay per deploy/stacks/*.yaml
epd deploy render --check    # exit 1 and list what differs (the committed files drifted)
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from libs.launch.config import DescriptionError, load_description
from libs.launch.k8s import render
from libs.launch.process import ROOT

STACKS = ROOT / "deploy" / "stacks"
K8S = ROOT / "deploy" / "k8s"


def rendered(stacks: list[Path], out: Path) -> dict[Path, str]:
    return render([load_description(path) for path in stacks], out)


def drift(files: dict[Path, str], out: Path) -> list[str]:
    """What differs between `files` and the tree under `out`: changed, missing and stale files."""
    problems = [f"{p}: differs" for p, text in files.items() if p.exists() and p.read_text() != text]
    problems += [f"{p}: missing" for p in files if not p.exists()]
    if out.exists():
        problems += [f"{p}: not rendered from any description" for p in sorted(out.rglob("*.yaml")) if p not in files]
    return problems


def cmd_render(ns: argparse.Namespace) -> int:
    stacks = ns.stack or sorted(STACKS.glob("*.yaml"))
    try:
        files = rendered(stacks, ns.out)
    except DescriptionError as exc:
        print(f"epd deploy render: {exc}", file=sys.stderr)
        return 2
    if ns.check:
        problems = drift(files, ns.out)
        for line in problems:
            print(line, file=sys.stderr)
        print(f"{len(files)} files, {len(problems)} out of date", file=sys.stderr)
        return 1 if problems else 0
    for stale in (p for p in sorted(ns.out.rglob("*.yaml")) if p not in files) if ns.out.exists() else ():
        stale.unlink()
    for path, text in files.items():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    print(f"wrote {len(files)} files under {ns.out}")
    return 0


def add_parser(sub: Any) -> None:
    deploy = sub.add_parser("deploy", help="deployment tools").add_subparsers(dest="deploy_command", required=True)
    render_cmd = deploy.add_parser("render", help="Kubernetes manifests from the stack descriptions")
    render_cmd.add_argument("--stack", type=Path, action="append", help="a description (default: deploy/stacks/*.yaml)")
    render_cmd.add_argument("--out", type=Path, default=K8S, help="output directory (default deploy/k8s)")
    render_cmd.add_argument("--check", action="store_true", help="write nothing; exit 1 if the files differ")
    render_cmd.set_defaults(func=cmd_render)
