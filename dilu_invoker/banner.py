"""The start-up banner ``dilu-invoker standalone`` prints on a terminal: where the API is, which key it
takes and where that key is, and the ``wsk`` line to copy."""

from __future__ import annotations

import shlex

from dilu_invoker.config import Config
from dilu_invoker.model import GUEST_IDENTITY


def client_url(api_url: str, host: str) -> str:
    """The URL a client on this machine uses (a wildcard bind is reached through loopback)."""
    if host in ("0.0.0.0", "::", ""):
        return api_url.replace(f"//{host}:", "//127.0.0.1:", 1) if host else api_url
    return api_url


def standalone_banner(cfg: Config, api_url: str) -> str:
    url = client_url(api_url, cfg.api.host)
    lines = ["", f"dilu-invoker standalone is ready: OpenWhisk REST API at {url}"]
    if cfg.api.guest_key:
        lines.append(f"  API key: OpenWhisk's guest key (namespace {GUEST_IDENTITY.namespace}), built in")
        auth = GUEST_IDENTITY.api_key
    else:
        auth = ""
    if cfg.api.auth_file:
        lines.append(f"  API keys: {cfg.api.auth_file} (one 'uuid:key namespace' per line)")
        if not cfg.api.guest_key:
            # the first key of the file, read by the shell: the banner itself never shows a secret
            auth = "$(awk 'NF && $1 !~ /^#/ {print $1; exit}' " + shlex.quote(cfg.api.auth_file) + ")"
    lines += [
        "  Configure the wsk CLI:",
        f'    wsk property set --apihost {url} --auth "{auth}"',
        f"  Logs of this server: below; data and credentials: {cfg.data_path}. Stop with Ctrl-C.",
        "",
    ]
    return "\n".join(lines)
