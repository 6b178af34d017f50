"""--api-key: 401 with an OpenAI-style error without the key or with a wrong one (before the
body is even parsed), 200 for the real `openai` client that sends it."""

from __future__ import annotations

import httpx
import openai
import pytest

from .conftest import API_KEY

pytestmark = pytest.mark.slow
COMPLETION = {"prompt": "Hello", "max_tokens": 2}
CHAT = {"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 2}
WRONG = [
    None,
    "",
    "Bearer",
    "Bearer wrong",
    f"Bearer {API_KEY[:-1]}",  # a prefix of the key
    f"Bearer {API_KEY}x",
    f"Basic {API_KEY}",
    f"Bearer {API_KEY.upper()}",
]


@pytest.mark.parametrize("auth", WRONG)
@pytest.mark.parametrize(
    "method,path,body",
    [
        ("POST", "/v1/completions", COMPLETION),
        ("POST", "/v1/chat/completions", CHAT),
        ("GET", "/v1/models", None),
    ],
)
def test_missing_or_wrong_key_is_401(secured, auth, method, path, body):
    headers = {} if auth is None else {"Authorization": auth}
    r = httpx.request(method, secured.url + path, json=body, headers=headers, timeout=10)
    assert r.status_code == 401
    err = r.json()["error"]
    assert (err["code"], err["type"]) == ("invalid_api_key", "invalid_request_error")
    assert "Authorization: Bearer" in err["message"]


def test_unauthenticated_junk_gets_401_not_a_parse_error(secured):
    r = httpx.post(secured.url + "/v1/completions", content=b"{not json", timeout=10)
    assert r.status_code == 401


def test_openai_client_with_the_key_is_served(secured):
    client = openai.OpenAI(base_url=secured.url + "/v1", api_key=API_KEY, max_retries=0)
    assert [m.id for m in client.models.list().data] == ["SmolLM2-135M-Instruct.Q4_1"]
    c = client.completions.create(model="SmolLM2-135M-Instruct.Q4_1", **COMPLETION)
    assert c.usage.completion_tokens == 2
    chat = client.chat.completions.create(model="SmolLM2-135M-Instruct.Q4_1", **CHAT)
    assert chat.usage.completion_tokens <= 2 and chat.choices[0].message.role == "assistant"


def test_openai_client_with_a_wrong_key_gets_authentication_error(secured):
    client = openai.OpenAI(base_url=secured.url + "/v1", api_key="sk-wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        client.completions.create(model="SmolLM2-135M-Instruct.Q4_1", **COMPLETION)
