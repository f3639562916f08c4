"""``GET /`` points somewhere, ``/openapi.json`` describes what the request models
validate, ``/docs`` reads it with assets served by this server (no CDN), and
``--default-max-tokens`` fills a request that omits ``max_tokens``."""

from __future__ import annotations

import json
import re
import tomllib

import jsonschema
import pytest
from starlette.testclient import TestClient

from frontend.app import create_app
from frontend.context import generation_max_new_tokens
from frontend.serving_root import DOCS_DIR
from shared.config import FrontendConfig
from tests.procs import REPO
from tests.test_openai_api import ScriptedEngine


class RecordingEngine(ScriptedEngine):
    """Streams two tokens and finishes; remembers every submit's sampling parameters."""

    def __init__(self):
        super().__init__([[1000, 1001]], "")
        self.dies = False
        self.params: list = []

    async def submit(self, rid, ids, params, **kw):
        from frontend.engine_client import RequestStream

        self.params.append(params)
        stream = RequestStream(rid)
        stream.queue.put_nowait(self.p.RequestOutput(rid, [1000, 1001], self.p.FinishReason.LENGTH))
        return stream, self


def _client(smol_tokenizer, **config) -> tuple[RecordingEngine, TestClient]:
    engine = RecordingEngine()
    app = create_app(FrontendConfig(**config), smol_tokenizer, "m", client=engine)
    return engine, TestClient(app)


def test_the_root_points_to_the_dashboard_the_docs_and_the_api(smol_tokenizer):
    _, client = _client(smol_tokenizer)
    with client as http:
        body = http.get("/").json()
        assert body["links"]["dashboard"] == "/dashboard" and body["links"]["docs"] == "/docs"
        assert body["links"]["api"] == "/v1" and body["model"] == "m"
        page = http.get("/", headers={"Accept": "text/html,application/xhtml+xml"})
        assert page.headers["content-type"].startswith("text/html")
        for path in ("/dashboard", "/docs", "/v1/models", "/openapi.json"):
            assert f'href="{path}"' in page.text


def test_openapi_is_the_request_models_schema(smol_tokenizer):
    _, client = _client(smol_tokenizer)
    with client as http:
        doc = http.get("/openapi.json").json()
    assert doc["openapi"] == "3.1.0"
    for path in ("/v1/completions", "/v1/chat/completions", "/v1/models", "/tokenize", "/health", "/metrics"):
        assert path in doc["paths"], path
    ref = doc["paths"]["/v1/completions"]["post"]["requestBody"]["content"]["application/json"]["schema"]["$ref"]
    assert ref == "#/components/schemas/CompletionRequest"
    schema = {**doc["components"]["schemas"]["CompletionRequest"], "components": doc["components"]}
    jsonschema.Draft202012Validator.check_schema(schema)
    validator = jsonschema.Draft202012Validator(schema)
    validator.validate({"prompt": "Hello", "max_tokens": 8, "temperature": 0})
    with pytest.raises(jsonschema.ValidationError):
        validator.validate({"prompt": "Hello", "max_tokens": -1})  # the model's ge=0, as the server says 400


def test_docs_page_loads_only_this_server_s_assets_and_their_licences_ship(smol_tokenizer):
    _, client = _client(smol_tokenizer)
    with client as http:
        page = http.get("/docs")
        assert page.status_code == 200 and "/openapi.json" in page.text
        assets = re.findall(r'(?:src|href)="([^"]+)"', page.text)
        assert assets and all(a.startswith("/docs/static/") for a in assets), assets
        for asset in assets:
            assert http.get(asset).status_code == 200, asset
    for name in ("LICENSE", "NOTICE", "swagger-ui-bundle.js.LICENSE.txt"):
        assert (DOCS_DIR / name).stat().st_size > 0
    data = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["frontend"]
    assert "static/docs/*" in data


def test_a_request_without_max_tokens_gets_the_server_s_default(smol_tokenizer):
    chat = {"messages": [{"role": "user", "content": "Hi"}]}
    engine, client = _client(smol_tokenizer)
    with client as http:
        assert http.post("/v1/chat/completions", json=chat).status_code == 200
        assert http.post("/v1/completions", json={"prompt": "Hi"}).status_code == 200
    assert engine.params[0].max_tokens > 1900  # the rest of the 2048-token context, as OpenAI and vLLM
    assert engine.params[1].max_tokens == 16  # OpenAI's completions default
    engine, client = _client(smol_tokenizer, default_max_tokens=100)
    with client as http:
        assert http.post("/v1/chat/completions", json=chat).status_code == 200
        assert http.post("/v1/completions", json={"prompt": "Hi"}).status_code == 200
        assert http.post("/v1/chat/completions", json={**chat, "max_tokens": 7}).status_code == 200
    assert [q.max_tokens for q in engine.params] == [100, 100, 7]  # the request's own wins


def test_the_generation_config_is_the_default_below_the_flag(tmp_path):
    assert generation_max_new_tokens(tmp_path) is None
    (tmp_path / "generation_config.json").write_text(json.dumps({"max_length": 20}))
    assert generation_max_new_tokens(tmp_path) is None  # transformers' max_length default is not a budget
    (tmp_path / "generation_config.json").write_text(json.dumps({"max_new_tokens": 256}))
    assert generation_max_new_tokens(tmp_path) == 256
