"""A checkpoint's own chat template, rendered the way HF transformers' `apply_chat_template` renders it.

The environment is transformers' (`utils/chat_template_utils.py`): a jinja2 `ImmutableSandboxedEnvironment`
with `trim_blocks` and `lstrip_blocks`, the loop-controls extension (`{% break %}`, `{% continue %}`), a
`{% generation %}` block that renders its body, the globals `raise_exception`, `strftime_now`, `dict` and a
`namespace` that refuses underscore names, and a `tojson` filter that does not escape HTML (`json.dumps`,
`ensure_ascii=False`). A template sees `messages`, `add_generation_prompt`, `tools=None`, `documents=None` and
the tokenizer's named special tokens (`bos_token`, `eos_token`, `unk_token`, `pad_token`, ...) as text.
"""
from __future__ import annotations

import functools
import json
from datetime import datetime
from typing import Any, Mapping, Sequence

import jinja2
import jinja2.ext
from jinja2 import nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

# The named special tokens transformers passes to a template (its SPECIAL_TOKENS_ATTRIBUTES).
SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


class ChatTemplateError(ValueError):
  """A chat template that does not parse, or that refuses a conversation (its `raise_exception` message)."""


class _Refusal(jinja2.exceptions.TemplateError):
  """What a template's `raise_exception(message)` raises (a TemplateError, as in transformers)."""


def _raise_exception(message):
  raise _Refusal(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
  return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format):   # noqa: A002 (the name templates call it with)
  return datetime.now().strftime(format)


class _TemplateDict:
  """`dict(...)` and `dict.fromkeys(...)` in a template, with no attribute to reach the type through."""

  def __call__(self, *args, **kwargs):
    return dict(*args, **kwargs)

  def fromkeys(self, *args, **kwargs):
    return dict.fromkeys(*args, **kwargs)


@functools.lru_cache(maxsize=None)
def _environment() -> ImmutableSandboxedEnvironment:
  class Generation(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` (transformers marks assistant text with it): the body as is."""
    tags = {"generation"}

    def parse(self, parser):
      lineno = next(parser.stream).lineno
      body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
      return nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller):
      return caller()

  class Namespace(jinja2.utils.Namespace):
    """jinja's `namespace(...)`, refusing underscore-prefixed attributes (no way to CPython internals)."""

    def __init__(*args, **kwargs):   # jinja's own signature trick, so `namespace(self=...)` still works
      self, args = args[0], args[1:]
      attrs = dict(*args, **kwargs)
      for name in attrs:
        Namespace._check_name(name)
      jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name, value):
      Namespace._check_name(name)
      jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name):
      if isinstance(name, str) and name.startswith("_"):
        raise jinja2.exceptions.SecurityError(f"a chat template cannot set {name!r} (underscore-prefixed) on a "
                                              "namespace")

  env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                      extensions=[Generation, jinja2.ext.loopcontrols])
  env.filters["tojson"] = _tojson
  env.globals["raise_exception"] = _raise_exception
  env.globals["strftime_now"] = _strftime_now
  env.globals["dict"] = _TemplateDict()
  env.globals["namespace"] = Namespace
  return env


@functools.lru_cache(maxsize=32)
def compile_template(source: str):
  """The jinja2 Template of `source` (cached); ChatTemplateError when it does not parse."""
  if not isinstance(source, str) or not source:
    raise ChatTemplateError(f"a chat template must be non-empty jinja text; got {source!r}")
  try:
    return _environment().from_string(source)
  except jinja2.exceptions.TemplateSyntaxError as err:
    raise ChatTemplateError(f"the chat template does not parse: {err} (line {err.lineno})") from err


def render(source: str, messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool = True,
           special_tokens: Mapping[str, str] | None = None, **template_kwargs) -> str:
  """`messages` ([{"role", "content", ...}]) as the template writes them. `special_tokens` maps the names in
  SPECIAL_TOKEN_NAMES to their text; `template_kwargs` (e.g. `date_string`, `enable_thinking`) override them.
  Keys whose value is None are dropped from each message, as transformers does."""
  if not messages:
    raise ValueError("a chat needs at least one message; got none")
  chat = []
  for m in messages:
    if not isinstance(m, Mapping) or "role" not in m or "content" not in m:
      raise ValueError(f"each message must be a dict with 'role' and 'content'; got {m!r}")
    chat.append({k: v for k, v in m.items() if v is not None})
  template = compile_template(source)
  context = {k: v for k, v in (special_tokens or {}).items() if v is not None}
  context.update(template_kwargs)
  context.update(messages=chat, add_generation_prompt=bool(add_generation_prompt))
  context.setdefault("tools", None)
  context.setdefault("documents", None)
  try:
    return template.render(**context)
  except jinja2.exceptions.TemplateError as err:
    roles = [m["role"] for m in chat]
    if isinstance(err, _Refusal):
      raise ChatTemplateError(f"the chat template refused the conversation (roles {roles}): {err}") from err
    raise ChatTemplateError(f"the chat template failed on the conversation (roles {roles}): "
                            f"{type(err).__name__}: {err}") from err
