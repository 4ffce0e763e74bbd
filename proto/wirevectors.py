"""Golden wire vectors: the bytes each released contract minor wrote, kept so later code must read them.

    python proto/wirevectors.py --check         # vectors match their builders; current code reads them
    python proto/wirevectors.py write v1.0      # write proto/snapshots/v1.0/wire/*.binpb and *.txtpb

`proto/snapshots/v<major>.<minor>/wire/builders.py` (frozen with the snapshot) builds one message per
RPC request and response type with the snapshot's generated code (`libs.contract.snapshots`). This
script writes each as `<full name>.binpb` (deterministic serialization) and `<full name>.txtpb` (its
text format: what the bytes mean, for review). Vectors are written once, when the minor is released;
`write` refuses to change an existing vector unless `--force` is given.

`--check` fails when
- a vector differs from what its builders write, is missing, or is stale (the builders were edited,
  or the snapshot's generated code changed);
- the builders leave a field of the snapshot at its default, or miss a request/response type;
- the current code (`libs.contract.epd.v1`) reads a vector to something other than its `.txtpb`, sees
  unknown fields in it, re-serializes it to other bytes, or rejects a request the snapshot's
  builders declared valid; or the snapshot code reads the current code's bytes of the same message
  to something else.
"""

from __future__ import annotations

import argparse
import difflib
import importlib
import importlib.util
import re
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

from google.protobuf import descriptor_pool, text_format
from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import Message

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def load_by_path(name: str, path: Path) -> ModuleType:
    """Import the file `path` as module `name` (proto/ and the snapshot directories are not packages)."""
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


_codegen = load_by_path("epd_proto_codegen", Path(__file__).resolve().parent / "codegen.py")
SNAPSHOT_PROTO_ROOT: Path = _codegen.SNAPSHOT_PROTO_ROOT
snapshot_module: Callable[[str], str] = _codegen.snapshot_module
snapshot_version: Callable[[str], tuple[int, int]] = _codegen.snapshot_version

CURRENT_PACKAGE = "libs.contract.epd.v1"
HEADER = "# Written by proto/wirevectors.py from proto/snapshots/{snapshot}/wire/builders.py. Do not edit.\n"


@dataclass(frozen=True)
class Snapshot:
    """One released minor with wire vectors."""

    name: str  # "v1.0"
    path: Path  # proto/snapshots/v1.0

    @property
    def wire(self) -> Path:
        return self.path / "wire"

    @property
    def package(self) -> str:
        major, _ = snapshot_version(self.name)
        return f"libs.contract.snapshots.{snapshot_module(self.name)}.epd.v{major}"


def snapshots() -> list[Snapshot]:
    """Every snapshot that has builders, oldest first."""
    found = [Snapshot(p.name, p) for p in SNAPSHOT_PROTO_ROOT.iterdir() if (p / "wire" / "builders.py").is_file()]
    return sorted(found, key=lambda s: snapshot_version(s.name))


def builders(snapshot: Snapshot) -> ModuleType:
    """The snapshot's `wire/builders.py`, loaded by path (its directory is not a package)."""
    return load_by_path(f"epd_wire_builders_{snapshot_module(snapshot.name)}", snapshot.wire / "builders.py")


def _modules(package: str) -> list[ModuleType]:
    directory = ROOT.joinpath(*package.split("."))
    return [importlib.import_module(f"{package}.{p.stem}") for p in sorted(directory.glob("*_pb2.py"))]


def message_class(package: str, full_name: str) -> type[Message]:
    """The generated class of `full_name` (e.g. "epd.v1.GenerateRequest") in `package`."""
    for module in _modules(package):
        descriptor = module.DESCRIPTOR.message_types_by_name.get(full_name.rsplit(".", 1)[1])
        if descriptor is not None and descriptor.full_name == full_name:
            cls: type[Message] = getattr(module, descriptor.name)
            return cls
    raise KeyError(f"{full_name} is not in {package}")


