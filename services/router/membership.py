"""Where the router's backends come from, and keeping those lists current while it runs.

`--encoders`, `--prefill`, `--decode` and `--pd` each take one of:
- addresses, `HOST:PORT,HOST:PORT` (fixed for the life of the process);
- `dns:///NAME:PORT`: every A/AAAA record of NAME, at PORT (a Kubernetes headless Service has one
  record per ready pod);
- `file:///PATH`: one `HOST:PORT` per line (`#` comments, blank lines ignored).
DNS and file members are re-read every `refresh_s` (`Membership.run`) and handed to the stage's
pool (services/router/pool.py), which starts using a new member at once and stops picking a
departed one (its in-flight calls finish; every service drains on SIGTERM, so nothing it holds
is lost). A failed re-read (resolver
timeout, unreadable file) keeps the last members; a name that does not exist or an empty file
means no members.
"""

from __future__ import annotations

import asyncio
import re
import socket
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import structlog

from libs.rpc.peers import PeerChannels
from services.router.encoders import EncoderPool
from services.router.pool import MemberPool

_log = structlog.get_logger(__name__)

MAX_MEMBERS = 1024
RESOLVE_TIMEOUT_S = 5.0
_ADDRESS = re.compile(r"^(\[[0-9a-fA-F:.]+\]|[A-Za-z0-9_.-]+):(\d{1,5})$")


class MembershipError(ValueError):
    """A member source that cannot be used; the message names it."""


class ResolveFailed(RuntimeError):
    """This re-read failed (keep the last members)."""


def check_address(address: str, where: str) -> str:
    match = _ADDRESS.match(address)
    if match is None or not 0 < int(match.group(2)) < 65536:
        raise MembershipError(f"{where}: {address!r} is not HOST:PORT")
    return address


def _host_port(address: str) -> str:
    return f"[{address}]" if ":" in address else address


@dataclass(frozen=True)
class Source:
    """One parsed `--encoders` (or `--prefill`, `--decode`, `--pd`) value."""

    kind: str  # "static", "dns" or "file"
    addresses: tuple[str, ...] = ()
    name: str = ""
    port: int = 0
    path: Path | None = None

    @property
    def dynamic(self) -> bool:
        return self.kind != "static"

    def __str__(self) -> str:
        if self.kind == "dns":
            return f"dns:///{self.name}:{self.port}"
        if self.kind == "file":
            return f"file://{self.path}"
        return ",".join(self.addresses)

    @classmethod
    def parse(cls, values: Sequence[str], setting: str = "--encoders") -> Source:
        if len(values) == 1 and values[0].startswith("dns:"):
            rest = values[0].removeprefix("dns:").removeprefix("//").removeprefix("/")
            name, _, port = rest.rpartition(":")
            if not name or not port.isdigit() or not 0 < int(port) < 65536 or "/" in name:
                raise MembershipError(f"{setting}: {values[0]!r} is not dns:///NAME:PORT")
            return cls("dns", name=name, port=int(port))
        if len(values) == 1 and values[0].startswith("file:"):
            path = values[0].removeprefix("file://")
            if not path.startswith("/"):
                raise MembershipError(f"{setting}: {values[0]!r} is not file:///ABSOLUTE/PATH")
            return cls("file", path=Path(path))
        if any(v.startswith(("dns:", "file:")) for v in values):
            raise MembershipError(f"{setting}: dns:/// or file:/// stands alone, not in a list")
        if not values:
            raise MembershipError(f"{setting}: no address given")
        return cls("static", addresses=tuple(check_address(v, setting) for v in values))

    async def resolve(self) -> list[str]:
        """The members now, sorted; raises ResolveFailed when this read failed."""
        if self.kind == "static":
            return sorted(set(self.addresses))
        if self.kind == "dns":
            members = await self._resolve_dns()
        else:
            members = await asyncio.to_thread(self._read_file)
        if len(members) > MAX_MEMBERS:
            raise ResolveFailed(f"{self}: {len(members)} members, more than {MAX_MEMBERS}")
        return sorted(set(members))

    async def _resolve_dns(self) -> list[str]:
        loop = asyncio.get_running_loop()
        try:
            infos = await asyncio.wait_for(
                loop.getaddrinfo(self.name, self.port, type=socket.SOCK_STREAM), RESOLVE_TIMEOUT_S
            )
        except socket.gaierror as exc:
            if exc.errno in (socket.EAI_NONAME, getattr(socket, "EAI_NODATA", socket.EAI_NONAME)):
                return []  # the name has no records: no members (a headless Service with no ready pod)
            raise ResolveFailed(f"{self}: {exc}") from None
        except TimeoutError:
            raise ResolveFailed(f"{self}: no answer within {RESOLVE_TIMEOUT_S} s") from None
        return [f"{_host_port(str(info[4][0]))}:{self.port}" for info in infos]

    def _read_file(self) -> list[str]:
        assert self.path is not None
        try:
            text = self.path.read_text()
        except OSError as exc:
            raise ResolveFailed(f"{self}: {exc.strerror or exc}") from None
        members = []
        for number, line in enumerate(text.splitlines(), 1):
            line = line.split("#", 1)[0].strip()
            if line:
                try:
                    members.append(check_address(line, f"{self.path}:{number}"))
                except MembershipError as exc:
                    raise ResolveFailed(str(exc)) from None
        return members


