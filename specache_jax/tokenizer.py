"""Tokenizer: a `tokenizers.Tokenizer` plus the special ids and the chat template of a model.

Built from an HF `tokenizer.json` (+ `tokenizer_config.json`, `generation_config.json`, `chat_template.jinja`)
or from GGUF metadata (byte-level BPE: tokenizer.ggml.tokens / merges / token_type, the pre-tokenizer named by
tokenizer.ggml.pre, the template in tokenizer.chat_template). BOS is added by `encode` itself (never by the
backend's post-processor), only when the model asks for it and the text does not already start with it.
`chat` renders the checkpoint's own jinja chat template as transformers' `apply_chat_template` does
(`specache_jax.chat_template`); a checkpoint without one needs a template passed explicitly.
"""
from __future__ import annotations

import json
import os
import re
from typing import Any, Mapping, Sequence

from specache_jax import chat_template as chat_lib

# Pre-tokenizer split patterns by GGUF `tokenizer.ggml.pre` (followed by byte-level mapping without regex).
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_SPLITS = {"llama-bpe": _LLAMA3_SPLIT, "llama3": _LLAMA3_SPLIT, "llama-v3": _LLAMA3_SPLIT, "qwen2": _QWEN2_SPLIT}
GGUF_PRE_TOKENIZERS = ("smollm", "gpt2", "default") + tuple(_SPLITS)
_CONTROL, _USER_DEFINED = 3, 4   # llama.cpp token types


def _pre_tokenizer(pre: str):
  from tokenizers import Regex, pre_tokenizers
  if pre == "smollm":   # each digit alone, then GPT-2's byte-level regex
    return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                    pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
  if pre in ("gpt2", "default"):
    return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
  if pre in _SPLITS:
    return pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(_SPLITS[pre]), behavior="isolated"),
                                    pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
  raise ValueError(f"GGUF tokenizer.ggml.pre={pre!r} is not supported; expected one of {GGUF_PRE_TOKENIZERS}")


def _token_text(token: Any) -> str | None:
  """tokenizer_config.json writes special tokens as strings or as {"content": ...} dicts."""
  if isinstance(token, Mapping):
    return token.get("content")
  return token


def _ids(value: Any) -> list[int]:
  if value is None:
    return []
  return [int(v) for v in value] if isinstance(value, (list, tuple)) else [int(value)]


def _template_text(value: Any) -> str | None:
  """tokenizer_config.json's chat_template: one string, or [{"name", "template"}] where "default" is used."""
  if isinstance(value, str):
    return value or None
  if isinstance(value, (list, tuple)):
    named = {t.get("name"): t.get("template") for t in value if isinstance(t, Mapping)}
    return named.get("default")
  return None


