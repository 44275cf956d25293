"""API keys at the gateway (services/gateway/keys.py, access.py, http_auth.py): digests compared,
the keys file re-read when it changes (a Kubernetes-style symlink swap included), a bad update
keeping the last good keys, 401 with OpenAI's JSON before the route runs, open paths stay open."""
from __future__ import annotations

import os
from pathlib import Path

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from services.gateway.access import Access
from services.gateway.http_auth import ApiKeyMiddleware, request_identity
from services.gateway.keys import (
    ANONYMOUS, ApiKeys, Unauthenticated, bearer_token, key_digest, key_id, parse_keys_file)


def write(path: Path, text: str) -> None:
    """Replace ``path`` atomically (a new inode, as an editor or kubelet does)."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def test_no_keys_is_open_and_anonymous():
    keys = ApiKeys()
    assert not keys.enabled
    assert keys.authenticate(None) is ANONYMOUS
    assert keys.authenticate("anything") is ANONYMOUS


def test_single_key_accepts_only_itself():
    keys = ApiKeys(api_key="s3cret-key")
    identity = keys.authenticate("s3cret-key")
    assert identity.key_id == key_id(key_digest("s3cret-key"))
    assert "s3cret" not in identity.key_id and len(identity.key_id) == 16
    with pytest.raises(Unauthenticated):
        keys.authenticate("s3cret-kez")
    with pytest.raises(Unauthenticated, match="no API key"):
        keys.authenticate(None)


def test_bearer_token_parsing():
    assert bearer_token("Bearer abc") == "abc"
    assert bearer_token("bearer  abc ") == "abc"
    assert bearer_token("Basic abc") is None
    assert bearer_token("Bearer") is None
    assert bearer_token(None) is None


def test_keys_file_names_and_comments(tmp_path):
    d1, d2 = key_digest("one"), key_digest("two")
    parsed = parse_keys_file(f"# clients\n{d1} team-a\n\n{d2.upper()}\n", "f")
    assert parsed[d1].name == "team-a"
    assert parsed[d2].key_id == key_id(d2)
    with pytest.raises(ValueError, match="gateway.api_keys_file: f line 2"):
        parse_keys_file(f"{d1}\nplaintext-key\n", "f")


def test_keys_file_missing_at_start_names_the_setting(tmp_path):
    with pytest.raises(ValueError, match="gateway.api_keys_file: cannot read"):
        ApiKeys(keys_file=str(tmp_path / "absent"))


def test_keys_file_reloaded_on_change_and_bad_update_keeps_last_good(tmp_path):
    path = tmp_path / "api-keys"
    write(path, f"{key_digest('alpha')} a\n")
    keys = ApiKeys(keys_file=str(path))
    assert keys.enabled and keys.authenticate("alpha").name == "a"
    with pytest.raises(Unauthenticated):
        keys.authenticate("beta")
    write(path, f"{key_digest('alpha')} a\n{key_digest('beta')} b\n")
    assert keys.authenticate("beta").name == "b"
    write(path, f"{key_digest('beta')} b\n")
    with pytest.raises(Unauthenticated):
        keys.authenticate("alpha")
    write(path, "not-a-digest\n")  # a broken update: the last good keys stay
    assert keys.authenticate("beta").name == "b"
    with pytest.raises(Unauthenticated):
        keys.authenticate("alpha")


def test_empty_keys_file_refuses_everyone(tmp_path):
    path = tmp_path / "api-keys"
    path.write_text("")
    keys = ApiKeys(keys_file=str(path))
    with pytest.raises(Unauthenticated):
        keys.authenticate("anything")


def test_keys_file_follows_a_kubernetes_symlink_swap(tmp_path):
    """kubelet: api-keys -> ..data/api-keys, ..data -> ..TIMESTAMP; an update swaps ..data."""
    def version(name: str, text: str) -> None:
        (tmp_path / name).mkdir()
        (tmp_path / name / "api-keys").write_text(text)
        (tmp_path / "..data_tmp").symlink_to(name)
        os.replace(tmp_path / "..data_tmp", tmp_path / "..data")

    version("..v1", f"{key_digest('old')}\n")
    (tmp_path / "api-keys").symlink_to("..data/api-keys")
    keys = ApiKeys(keys_file=str(tmp_path / "api-keys"))
    keys.authenticate("old")
    version("..v2", f"{key_digest('new')}\n")
    keys.authenticate("new")
    with pytest.raises(Unauthenticated):
        keys.authenticate("old")


def test_api_key_and_file_together(tmp_path):
    path = tmp_path / "api-keys"
    path.write_text(f"{key_digest('filed')} f\n")
    keys = ApiKeys(api_key="flag", keys_file=str(path))
    assert keys.authenticate("flag").name == "api-key"
    assert keys.authenticate("filed").name == "f"


def app_with(access: Access) -> TestClient:
    app = FastAPI()
    app.add_middleware(ApiKeyMiddleware, access=access)
    seen = []

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.post("/v1/echo")
    async def echo(request: __import__("fastapi").Request):
        seen.append(request_identity(request))
        return {"key_id": request_identity(request).key_id}

    client = TestClient(app)
    client.seen = seen
    return client


def test_http_401_before_the_route_with_openai_error_json():
    client = app_with(Access(ApiKeys(api_key="k-1")))
    r = client.post("/v1/echo", json={}, headers={"X-Request-Id": "rid-1"})
    assert r.status_code == 401
    assert r.json()["error"]["type"] == "invalid_request_error"
    assert r.json()["error"]["code"] == "invalid_api_key"
    assert r.headers["www-authenticate"] == "Bearer"
    assert r.headers["x-request-id"] == "rid-1"
    r = client.post("/v1/echo", json={}, headers={"Authorization": "Bearer k-2"})
    assert r.status_code == 401 and "k-2" not in r.text
    assert client.seen == []  # the route never ran
    r = client.post("/v1/echo", json={}, headers={"Authorization": "Bearer k-1"})
    assert r.status_code == 200 and r.json()["key_id"] == key_id(key_digest("k-1"))
    assert client.get("/health").status_code == 200  # probes stay open


def test_http_open_gateway_is_anonymous():
    client = app_with(Access())
    r = client.post("/v1/echo", json={})
    assert r.status_code == 200 and r.json()["key_id"] == ""


def test_api_key_reaches_tandem_up_children_and_is_never_shown(tmp_path):
    from services.config.sources import load_settings, show_lines, write_settings_file

    loaded = load_settings(environ={"TANDEM_API_KEY": "k-abc-123"})
    assert not any("k-abc-123" in line for line in show_lines(loaded))
    write_settings_file(loaded.settings, tmp_path / "s.json")
    again = load_settings(None, tmp_path / "s.json", {})
    assert again.settings.gateway.api_key.get_secret_value() == "k-abc-123"


def test_gateway_options_carry_keys_limits_and_tls(tmp_path):
    from services.runtime.cli import gateway_options
    from services.config.sources import load_settings

    keys = tmp_path / "api-keys"
    keys.write_text(f"{key_digest('filed')} f\n")
    env = {"REDIS_URL": "redis://h:1/0", "TANDEM_API_KEY": "flag", "TANDEM_API_KEYS_FILE": str(keys),
           "TANDEM_RATE_LIMIT_REQUESTS_PER_S": "2", "TANDEM_MAX_STREAMS_PER_KEY": "3",
           "TANDEM_TLS_CERT_FILE": "c.pem", "TANDEM_TLS_KEY_FILE": "k.pem"}
    opts = gateway_options(load_settings(environ=env).settings)
    assert opts.access.keys.authenticate("filed").name == "f"
    assert opts.access.keys.authenticate("flag").name == "api-key"
    assert opts.access.limiter.limits.requests_per_s == 2
    assert opts.access.limiter.limits.max_streams == 3
    assert (opts.tls.cert_file, opts.tls.key_file, opts.tls.client_ca_file) == ("c.pem", "k.pem", None)
    assert opts.internal_tls is None
    open_opts = gateway_options(load_settings(environ={"REDIS_URL": "redis://h:1/0"}).settings)
    assert not open_opts.access.keys.enabled and open_opts.tls is None


@pytest.mark.parametrize("env,setting", [
    ({"TANDEM_TLS_CERT_FILE": "c.pem"}, "gateway.tls_key_file"),
    ({"TANDEM_TLS_CLIENT_CA_FILE": "ca.pem"}, "gateway.tls_client_ca_file"),
    ({"TANDEM_INTERNAL_TLS_CERT_FILE": "c.pem", "TANDEM_INTERNAL_TLS_KEY_FILE": "k.pem"},
     "transport.internal_tls_ca_file"),
    ({"TANDEM_API_KEYS_FILE": "/nonexistent/api-keys"}, "gateway.api_keys_file"),
])
def test_incomplete_exposure_settings_name_the_setting(env, setting):
    from services.runtime.cli import gateway_options
    from services.config.sources import load_settings

    s = load_settings(environ={"REDIS_URL": "redis://h:1/0", **env}).settings
    with pytest.raises(ValueError, match=f"^{setting}:"):
        gateway_options(s)