class Membership:
    """Re-reads a dynamic source every `refresh_s` and calls `apply(members)` when they change."""

    def __init__(
        self, source: Source, apply: Callable[[list[str]], Awaitable[None]], *, refresh_s: float = 2.0
    ) -> None:
        if not 0.1 <= refresh_s <= 300:
            raise MembershipError(f"--discovery-refresh-s: {refresh_s} is not within 0.1..300 seconds")
        self.source = source
        self._apply = apply
        self._refresh_s = refresh_s
        self.members: list[str] = []
        self._task: asyncio.Task[None] | None = None

    async def refresh(self) -> bool:
        """One re-read; whether the members changed."""
        try:
            members = await self.source.resolve()
        except ResolveFailed as exc:
            _log.warning("members not re-read; keeping the last", source=str(self.source), reason=str(exc))
            return False
        if members == self.members:
            return False
        added = sorted(set(members) - set(self.members))
        removed = sorted(set(self.members) - set(members))
        self.members = members
        _log.info("members changed", source=str(self.source), added=added, removed=removed, members=len(members))
        await self._apply(members)
        return True

    def start(self) -> None:
        if self.source.dynamic and self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run(), name="membership")

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self._refresh_s)
            try:
                await self.refresh()
            except Exception:  # never let one bad round end discovery
                _log.exception("membership refresh failed")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None


async def follow(pool: MemberPool, source: Source, *, refresh_s: float, peers: PeerChannels) -> Membership:
    """Keep `pool` at `source`'s members, read once now; dynamic sources keep being re-read once
    `Membership.start()` runs. Channels to departed members are closed once their last call ended."""

    async def apply(members: list[str]) -> None:
        for address in pool.update(members):
            await peers.drop(address)

    membership = Membership(source, apply, refresh_s=refresh_s)
    await membership.refresh()
    return membership


async def encoder_pool(
    values: Sequence[str], *, slack: int, refresh_s: float, peers: PeerChannels
) -> tuple[EncoderPool, Membership]:
    """The router's encoder pool from `--encoders` (see `follow`)."""
    source = Source.parse(values)
    pool = EncoderPool(source.addresses, slack=slack, dynamic=source.dynamic)
    return pool, await follow(pool, source, refresh_s=refresh_s, peers=peers)


async def member_pool(
    values: Sequence[str], *, stage: str, refresh_s: float, peers: PeerChannels
) -> tuple[MemberPool, Membership]:
    """The pool of one stage (prefill, decode, pd) from its setting `--STAGE` (see `follow`)."""
    source = Source.parse(values, f"--{stage}")
    pool = MemberPool(source.addresses, stage=stage, dynamic=source.dynamic)
    return pool, await follow(pool, source, refresh_s=refresh_s, peers=peers)
