"""Chat prompts: the model's own chat template (tokenizer_config.json's `chat_template`, the Jinja that
transformers' `apply_chat_template` renders) turns a list of messages into the text the model continues.

The template comes from the model directory, so it is rendered in jinja2's ImmutableSandboxedEnvironment (no access
to Python internals, no mutation of what it is given), with the names the Hugging Face convention defines:
`messages`, `add_generation_prompt`, `bos_token`, `eos_token` and `raise_exception`. A template that refuses the
messages (`raise_exception('Conversation roles must alternate …')`) is the client's 400, with its message.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, NoReturn

from jinja2 import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from shardstack.errors import ShardstackError
from shardstack.model.tokenizer import TOKENIZER_CONFIG


class ChatTemplateError(Exception):
    """The template refused the messages (raise_exception) or failed while rendering them."""


def _raise(message: str) -> NoReturn:
    raise ChatTemplateError(message)


def _special(value: Any) -> str:
    if isinstance(value, dict):  # transformers' AddedToken serialisation
        value = value.get("content")
    return value if isinstance(value, str) else ""


class ChatTemplate:
    def __init__(self, source: str, *, bos_token: str = "", eos_token: str = "") -> None:
        # trim_blocks/lstrip_blocks as transformers compiles chat templates, so the text is the same.
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = _raise
        self.template = env.from_string(source)
        self.bos_token, self.eos_token = bos_token, eos_token

    def render(self, messages: list[dict[str, str]]) -> str:
        """The prompt for the assistant's next turn."""
        try:
            return self.template.render(messages=messages, add_generation_prompt=True, bos_token=self.bos_token,
                                        eos_token=self.eos_token)
        except ChatTemplateError:
            raise
        except (TemplateError, TypeError, ValueError, KeyError, IndexError, AttributeError) as exc:
            raise ChatTemplateError(f"the model's chat template failed on these messages ({exc})") from None


def load_chat_template(model_dir: Path) -> ChatTemplate | None:
    """The model directory's chat template (a string, or transformers' list of named templates: "default"), None
    when it has none. A template that does not compile is an error of the export."""
    path = model_dir / TOKENIZER_CONFIG
    if not path.is_file():
        return None
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ShardstackError(f"{path} is unreadable: {exc}") from None
    source = config.get("chat_template")
    if isinstance(source, list):
        source = next((t.get("template") for t in source if isinstance(t, dict) and t.get("name") == "default"),
                      None)
    if source is None:
        return None
    if not isinstance(source, str):
        raise ShardstackError(f"{path}: chat_template must be a string or a list of named templates")
    try:
        return ChatTemplate(source, bos_token=_special(config.get("bos_token")),
                            eos_token=_special(config.get("eos_token")))
    except TemplateError as exc:
        raise ShardstackError(f"{path}: the chat template does not compile ({exc})") from None
