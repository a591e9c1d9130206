"""Chat templates: render a list of messages into one prompt string, as Hugging Face does.

A chat template is a Jinja template (the `chat_template` of a tokenizer_config.json). It is
rendered in a sandboxed environment with `messages`, `add_generation_prompt`, `bos_token`,
`eos_token` and a `raise_exception` helper, with trim_blocks/lstrip_blocks on, which is how
transformers renders them, so a model's own template gives the prompt it was trained on.

Which template: $TINYLOOP_CHAT_TEMPLATE (a tokenizer_config.json or a Jinja file) if set,
else the model's own (a Hugging Face checkpoint's, kept by `tinyloop convert` in the artifact; or a
tokenizer_config.json beside a model loaded from a directory), else DEFAULT_CHAT_TEMPLATE. The
rendered prompt already holds the special tokens the template writes (a BOS, say), so `chat_ids`
encodes it without adding the tokenizer's own, as transformers' apply_chat_template(tokenize=True). The bundled model was trained on Python source, not on dialogues, so
its template is deliberately plain (docs/gateway.md shows what it renders).
"""
from __future__ import annotations

import json
import os
from functools import lru_cache
from pathlib import Path

from .errors import ConfigError
from .fields import template_variables

# One line per message "role: content", then "assistant:" to start the answer.
DEFAULT_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ message['role'] }}: {{ message['content'] }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)

ROLES = ("system", "user", "assistant", "tool", "developer")


def load_chat_template(path: str | Path) -> str:
    """The template in a tokenizer_config.json (its `chat_template`, the "default" one if it holds
    several) or in a plain Jinja file."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise ConfigError(f"chat template {path}: {exc}") from None
    if path.suffix != ".json":
        return text
    try:
        template = json.loads(text).get("chat_template")
    except (ValueError, AttributeError):
        raise ConfigError(f"chat template {path}: not a JSON object") from None
    if isinstance(template, list):  # [{"name": "default", "template": ...}, {"name": "tool_use", ...}]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    if not isinstance(template, str):
        raise ConfigError(f"chat template {path}: no chat_template string in it")
    return template


def template_for(model) -> str:
    """The template this model's chats are rendered with (see the module docstring)."""
    env = os.environ.get("TINYLOOP_CHAT_TEMPLATE")
    if env:
        return load_chat_template(env)
    own = getattr(getattr(model, "codec", None), "chat_template", None)
    if own:
        return own
    source = Path(getattr(getattr(model, "info", None), "path", "") or "")
    config = source / "tokenizer_config.json" if source.is_dir() else None
    if config is not None and config.exists():
        try:
            return load_chat_template(config)
        except ConfigError:
            pass  # a tokenizer config without a template: use the default
    return DEFAULT_CHAT_TEMPLATE


@lru_cache(maxsize=16)
def _compile(template: str):
    from jinja2 import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise ConfigError(f"chat template: {message}")

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = raise_exception
    # Templates call tojson without HTML escaping (transformers does the same).
    env.filters["tojson"] = lambda value, indent=None: json.dumps(value, indent=indent, ensure_ascii=False)
    try:
        return env.from_string(template)
    except TemplateError as exc:
        raise ConfigError(f"chat template does not compile: {exc}") from None


def check_messages(messages) -> list[dict]:
    """Messages must be a non-empty list of {"role": one of ROLES, "content": str}."""
    if not isinstance(messages, list) or not messages:
        raise ConfigError("messages must be a non-empty list of {role, content} maps")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise ConfigError(f"messages[{i}] must be a map with string 'role' and 'content'")
        if m["role"] not in ROLES:
            raise ConfigError(f"messages[{i}].role must be one of {list(ROLES)}, got {m['role']!r}")
    return messages


def render_chat(template: str, messages: list[dict], *, add_generation_prompt: bool = True,
                bos_token: str = "", eos_token: str = "", **extra) -> str:
    """Render messages with a Jinja chat template (ConfigError if the template fails). `extra` are further
    template variables (enable_thinking=True for the Ouro thinking models' template, say)."""
    from jinja2 import TemplateError

    check_messages(messages)
    try:
        return _compile(template).render(messages=messages, add_generation_prompt=add_generation_prompt,
                                         bos_token=bos_token, eos_token=eos_token, **extra)
    except TemplateError as exc:
        raise ConfigError(f"chat template failed: {exc}") from None


def apply_chat_template(model, messages: list[dict], add_generation_prompt: bool = True, **extra) -> str:
    """The prompt string for `messages` with this model's template and its special tokens; `extra` are the template's
    own variables (chat_template_kwargs)."""
    error = template_variables(len(extra))(extra)
    if error:
        raise ConfigError(f"chat_template_kwargs {error}")
    codec = model.codec
    return render_chat(template_for(model), messages, add_generation_prompt=add_generation_prompt,
                       bos_token=codec.bos_token, eos_token=codec.eos_token, **extra)


def chat_prompt(model, messages: list[dict], add_generation_prompt: bool = True, **extra) -> tuple[str, list[int]]:
    """The rendered chat prompt and its token ids (special tokens as the template wrote them, none added: a
    template that writes a BOS gets exactly one)."""
    text = apply_chat_template(model, messages, add_generation_prompt, **extra)
    return text, model.codec.encode(text, special=False)


def chat_ids(model, messages: list[dict], add_generation_prompt: bool = True, **extra) -> list[int]:
    """Token ids of the rendered chat prompt (chat_prompt's)."""
    return chat_prompt(model, messages, add_generation_prompt, **extra)[1]
