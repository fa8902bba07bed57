"""API keys: the guest key, the auth file, and what the REST API does with each."""

from __future__ import annotations

import base64
from pathlib import Path
from typing import Any

import pytest
from ow_support.api import PY_CODE

from dilu_invoker.config import ApiConfig
from dilu_invoker.model import GUEST_IDENTITY, Identity
from dilu_invoker.openwhisk.rest_auth import (
    Authenticator,
    AuthFileError,
    parse_auth_lines,
)

KEY_A = "11111111-2222-3333-4444-555555555555:" + "a" * 64
KEY_B = "66666666-7777-8888-9999-000000000000:" + "b" * 64


def header(api_key: str) -> str:
    return "Basic " + base64.b64encode(api_key.encode()).decode()


def test_auth_file_lines(tmp_path: Path) -> None:
    path = tmp_path / "auth"
    path.write_text(f"# team keys\n\n{KEY_A} team-a   # the first team\n{KEY_B}\tteam.b\n")
    auth = Authenticator.from_config(ApiConfig(auth_file=str(path)))
    a = auth.authenticate_header(header(KEY_A))
    assert a is not None and a.namespace == "team-a" and a.subject == "team-a" and a.api_key == KEY_A
    b = auth.authenticate_header(header(KEY_B))
    assert b is not None and b.namespace == "team.b"
    assert auth.authenticate_header(header(GUEST_IDENTITY.api_key)) == GUEST_IDENTITY


def test_guest_key_can_be_turned_off(tmp_path: Path) -> None:
    path = tmp_path / "auth"
    path.write_text(f"{KEY_A} team-a\n")
    auth = Authenticator.from_config(ApiConfig(auth_file=str(path), guest_key=False))
    assert auth.authenticate_header(header(GUEST_IDENTITY.api_key)) is None
    assert auth.authenticate_header(header(KEY_A)) is not None
    with pytest.raises(AuthFileError, match="no API key is accepted"):
        Authenticator.from_config(ApiConfig(guest_key=False))


@pytest.mark.parametrize(
    ("line", "message"),
    [
        (KEY_A, "expected '<uuid>:<key> <namespace>'"),
        (f"{KEY_A} ns extra", "expected '<uuid>:<key> <namespace>'"),
        ("no-colon-key ns", "must look like '<uuid>:<key>'"),
        ("uuid: ns", "must look like '<uuid>:<key>'"),
        (f"{KEY_A} -bad", "is not a valid entity name"),
        (f"{KEY_A} _", "is not a valid entity name"),
    ],
)
def test_bad_auth_lines_name_the_line(line: str, message: str) -> None:
    with pytest.raises(AuthFileError, match=message) as info:
        parse_auth_lines(["# header", line], source="keys.txt")
    assert str(info.value).startswith("keys.txt:2: ")


def test_unreadable_file_and_conflicting_keys(tmp_path: Path) -> None:
    with pytest.raises(AuthFileError, match="--api-auth-file"):
        Authenticator.from_config(ApiConfig(auth_file=str(tmp_path / "missing")))
    uuid = KEY_A.split(":")[0]
    with pytest.raises(AuthFileError, match="listed twice"):
        Authenticator(parse_auth_lines([f"{KEY_A} a", f"{uuid}:other b"]))


def test_wrong_keys_are_refused() -> None:
    auth = Authenticator([GUEST_IDENTITY])
    uuid = GUEST_IDENTITY.uuid
    for api_key in (f"{uuid}:wrong", f"{uuid}:", "unknown:" + GUEST_IDENTITY.key, uuid, ""):
        assert auth.authenticate_key(api_key) is None, api_key
    for value in (None, "", "Basic", "Digest abc", "Basic ***", "Basic " + base64.b64encode(b"\xff\xfe").decode()):
        assert auth.authenticate_header(value) is None, value


async def test_file_identity_works_in_its_own_namespace(make_api: Any, tmp_path: Path) -> None:
    path = tmp_path / "auth"
    path.write_text(f"{KEY_A} team-a\n")
    api = await make_api(auth=Authenticator.from_config(ApiConfig(auth_file=str(path))))
    team = Identity(subject="team-a", namespace="team-a", uuid=KEY_A.split(":")[0], key=KEY_A.split(":")[1])
    body = {"exec": {"kind": "python:3", "code": PY_CODE}}
    status, created, _ = await api.put_action("hello", body, identity=team)
    assert status == 200 and created["namespace"] == "team-a"
    status, got, _ = await api.call("GET", "/api/v1/namespaces/team-a/actions/hello", identity=team)
    assert status == 200 and got["name"] == "hello"
    status, _, _ = await api.call("GET", "/api/v1/namespaces/team-a/actions/hello")  # as guest
    assert status == 403
    status, _, _ = await api.call("GET", "actions/hello")  # guest's own namespace has no such action
    assert status == 404
    status, names, _ = await api.call("GET", "/api/v1/namespaces", identity=team)
    assert names == ["team-a"]
