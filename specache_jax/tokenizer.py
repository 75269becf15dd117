"""Tokenizer: a `tokenizers.Tokenizer` plus the special ids and the chat format of a model.

Built from an HF `tokenizer.json` (+ `tokenizer_config.json`, `generation_config.json`) or from GGUF metadata
(byte-level BPE: tokenizer.ggml.tokens / merges / token_type, the pre-tokenizer named by tokenizer.ggml.pre).
BOS is added by `encode` itself (never by the backend's post-processor), only when the model asks for it and
the text does not already start with it. Chat formats: ChatML (SmolLM2, Qwen2) and Llama 3.
"""
from __future__ import annotations

import json
import os
import re
from typing import Any, Mapping, Sequence

CHAT_FORMATS = ("chatml", "llama3")

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


def chat_format_of(template: str | None, vocab: Mapping[str, int]) -> str | None:
  """ChatML or Llama 3 from a chat template's markers, else from the special tokens in the vocabulary."""
  for text in (template or "", " ".join(t for t in ("<|im_start|>", "<|start_header_id|>") if t in vocab)):
    if "<|im_start|>" in text:
      return "chatml"
    if "<|start_header_id|>" in text:
      return "llama3"
  return None


def default_system_of(template: str | None) -> str | None:
  """A system prompt the template inserts when the conversation has none (a literal in the template)."""
  match = re.search(r"<\|im_start\|>system(?:\n|\\n)([^'\"{}]*?)<\|im_end\|>", template or "")
  return match.group(1) if match else None


class Tokenizer:
  """encode/decode/chat for one model. `backend` is a `tokenizers.Tokenizer`."""

  def __init__(self, backend, *, bos_token_id: int | None = None, eos_token_ids: Sequence[int] = (),
               pad_token_id: int | None = None, add_bos: bool = False, chat_format: str | None = None,
               default_system: str | None = None):
    if chat_format is not None and chat_format not in CHAT_FORMATS:
      raise ValueError(f"chat_format={chat_format!r} must be one of {CHAT_FORMATS} or None")
    self.backend = backend
    self.bos_token_id = bos_token_id
    self.eos_token_ids = tuple(dict.fromkeys(int(e) for e in eos_token_ids))
    self.pad_token_id = pad_token_id
    self.add_bos = bool(add_bos)
    self.chat_format = chat_format
    self.default_system = default_system

  # ---- construction ---------------------------------------------------------------------------------------
  @classmethod
  def from_file(cls, path: str, config_path: str | None = None, generation_config_path: str | None = None,
                chat_format: str | None = None) -> "Tokenizer":
    """An HF tokenizer.json, with the special tokens / BOS rule / chat template of tokenizer_config.json."""
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

    def token_id(key: str) -> int | None:
      text = _token_text(conf.get(key))
      return None if text is None else backend.token_to_id(text)

    bos = token_id("bos_token")
    if bos is None and gen.get("bos_token_id") is not None:
      bos = int(gen["bos_token_id"])
    eos = _ids(token_id("eos_token")) + _ids(gen.get("eos_token_id"))
    add_bos = conf.get("add_bos_token")
    if add_bos is None:   # no flag: does the backend's post-processor put BOS first?
      with_specials = backend.encode("a", add_special_tokens=True).ids
      add_bos = bos is not None and bool(with_specials) and with_specials[0] == bos
    template = conf.get("chat_template")
    template = template if isinstance(template, str) else None
    return cls(backend, bos_token_id=bos, eos_token_ids=eos, pad_token_id=token_id("pad_token"),
               add_bos=add_bos, chat_format=chat_format or chat_format_of(template, backend.get_vocab()),
               default_system=default_system_of(template))

  @classmethod
  def from_hf_dir(cls, path: str, chat_format: str | None = None) -> "Tokenizer | None":
    """The tokenizer of an HF directory, or None when it has no tokenizer.json."""
    file = os.path.join(path, "tokenizer.json")
    if not os.path.isfile(file):
      return None
    return cls.from_file(file, os.path.join(path, "tokenizer_config.json"),
                         os.path.join(path, "generation_config.json"), chat_format)

  @classmethod
  def from_gguf_metadata(cls, fields: Mapping[str, Any], chat_format: str | None = None) -> "Tokenizer":
    """Byte-level BPE from GGUF metadata (`tokenizer.ggml.*`, as Python values)."""
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
    template = fields.get("tokenizer.chat_template")
    return cls(backend, bos_token_id=fields.get("tokenizer.ggml.bos_token_id"),
               eos_token_ids=[int(e) for e in eos if e is not None],
               pad_token_id=fields.get("tokenizer.ggml.padding_token_id"),
               add_bos=bool(fields.get("tokenizer.ggml.add_bos_token", False)),
               chat_format=chat_format or chat_format_of(template, vocab), default_system=default_system_of(template))

  # ---- persistence (the orbax cache stores the tokenizer next to the params) -------------------------------
  def settings(self) -> dict:
    return {"bos_token_id": self.bos_token_id, "eos_token_ids": list(self.eos_token_ids),
            "pad_token_id": self.pad_token_id, "add_bos": self.add_bos, "chat_format": self.chat_format,
            "default_system": self.default_system}

  def save(self, directory: str) -> None:
    """Write tokenizer.json + tokenizer_settings.json into `directory`."""
    self.backend.save(os.path.join(directory, "tokenizer.json"))
    with open(os.path.join(directory, "tokenizer_settings.json"), "w", encoding="utf-8") as f:
      json.dump(self.settings(), f)

  @classmethod
  def load(cls, directory: str) -> "Tokenizer | None":
    """What `save` wrote, or None if the directory holds no tokenizer."""
    from tokenizers import Tokenizer as Backend
    settings = os.path.join(directory, "tokenizer_settings.json")
    if not os.path.isfile(settings):
      return None
    with open(settings, encoding="utf-8") as f:
      kwargs = json.load(f)
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
           chat_format: str | None = None) -> str:
    """The prompt text for `messages` ([{"role", "content"}]) in ChatML or Llama 3 format."""
    fmt = chat_format or self.chat_format
    if fmt not in CHAT_FORMATS:
      raise ValueError(f"chat_format={fmt!r}: this tokenizer has no known chat format; pass one of {CHAT_FORMATS}")
    for m in messages:
      if not isinstance(m, Mapping) or "role" not in m or "content" not in m:
        raise ValueError(f"each message must be a dict with 'role' and 'content'; got {m!r}")
    if fmt == "chatml":
      parts = []
      if self.default_system is not None and (not messages or messages[0]["role"] != "system"):
        parts.append(f"<|im_start|>system\n{self.default_system}<|im_end|>\n")
      parts += [f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages]
      if add_generation_prompt:
        parts.append("<|im_start|>assistant\n")
      return "".join(parts)
    parts = ["<|begin_of_text|>"]
    parts += [f"<|start_header_id|>{m['role']}<|end_header_id|>\n\n{m['content'].strip()}<|eot_id|>"
              for m in messages]
    if add_generation_prompt:
      parts.append("<|start_header_id|>assistant<|end_header_id|>\n\n")
    return "".join(parts)
