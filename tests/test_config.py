"""The configuration tree: mechanical flag/env names, OpenWhisk aliases, and its documentation."""

from __future__ import annotations

from pathlib import Path

import pytest

from dilu_invoker import cli, config

DOC = Path(__file__).resolve().parents[1] / "docs" / "configuration.md"


def test_documentation_lists_every_setting() -> None:
    # docs/configuration.md is generated from the code; a new setting must be documented.
    assert config.describe() in DOC.read_text()


def test_precedence_flag_over_dilu_env_over_openwhisk_name() -> None:
    env = {"DILU_KAFKA_HOSTS": "dilu:9092", "KAFKA_HOSTS": "ow:9092", "CONFIG_whisk_couchdb_host": "couch"}
    assert config.load(environ=env).kafka.hosts == "dilu:9092"
    assert config.load(environ={"KAFKA_HOSTS": "ow:9092"}).kafka.hosts == "ow:9092"
    args = cli.build_parser().parse_args(["invoker", "--kafka-hosts", "flag:9092", "--id", "3"])
    cfg = config.load(args, environ=env)
    assert (cfg.kafka.hosts, cfg.invoker.id, cfg.couchdb.host) == ("flag:9092", 3, "couch")


@pytest.mark.parametrize(
    ("environ", "message"),
    [
        ({"DILU_API_PORT": "many"}, "DILU_API_PORT"),
        ({"DILU_INVOKER_BACKEND": "lxc"}, "--invoker-backend"),
        ({"DILU_GPU_GAMMA": "0.5"}, "--gpu-gamma"),
        ({"DILU_LOG_LEVEL": "loud"}, "--log-level"),
    ],
    ids=["not-a-number", "unknown-backend", "gamma-below-one", "bad-log-level"],
)
def test_invalid_settings_name_the_setting(environ: dict[str, str], message: str) -> None:
    with pytest.raises(config.ConfigError, match=message):
        config.load(environ=environ)


def test_secure_defaults() -> None:
    cfg = config.load(environ={})
    assert cfg.api.host == "127.0.0.1" and cfg.invoker.host == "127.0.0.1"
    assert cfg.invoker.password is None  # a random one is generated at start
    assert cfg.redis.url is None  # the embedded Redis gets a random password
