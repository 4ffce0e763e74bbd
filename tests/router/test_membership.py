"""Where the router's encoders come from (fixed list, dns:///, file:///) and how the pool follows
member changes: a new member is picked at once, a departed one never again (its jobs still
counted until they end), a draining one avoided while another is left."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path

import pytest

from services.router.encoders import EncoderPool
from services.router.membership import Membership, MembershipError, ResolveFailed, Source

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(
    ("values", "problem"),
    [
        (["dns:///encoders"], "is not dns:///NAME:PORT"),
        (["dns:///encoders:99999"], "is not dns:///NAME:PORT"),
        (["file://relative/path"], "is not file:///ABSOLUTE/PATH"),
        (["127.0.0.1:1", "dns:///e:1"], "stands alone"),
        (["127.0.0.1"], "'127.0.0.1' is not HOST:PORT"),
        ([], "no address given"),
    ],
)
def test_bad_sources_are_refused_naming_the_setting(values: list[str], problem: str) -> None:
    with pytest.raises(MembershipError, match="--encoders: .*" + problem.replace("(", r"\(").replace(")", r"\)")):
        Source.parse(values)


def test_backend_sources_are_named_by_their_setting() -> None:
    assert Source.parse(["dns:///epd-prefill.epd.svc.cluster.local:50071"], "--prefill").dynamic
    with pytest.raises(MembershipError, match="--decode: 'x' is not HOST:PORT"):
        Source.parse(["x"], "--decode")
    with pytest.raises(MembershipError, match="--pd: no address given"):
        Source.parse([], "--pd")


def test_sources_parse() -> None:
    assert Source.parse(["a:1", "b:2"]).addresses == ("a:1", "b:2")
    dns = Source.parse(["dns:///epd-encoder.epd.svc.cluster.local:50061"])
    assert (dns.kind, dns.name, dns.port, dns.dynamic) == ("dns", "epd-encoder.epd.svc.cluster.local", 50061, True)
    assert str(dns) == "dns:///epd-encoder.epd.svc.cluster.local:50061"
    assert Source.parse(["file:///run/members"]).path == Path("/run/members")


def test_dns_members_are_every_record_of_the_name() -> None:
    members = asyncio.run(Source.parse(["dns:///localhost:50061"]).resolve())
    assert "127.0.0.1:50061" in members
    assert asyncio.run(Source.parse(["dns:///no-such-host.invalid:1"]).resolve()) == []


def test_file_members(tmp_path: Path) -> None:
    path = tmp_path / "members"
    path.write_text("# encoders\n10.0.0.2:50061\n\n10.0.0.1:50061  # the first\n10.0.0.2:50061\n")
    source = Source.parse([f"file://{path}"])
    assert asyncio.run(source.resolve()) == ["10.0.0.1:50061", "10.0.0.2:50061"]
    path.write_text("10.0.0.1\n")
    with pytest.raises(ResolveFailed, match=r"members:1: '10.0.0.1' is not HOST:PORT"):
        asyncio.run(source.resolve())
    path.unlink()
    with pytest.raises(ResolveFailed, match="No such file"):
        asyncio.run(source.resolve())


def test_membership_applies_changes_and_keeps_the_last_members_when_a_read_fails(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "members"
    seen: list[list[str]] = []
    reads: list[int] = []  # one entry per re-read of the file, successful or not
    read_file = Source._read_file

    def counted(self: Source) -> list[str]:
        try:
            return read_file(self)
        finally:
            reads.append(1)

    monkeypatch.setattr(Source, "_read_file", counted)

    def write(text: str) -> None:  # whole or not at all, as a reader must see it
        (tmp_path / "members.new").write_text(text)
        (tmp_path / "members.new").replace(path)

    async def until(condition: Callable[[], bool], what: str) -> None:
        for _ in range(3000):  # bounded: 30 s (the refresh period is 0.1 s)
            if condition():
                return
            await asyncio.sleep(0.01)
        raise AssertionError(f"never {what}: seen {seen}, {len(reads)} reads")

    async def scenario() -> None:
        membership = Membership(Source.parse([f"file://{path}"]), apply, refresh_s=0.1)
        write("a:1\n")
        assert await membership.refresh()
        membership.start()
        write("a:1\nb:2\n")
        await until(lambda: len(seen) == 2, "the added member applied")
        write("not an address\n")  # a bad read: nothing changes
        after = len(reads)
        await until(lambda: len(reads) >= after + 2, "two re-reads of the bad file")  # the 2nd began after the write
        write("b:2\n")
        await until(lambda: len(seen) == 3, "the removal applied")
        await membership.stop()
        assert membership.members == ["b:2"]

    async def apply(members: list[str]) -> None:
        seen.append(members)

    asyncio.run(scenario())
    assert seen == [["a:1"], ["a:1", "b:2"], ["b:2"]]
    with pytest.raises(MembershipError, match="--discovery-refresh-s"):
        Membership(Source.parse(["a:1"]), apply, refresh_s=0)


def test_pool_follows_members() -> None:
    pool = EncoderPool([], dynamic=True)
    assert pool.update(["a:1"]) == []
    assert pool.pick() == "a:1"
    pool.update(["a:1", "b:2"])
    pool.begin("a:1")
    assert pool.pick() == "b:2"  # the new member, least loaded, is used at once
    pool.begin("b:2")
    assert pool.update(["b:2"]) == []  # a:1 departs with a job in flight: its channel stays
    assert {pool.pick() for _ in range(5)} == {"b:2"}
    assert pool.size == 1
    pool.end("a:1")  # its last job ended after it left
    assert pool.update(["b:2"]) == ["a:1"]  # now its channel can go
    pool.end("b:2")
    assert pool.outstanding == {"b:2": 0}
    assert pool.update(["c:3"]) == ["b:2"]


def test_a_draining_member_is_avoided_while_another_is_left() -> None:
    pool = EncoderPool(["a:1", "b:2"])
    pool.draining("a:1")
    assert {pool.pick(key=f"item-{i}") for i in range(20)} == {"b:2"}
    assert pool.pick(exclude={"b:2"}) == "a:1"  # the only one left: still tried
    pool.draining("b:2", for_s=0.0)  # expires at once
    assert pool.pick(exclude={"a:1"}) == "b:2"


def test_static_pool_still_needs_a_member() -> None:
    with pytest.raises(ValueError, match="at least one encoder"):
        EncoderPool([])
