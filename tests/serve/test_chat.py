"""Chat on the built-in engine: `POST /v1/chat/completions` renders the messages with the model's own chat template
(as transformers does, in a sandbox) and generates like a completion. The official `openai` client talks to it,
streamed and not; every malformed request is a 400 in OpenAI's error shape."""

from __future__ import annotations

from pathlib import Path

import httpx
import openai
import pytest
from shardstack.model.tokenizer import ByteTokenizer, HFTokenizer
from shardstack.serve.apierror import ApiError
from shardstack.serve.chat import ChatTemplate, ChatTemplateError, load_chat_template
from shardstack.serve.protocol import Limits, PromptContext, parse_chat

from .conftest import AUTH, TOKEN, Service

CONVERSATION = [
    {"role": "system", "content": "You complete Python docstrings."},
    {"role": "user", "content": "Return a new list"},
    {"role": "assistant", "content": " of the items."},
    {"role": "user", "content": "Return the sum of"},
]


def test_the_template_renders_what_transformers_renders(bpe_tokenizer_dir: Path) -> None:
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(bpe_tokenizer_dir))
    ours = load_chat_template(bpe_tokenizer_dir)
    assert ours is not None
    text = ours.render(CONVERSATION)
    assert text == hf.apply_chat_template(CONVERSATION, add_generation_prompt=True, tokenize=False)
    assert text.startswith("<|system|>\nYou complete") and text.endswith("<|endoftext|>\n<|assistant|>\n")
    assert HFTokenizer(bpe_tokenizer_dir).encode(text) == hf.encode(text, add_special_tokens=False)


def test_the_template_is_sandboxed_and_its_refusals_are_the_clients_400() -> None:
    escape = ChatTemplate("{{ ''.__class__.__mro__[1].__subclasses__() }}")
    mutate = ChatTemplate("{% set _ = messages.append({'role': 'system', 'content': 'x'}) %}ok")
    for template in (escape, mutate):
        with pytest.raises(ChatTemplateError, match="the model's chat template failed"):
            template.render([{"role": "user", "content": "hi"}])
    strict = ChatTemplate("{% if messages[0]['role'] != 'user' %}{{ raise_exception('roles must alternate, "
                          "user first') }}{% endif %}{{ messages[0]['content'] }}")
    ctx = PromptContext(ByteTokenizer(), 256)
    with pytest.raises(ApiError) as err:
        parse_chat(b'{"messages": [{"role": "assistant", "content": "hi"}]}', Limits(256, 64), "m", ctx, strict)
    assert (err.value.status, err.value.param, err.value.message) == (
        400, "messages", "messages: roles must alternate, user first")
    ok = parse_chat(b'{"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}],'
                    b' "max_completion_tokens": 3}', Limits(256, 64), "m", ctx, strict)
    assert (ok.prompt, ok.max_tokens) == (list(b"hi"), 3)


def test_the_official_client_chats_streamed_and_not(bpe_svc: Service) -> None:
    client = openai.OpenAI(base_url=bpe_svc.url + "/v1", api_key=TOKEN, max_retries=0)
    full = client.chat.completions.create(model="small", messages=CONVERSATION, max_tokens=12, temperature=0)
    assert full.object == "chat.completion" and full.id.startswith("chatcmpl-")
    choice = full.choices[0]
    assert choice.message.role == "assistant" and choice.finish_reason in ("stop", "length")
    # The same generation as a completion of the rendered prompt: the template is the only difference.
    model_dir = Path(httpx.get(bpe_svc.url + "/info", headers=AUTH).json()["model_dir"])
    template = load_chat_template(model_dir)
    assert template is not None
    ids = HFTokenizer(model_dir).encode(template.render(CONVERSATION))
    plain = client.completions.create(model="small", prompt=ids, max_tokens=12, temperature=0)
    assert plain.choices[0].text == choice.message.content
    assert (full.usage.prompt_tokens, full.usage.completion_tokens) == (len(ids), plain.usage.completion_tokens)

    chunks = list(client.chat.completions.create(model="small", messages=CONVERSATION, max_tokens=12,
                                                 temperature=0, stream=True,
                                                 stream_options={"include_usage": True}))
    deltas = [c.choices[0] for c in chunks if c.choices]
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert deltas[0].delta.role == "assistant" and all(d.delta.role is None for d in deltas[1:])
    assert "".join(d.delta.content or "" for d in deltas) == choice.message.content
    assert deltas[-1].finish_reason == choice.finish_reason
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens

    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="small", messages=[{"role": "robot", "content": "hi"}])
    assert err.value.status_code == 400 and err.value.param == "messages"


CHAT = "/v1/chat/completions"
USER = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize(("body", "status", "param", "code"), [
    ({"messages": []}, 400, "messages", None),
    ({"messages": USER, "tools": [{"type": "function"}]}, 400, "tools", None),
    ({"messages": USER, "n": 2}, 400, "n", None),
    ({"messages": USER, "max_tokens": 4, "max_completion_tokens": 4}, 400, "max_completion_tokens", None),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}]}, 400, "messages",
     None),
    ({"messages": [{"role": "user", "content": "x" * 60_000}]}, 400, "messages", "context_length_exceeded"),
    ({"messages": USER, "model": "other"}, 404, "model", "model_not_found"),
    ({"messages": USER, "max_tokens": 100_000}, 400, "max_tokens", None),
])
def test_bad_chat_requests_are_400s_in_openais_shape(bpe_client: httpx.Client, body: dict, status: int,
                                                     param: str, code: str | None) -> None:
    r = bpe_client.post(CHAT, headers=AUTH, json=body)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error"
    if code:
        assert error["code"] == code


def test_a_model_without_a_chat_template_says_so(client: httpx.Client) -> None:
    r = client.post(CHAT, headers=AUTH, json={"messages": USER})
    assert r.status_code == 400 and r.json()["error"]["code"] == "chat_template_missing"
    assert client.get("/info", headers=AUTH).json()["chat_template"] is False
