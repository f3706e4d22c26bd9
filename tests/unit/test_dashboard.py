"""The dashboard's files as the gateway serves them (no browser: tests/browser drives the page)."""

from __future__ import annotations

import re
from collections.abc import Iterator
from importlib import resources
from pathlib import Path

import pytest
from starlette.testclient import TestClient

from meshnet.backends.fake import FakeEngine
from meshnet.gateway import create_app
from meshnet.gateway.auth import COOKIE, load_keys
from meshnet.gateway.dashboard import ASSETS

pytestmark = pytest.mark.timeout(20)


@pytest.fixture
def client() -> Iterator[TestClient]:
    with TestClient(create_app(FakeEngine(reply="hi", n_ctx=256))) as c:
        yield c


@pytest.mark.parametrize("path", ["/", "/dashboard"])
def test_the_page_is_served_at_the_root_and_at_dashboard(client: TestClient, path: str) -> None:
    response = client.get(path)
    assert response.status_code == 200
    assert response.headers["content-type"] == "text/html; charset=utf-8"
    assert "<title>Meshnet dashboard</title>" in response.text
    for name in ASSETS:
        assert f"/dashboard/assets/{name}" in response.text
    csp = response.headers["content-security-policy"]
    assert "default-src 'none'" in csp
    assert "script-src 'self'" in csp
    assert response.headers["x-content-type-options"] == "nosniff"


@pytest.mark.parametrize(
    ("name", "content_type"),
    [
        ("app.js", "text/javascript; charset=utf-8"),
        ("style.css", "text/css; charset=utf-8"),
        ("favicon.svg", "image/svg+xml"),
    ],
)
def test_assets_are_served_with_their_content_types(client: TestClient, name: str, content_type: str) -> None:
    response = client.get(f"/dashboard/assets/{name}")
    assert response.status_code == 200
    assert response.headers["content-type"] == content_type
    assert response.content == resources.files("meshnet.gateway.dashboard").joinpath(name).read_bytes()
    assert client.head(f"/dashboard/assets/{name}").status_code == 200


@pytest.mark.parametrize(
    "path",
    [
        "/dashboard/assets/missing.js",
        "/dashboard/assets/__init__.py",  # a file of the package, but not an asset
        "/dashboard/assets/index.html",
        "/dashboard/assets/..%2F__init__.py",
        "/dashboard/assets/sub/app.js",
    ],
)
def test_an_unknown_asset_is_a_json_404(client: TestClient, path: str) -> None:
    response = client.get(path)
    assert response.status_code == 404
    assert response.json()["error"]["type"] == "not_found_error"


def test_the_page_is_read_only(client: TestClient) -> None:
    assert client.post("/", json={}).status_code == 405
    assert client.post("/dashboard/assets/app.js").status_code == 405


def test_the_api_is_unchanged_beside_the_page(client: TestClient) -> None:
    assert client.get("/v1/models").json()["data"][0]["id"] == "fake-model"
    assert client.get("/v1/nope").status_code == 404


def test_the_files_load_nothing_from_elsewhere_and_insert_no_markup() -> None:
    files = resources.files("meshnet.gateway.dashboard")
    for name in ["index.html", *ASSETS]:
        text = files.joinpath(name).read_text(encoding="utf-8")
        # the only absolute URL allowed is the SVG namespace, which is a name, not a fetch
        urls = set(re.findall(r"(?:https?:)?//[\w.-]+\.[a-z]{2,}[^\s\"')]*", text)) - {"http://www.w3.org/2000/svg"}
        assert not urls, f"{name} names external URLs: {urls}"
        assert "@import" not in text
    script = files.joinpath("app.js").read_text(encoding="utf-8")
    for sink in ("innerHTML", "outerHTML", "insertAdjacentHTML", "document.write", "eval(", "new Function"):
        assert sink not in script, f"app.js uses {sink}: text from nodes must only reach the page as text"


def test_the_page_asks_for_an_api_key_in_a_password_field_and_keeps_it_in_the_gateways_cookie() -> None:
    files = resources.files("meshnet.gateway.dashboard")
    page = files.joinpath("index.html").read_text(encoding="utf-8")
    assert re.search(r'<input id="key-input" type="password"', page)
    assert 'id="key-use"' in page and 'id="key-forget"' in page
    script = files.joinpath("app.js").read_text(encoding="utf-8")
    # The gateway sets the cookie (HttpOnly, gateway.auth); the page never writes or reads it (issue 28).
    assert 'const KEY_PATH = "/dashboard/key";' in script and "document.cookie" not in script
    assert COOKIE in script  # named in its comments: what the gateway keeps


def test_with_api_keys_the_page_loads_without_one_and_its_key_cookie_opens_the_api(tmp_path: Path) -> None:
    key = "sk-dashboard-unit-0123456789"
    (tmp_path / "keys").write_text(f"# one key\n{key}\n", encoding="utf-8")
    app = create_app(FakeEngine(reply="hi", n_ctx=256), api_keys=load_keys(tmp_path / "keys"))
    with TestClient(app) as client:
        for path in ["/", "/dashboard", *(f"/dashboard/assets/{name}" for name in ASSETS)]:
            assert client.get(path).status_code == 200, path
        refused = client.get("/v1/models")
        assert refused.status_code == 401 and refused.json()["error"]["code"] == "invalid_api_key"
        assert refused.headers["www-authenticate"] == "Bearer"
        # what the page sends: the cookie it sets (the only key an EventSource carries), or the bearer token
        client.cookies.set(COOKIE, key)
        assert client.get("/v1/models").json()["data"][0]["id"] == "fake-model"
        client.cookies.clear()
        assert client.get("/v1/models", headers={"Authorization": f"Bearer {key}"}).status_code == 200
