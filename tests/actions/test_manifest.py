"""runtimes.json follows OpenWhisk's manifest rules (reference/openwhisk.md §5)."""

from __future__ import annotations

import json
from importlib import resources
from typing import Any

import dilu_invoker


def manifest() -> dict[str, Any]:
    text = resources.files("dilu_invoker.actions").joinpath("runtimes.json").read_text()
    return json.loads(text)


def test_families_have_one_default_and_kinds_are_unique() -> None:
    kinds: list[str] = []
    for family, members in manifest()["runtimes"].items():
        defaults = [member["kind"] for member in members if member.get("default")]
        # OpenWhisk refuses to start with two defaults, or none in a family of several.
        assert len(defaults) <= 1, family
        assert defaults or len(members) == 1, family
        kinds += [member["kind"] for member in members]
    assert len(kinds) == len(set(kinds))
    assert {"python:3", "python:3-gpu"} <= set(kinds)


def test_python_default_and_images() -> None:
    members = {member["kind"]: member for member in manifest()["runtimes"]["python"]}
    assert members["python:3"]["default"] is True
    assert members["python:3-gpu"]["default"] is False
    images = {kind: member["image"] for kind, member in members.items()}
    assert images["python:3"] == {
        "prefix": "localhost",
        "name": "dilu-python3-runtime",
        "tag": dilu_invoker.__version__,
    }
    assert images["python:3-gpu"] == {
        "prefix": "localhost",
        "name": "dilu-python3-gpu-runtime",
        "tag": dilu_invoker.__version__,
    }
    for member in members.values():
        assert member["attached"] == {"attachmentName": "codefile", "attachmentType": "text/plain"}
        assert member["deprecated"] is False
        assert member.get("sentinelledLogs", True) is True