def rpc_types(package: str) -> set[str]:
    """Full names of every request and response type of every RPC in `package`."""
    names: set[str] = set()
    for module in _modules(package):
        for service in module.DESCRIPTOR.services_by_name.values():
            for method in service.methods:
                names |= {method.input_type.full_name, method.output_type.full_name}
    return names


def _all_messages(package: str) -> Iterator[Descriptor]:
    def walk(descriptor: Descriptor) -> Iterator[Descriptor]:
        yield descriptor
        for nested in descriptor.nested_types:
            yield from walk(nested)

    for module in _modules(package):
        for descriptor in module.DESCRIPTOR.message_types_by_name.values():
            yield from walk(descriptor)


def _set_fields(message: Message, seen: set[str]) -> None:
    for field, value in message.ListFields():
        seen.add(f"{message.DESCRIPTOR.full_name}.{field.name}")
        if field.type != FieldDescriptor.TYPE_MESSAGE:
            continue
        for item in value if field.is_repeated else [value]:
            _set_fields(item, seen)


def unpopulated(snapshot: Snapshot) -> list[str]:
    """Fields of the snapshot's messages that no vector sets, less the builders' declared exceptions."""
    seen: set[str] = set()
    for message in builders(snapshot).vectors():
        _set_fields(message, seen)
    every = {f"{d.full_name}.{f.name}" for d in _all_messages(snapshot.package) for f in d.fields}
    return sorted(every - seen - set(builders(snapshot).UNPOPULATED))


def render(snapshot: Snapshot) -> dict[str, bytes]:
    """File name -> content of every vector the snapshot's builders write."""
    files: dict[str, bytes] = {}
    for message in builders(snapshot).vectors():
        name = message.DESCRIPTOR.full_name
        if message.DESCRIPTOR.file.pool is descriptor_pool.Default():
            raise SystemExit(f"wirevectors: {snapshot.name} builders made {name} with the current code")
        if f"{name}.binpb" in files:
            raise SystemExit(f"wirevectors: {snapshot.name} builders make {name} twice")
        files[f"{name}.binpb"] = message.SerializeToString(deterministic=True)
        header = f"# proto-message: {name}\n" + HEADER.format(snapshot=snapshot.name)
        files[f"{name}.txtpb"] = (header + text_format.MessageToString(message)).encode()
    return files


def vector_names(snapshot: Snapshot) -> list[str]:
    """Full names of the message types with a checked-in vector."""
    return sorted(p.name.removesuffix(".binpb") for p in snapshot.wire.glob("*.binpb"))


def _snake(name: str) -> str:
    return re.sub(r"(?<!^)(?=[A-Z])", "_", name).lower()


def validator(full_name: str, limits: Any = None) -> Callable[[Message], None] | None:
    """The current `validate_<request>` for a request type, or None when there is none."""
    from libs.contract import validation

    function = getattr(validation, f"validate_{_snake(full_name.rsplit('.', 1)[1])}", None)
    if function is None:
        return None
    return lambda message: function(message, limits if limits is not None else validation.DEFAULT_LIMITS)


def read_problems(snapshot: Snapshot, full_name: str, limits: Any = None) -> list[str]:
    """What is wrong when the current code reads the snapshot's vector of `full_name` (empty: nothing)."""
    where = f"{snapshot.name} {full_name}"
    data = (snapshot.wire / f"{full_name}.binpb").read_bytes()
    expected = (snapshot.wire / f"{full_name}.txtpb").read_text()
    try:
        current_cls = message_class(CURRENT_PACKAGE, full_name)
    except KeyError:
        return [f"{where}: the current contract has no message {full_name}"]
    problems = []
    try:
        current = current_cls.FromString(data)
    except Exception as exc:  # DecodeError, and whatever a changed type makes of the bytes
        return [f"{where}: the current code cannot parse the vector: {exc}"]
    lines = expected.splitlines(keepends=True)
    while lines and lines[0].startswith("#"):
        lines.pop(0)
    shown = text_format.MessageToString(current, print_unknown_fields=True)
    if shown != "".join(lines):
        diff = difflib.unified_diff(lines, shown.splitlines(keepends=True), f"{full_name}.txtpb", "current code", n=1)
        problems.append(f"{where}: the current code reads it differently from its .txtpb:\n" + "".join(list(diff)[:60]))
    if current != text_format.Parse(expected, current_cls()):
        problems.append(f"{where}: the current code's message differs from the .txtpb parsed by the current code")
    if current.SerializeToString(deterministic=True) != data:
        problems.append(f"{where}: the current code re-serializes the vector to different bytes")
    snapshot_cls = message_class(snapshot.package, full_name)
    if snapshot_cls.FromString(current.SerializeToString()) != snapshot_cls.FromString(data):
        problems.append(f"{where}: the snapshot code reads the current code's bytes as a different message")
    check = validator(full_name, limits) if full_name.endswith("Request") else None
    if check is not None:
        try:
            check(current)
        except Exception as exc:
            problems.append(f"{where}: the current validation rejects a request {snapshot.name} accepted: {exc}")
    return problems