class Tokenizer:
  """encode/decode/chat for one model. `backend` is a `tokenizers.Tokenizer`; `chat_template` the model's jinja
  chat template (None: the checkpoint ships none); `special_tokens` the texts of its named special tokens
  (bos_token, eos_token, ...) as the template sees them, by default those of the special ids."""

  def __init__(self, backend, *, bos_token_id: int | None = None, eos_token_ids: Sequence[int] = (),
               pad_token_id: int | None = None, add_bos: bool = False, chat_template: str | None = None,
               special_tokens: Mapping[str, str] | None = None):
    if chat_template is not None and (not isinstance(chat_template, str) or not chat_template):
      raise ValueError(f"chat_template={chat_template!r} must be non-empty jinja text or None")
    self.backend = backend
    self.bos_token_id = bos_token_id
    self.eos_token_ids = tuple(dict.fromkeys(int(e) for e in eos_token_ids))
    self.pad_token_id = pad_token_id
    self.add_bos = bool(add_bos)
    self.chat_template = chat_template
    if special_tokens is None:
      ids = {"bos_token": bos_token_id, "eos_token": self.eos_token_ids[0] if self.eos_token_ids else None,
             "pad_token": pad_token_id}
      special_tokens = {k: backend.id_to_token(int(i)) for k, i in ids.items() if i is not None}
    unknown = sorted(set(special_tokens) - set(chat_lib.SPECIAL_TOKEN_NAMES))
    if unknown:
      raise ValueError(f"special_tokens names {unknown} are not among {chat_lib.SPECIAL_TOKEN_NAMES}")
    self.special_tokens = {k: str(v) for k, v in special_tokens.items() if v is not None}

  # ---- construction ---------------------------------------------------------------------------------------
  @classmethod
  def from_file(cls, path: str, config_path: str | None = None, generation_config_path: str | None = None,
                chat_template: str | None = None) -> "Tokenizer":
    """An HF tokenizer.json, with the special tokens / BOS rule / chat template of tokenizer_config.json.
    `chat_template` given: used instead of the config's."""
    from tokenizers import Tokenizer as Backend
    if not os.path.isfile(path):
      raise FileNotFoundError(f"{path} does not exist; expected an HF tokenizer.json")
    backend = Backend.from_file(path)
    conf: dict = {}
    if config_path and os.path.isfile(config_path):
      with open(config_path, encoding="utf-8") as f:
        conf = json.load(f)
    gen: dict = {}
    if generation_config_path and os.path.isfile(generation_config_path):
      with open(generation_config_path, encoding="utf-8") as f:
        gen = json.load(f)
    specials = {k: _token_text(conf.get(k)) for k in chat_lib.SPECIAL_TOKEN_NAMES}
    specials = {k: v for k, v in specials.items() if v is not None}

    def token_id(key: str) -> int | None:
      return None if key not in specials else backend.token_to_id(specials[key])

    bos = token_id("bos_token")
    if bos is None and gen.get("bos_token_id") is not None:
      bos = int(gen["bos_token_id"])
    eos = _ids(token_id("eos_token")) + _ids(gen.get("eos_token_id"))
    add_bos = conf.get("add_bos_token")
    if add_bos is None:   # no flag: does the backend's post-processor put BOS first?
      with_specials = backend.encode("a", add_special_tokens=True).ids
      add_bos = bos is not None and bool(with_specials) and with_specials[0] == bos
    return cls(backend, bos_token_id=bos, eos_token_ids=eos, pad_token_id=token_id("pad_token"),
               add_bos=add_bos, chat_template=chat_template or _template_text(conf.get("chat_template")),
               special_tokens=specials)

  @classmethod
  def from_hf_dir(cls, path: str, chat_template: str | None = None) -> "Tokenizer | None":
    """The tokenizer of an HF directory, or None when it has no tokenizer.json. The chat template: the
    argument, else chat_template.jinja (as transformers prefers it), else tokenizer_config.json's."""
    file = os.path.join(path, "tokenizer.json")
    if not os.path.isfile(file):
      return None
    jinja_file = os.path.join(path, "chat_template.jinja")
    if chat_template is None and os.path.isfile(jinja_file):
      with open(jinja_file, encoding="utf-8") as f:
        chat_template = f.read() or None
    return cls.from_file(file, os.path.join(path, "tokenizer_config.json"),
                         os.path.join(path, "generation_config.json"), chat_template)

  @classmethod
  def from_gguf_metadata(cls, fields: Mapping[str, Any], chat_template: str | None = None) -> "Tokenizer":
    """Byte-level BPE from GGUF metadata (`tokenizer.ggml.*`, as Python values); the chat template from
    `tokenizer.chat_template` unless `chat_template` is given."""
    from tokenizers import AddedToken, decoders, models
    from tokenizers import Tokenizer as Backend
    kind = fields.get("tokenizer.ggml.model")
    if kind != "gpt2":
      raise ValueError(f"GGUF tokenizer.ggml.model={kind!r} is not supported; expected 'gpt2' (byte-level BPE)")
    tokens = list(fields["tokenizer.ggml.tokens"])
    merges = [tuple(m.split(" ", 1)) for m in fields.get("tokenizer.ggml.merges", ())]
    vocab: dict[str, int] = {}
    for i, tok in enumerate(tokens):
      vocab.setdefault(tok, i)
    backend = Backend(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
    backend.pre_tokenizer = _pre_tokenizer(fields.get("tokenizer.ggml.pre") or "default")
    backend.decoder = decoders.ByteLevel()
    types = list(fields.get("tokenizer.ggml.token_type") or ())
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False)
                                for t, k in zip(tokens, types) if k == _CONTROL])
    backend.add_tokens([AddedToken(t, special=False, normalized=False)
                        for t, k in zip(tokens, types) if k == _USER_DEFINED])
    eos = [fields.get(f"tokenizer.ggml.{k}") for k in ("eos_token_id", "eot_token_id", "eom_token_id")]
    special_ids = {"bos_token": "bos_token_id", "eos_token": "eos_token_id", "unk_token": "unknown_token_id",
                   "sep_token": "seperator_token_id", "pad_token": "padding_token_id",   # llama.cpp's spelling
                   "mask_token": "mask_token_id"}
    specials = {name: tokens[int(fields[f"tokenizer.ggml.{key}"])] for name, key in special_ids.items()
                if fields.get(f"tokenizer.ggml.{key}") is not None
                and 0 <= int(fields[f"tokenizer.ggml.{key}"]) < len(tokens)}
    template = chat_template or fields.get("tokenizer.chat_template")
    return cls(backend, bos_token_id=fields.get("tokenizer.ggml.bos_token_id"),
               eos_token_ids=[int(e) for e in eos if e is not None],
               pad_token_id=fields.get("tokenizer.ggml.padding_token_id"),
               add_bos=bool(fields.get("tokenizer.ggml.add_bos_token", False)),
               chat_template=template if isinstance(template, str) and template else None,
               special_tokens=specials)

  # ---- persistence (the orbax cache stores the tokenizer next to the params) -------------------------------
  def settings(self) -> dict:
    return {"bos_token_id": self.bos_token_id, "eos_token_ids": list(self.eos_token_ids),
            "pad_token_id": self.pad_token_id, "add_bos": self.add_bos, "chat_template": self.chat_template,
            "special_tokens": dict(self.special_tokens)}

  def save(self, directory: str) -> None:
    """Write tokenizer.json + tokenizer_settings.json into `directory`."""
    self.backend.save(os.path.join(directory, "tokenizer.json"))
    with open(os.path.join(directory, "tokenizer_settings.json"), "w", encoding="utf-8") as f:
      json.dump(self.settings(), f)

  @classmethod
  def load(cls, directory: str) -> "Tokenizer | None":
    """What `save` wrote, or None if the directory holds no tokenizer. Settings written before chat templates
    (a `chat_format` name, no template) load without a template."""
    from tokenizers import Tokenizer as Backend
    settings = os.path.join(directory, "tokenizer_settings.json")
    if not os.path.isfile(settings):
      return None
    with open(settings, encoding="utf-8") as f:
      kwargs = json.load(f)
    kwargs.pop("chat_format", None)
    kwargs.pop("default_system", None)
    return cls(Backend.from_file(os.path.join(directory, "tokenizer.json")), **kwargs)

  # ---- use -------------------------------------------------------------------------------------------------
  @property
  def vocab_size(self) -> int:
    return self.backend.get_vocab_size(with_added_tokens=True)

  def token_to_id(self, token: str) -> int | None:
    return self.backend.token_to_id(token)

  def encode(self, text: str, add_bos: bool | None = None) -> list[int]:
    """Token ids of `text` (special tokens written in the text map to their ids). add_bos None: the model's
    rule; BOS is never doubled when the text already starts with it."""
    ids = self.backend.encode(text, add_special_tokens=False).ids
    if (self.add_bos if add_bos is None else add_bos) and self.bos_token_id is not None:
      if not ids or ids[0] != self.bos_token_id:
        ids = [int(self.bos_token_id)] + ids
    return list(ids)

  def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
    return self.backend.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

  def chat(self, messages: Sequence[Mapping[str, str]], add_generation_prompt: bool = True,
           chat_template: str | None = None, **template_kwargs) -> str:
    """The prompt text for `messages` ([{"role", "content"}]): the model's chat template (or `chat_template`)
    rendered as transformers' `apply_chat_template(messages, tokenize=False, add_generation_prompt=...)`.
    `template_kwargs` reach the template as variables. ChatTemplateError (a ValueError) when the template
    refuses the conversation, with the template's own message."""
    template = chat_template or self.chat_template
    if template is None:
      raise ValueError("this tokenizer has no chat template (its checkpoint ships none in tokenizer_config.json, "
                       "chat_template.jinja or the GGUF's tokenizer.chat_template); pass one as "
                       "chat(..., chat_template=<jinja text>) or set tokenizer.chat_template")
    return chat_lib.render(template, messages, add_generation_prompt=add_generation_prompt,
                           special_tokens=self.special_tokens, **template_kwargs)
