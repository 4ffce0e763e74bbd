"""The door's scope for cached prefixes (contract 1.8 `cache_salt`): with bearer tokens each caller
gets its own, which the body's `cache_salt` may split but never leave; without tokens the body's
salt is passed on; a salt past the contract's bound is a 400 naming it."""

from __future__ import annotations

import json

import pytest

from libs.door.app import tenant_salt
from tests.support.door_router import CHAT, COMPLETION, door

pytestmark = pytest.mark.unit

JSON = {"content-type": "application/json"}


def test_a_callers_scope_comes_from_its_token_and_the_body_only_splits_it() -> None:
    assert tenant_salt(None, None) == "" and tenant_salt(None, "conversation-7") == "conversation-7"
    alice, bob = tenant_salt("token-a", None), tenant_salt("token-b", None)
    assert alice != bob and "token-a" not in alice  # the token itself never travels as a salt
    assert tenant_salt("token-a", "x").startswith(alice + "/")
    assert tenant_salt("token-a", bob) != bob  # naming another caller's scope stays inside one's own


@pytest.mark.parametrize(("route", "body"), [("/v1/chat/completions", CHAT), ("/v1/completions", COMPLETION)])
def test_the_salt_reaches_the_router(route: str, body: dict[str, object]) -> None:
    open_door = door()
    reply = open_door.client().post(route, content=json.dumps({**body, "cache_salt": "conv-1"}), headers=JSON)
    assert reply.status_code == 200 and open_door.router.seen[-1].cache_salt == "conv-1"

    with_tokens = door(tokens=frozenset({"token-a", "token-b"}))
    impersonating = json.dumps({**body, "cache_salt": tenant_salt("token-b", None)})
    headers = {**JSON, "authorization": "Bearer token-a"}
    assert with_tokens.client().post(route, content=impersonating, headers=headers).status_code == 200
    assert with_tokens.router.seen[-1].cache_salt == tenant_salt("token-a", tenant_salt("token-b", None))


def test_a_salt_past_its_bound_is_refused_naming_it() -> None:
    reply = (
        door()
        .client()
        .post("/v1/chat/completions", content=json.dumps({**CHAT, "cache_salt": "s" * 300}), headers=JSON)
    )
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "cache_salt"