def write_problems(snapshot: Snapshot) -> list[str]:
    """What differs between the checked-in vectors and what the builders write, and coverage gaps."""
    problems = []
    fresh = render(snapshot)
    present = {p.name for p in snapshot.wire.iterdir() if p.suffix in (".binpb", ".txtpb")}
    for name in sorted(fresh.keys() | present):
        if name not in present:
            problems.append(f"{snapshot.name}: {name} is not written; run proto/wirevectors.py write {snapshot.name}")
        elif name not in fresh:
            problems.append(f"{snapshot.name}: {name} is stale (no builder makes it)")
        elif (snapshot.wire / name).read_bytes() != fresh[name]:
            problems.append(f"{snapshot.name}: {name} differs from what the builders write")
    missing = rpc_types(snapshot.package) - {n.removesuffix(".binpb") for n in fresh if n.endswith(".binpb")}
    problems += [f"{snapshot.name}: no builder makes {name}" for name in sorted(missing)]
    problems += [f"{snapshot.name}: no vector sets {field}" for field in unpopulated(snapshot)]
    return problems


def check() -> int:
    problems = []
    count = 0
    for snapshot in snapshots():
        problems += write_problems(snapshot)
        for name in vector_names(snapshot):
            count += 1
            problems += read_problems(snapshot, name)
    if problems:
        sys.stderr.write("\n".join(problems) + "\nwirevectors: check failed\n")
        return 1
    print(f"wirevectors: {count} vectors in {len(snapshots())} snapshots are current and readable")
    return 0


def write(name: str, force: bool) -> int:
    snapshot = next((s for s in snapshots() if s.name == name), None)
    if snapshot is None:
        raise SystemExit(f"wirevectors: no proto/snapshots/{name}/wire/builders.py")
    fresh = render(snapshot)
    present = {p.name for p in snapshot.wire.iterdir() if p.suffix in (".binpb", ".txtpb")}
    changed = sorted(n for n in present if n not in fresh or (snapshot.wire / n).read_bytes() != fresh[n])
    if changed and not force:
        sys.stderr.write(
            f"wirevectors: would change released vectors ({', '.join(changed)}); golden vectors are written "
            "once per release. Pass --force only if they were never released.\n"
        )
        return 1
    for stale in sorted(present - fresh.keys()):
        (snapshot.wire / stale).unlink()
    for file_name, content in fresh.items():
        (snapshot.wire / file_name).write_bytes(content)
    print(f"wirevectors: wrote {len(fresh)} files to {snapshot.wire.relative_to(ROOT)}")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="fail if vectors are stale or unreadable")
    sub = parser.add_subparsers(dest="command")
    writer = sub.add_parser("write", help="write a snapshot's vectors")
    writer.add_argument("snapshot", help="e.g. v1.0")
    writer.add_argument("--force", action="store_true", help="overwrite vectors that differ")
    ns = parser.parse_args()
    if ns.check:
        return check()
    if ns.command == "write":
        return write(ns.snapshot, ns.force)
    parser.print_usage()
    return 2


if __name__ == "__main__":
    sys.exit(main())
