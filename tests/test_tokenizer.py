"""Tokenizer: SmolLM2's from GGUF metadata (round trip, digits, specials, its chat template) against
transformers' own GGUF-derived tokenizer; tokenizer.json + tokenizer_config.json loading; Llama 3 chat;
persistence. Every family's template against transformers: test_chat_templates.py."""
from __future__ import annotations

import json
import os

import pytest

from specache_jax.checkpoints import registry
from specache_jax.checkpoints.gguf import open_reader, read_fields
from specache_jax.tokenizer import Tokenizer
import chat_fixtures as cf

SMOL_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
TEXTS = ["The capital of France is", "In 1984, 12345 people paid $3.50 each.",
         "<|im_start|>user\nHi there!<|im_end|>\n", "  leading spaces\n\n\ttabs and ünïcödé — 日本語 🙂",
         "don't I'll we've", "x=123+4.56e-7", " 1 22 333", "a<|endoftext|>b<repo_name>c", ""]


@pytest.fixture(scope="module")
def gguf_path():
  return registry.registered_path("smollm2-135m")


@pytest.fixture(scope="module")
def fields(gguf_path):
  return read_fields(open_reader(gguf_path))


@pytest.fixture(scope="module")
def tok(fields):
  return Tokenizer.from_gguf_metadata(fields)


@pytest.mark.parametrize("text", TEXTS)
def test_round_trip(tok, text):
  ids = tok.encode(text)
  assert all(isinstance(i, int) for i in ids)
  assert tok.decode(ids, skip_special_tokens=False) == text


def test_digits_are_split_one_per_token(tok):
  digit = {c: tok.token_to_id(c) for c in "0123456789"}
  assert tok.encode("2024") == [digit[c] for c in "2024"]
  assert tok.encode(" 2024") == [tok.token_to_id("Ġ")] + [digit[c] for c in "2024"]
  assert tok.encode("a 31415 b").count(digit["1"]) == 2


def test_special_tokens_and_bos_rule(tok):
  assert tok.encode("<|endoftext|><|im_start|><|im_end|>") == [0, 1, 2]
  assert (tok.bos_token_id, tok.eos_token_ids, tok.pad_token_id, tok.add_bos) == (1, (2,), 2, False)
  assert tok.vocab_size == 49152
  ids = tok.encode("hello")
  assert ids[0] != 1 and tok.encode("hello", add_bos=True) == [1] + ids
  assert tok.encode("<|im_start|>user", add_bos=True).count(1) == 1   # BOS is never doubled
  assert tok.decode(tok.encode("<|im_start|>hi<|im_end|>")) == "hi"


def test_chatml_with_the_templates_default_system_prompt(tok, fields):
  msgs = [{"role": "user", "content": "What is 2+2?"}]
  assert tok.chat_template == fields["tokenizer.chat_template"] == cf.SMOLLM2
  assert tok.special_tokens == {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>",
                                "unk_token": "<|endoftext|>", "pad_token": "<|im_end|>"}
  assert tok.chat(msgs) == (f"<|im_start|>system\n{SMOL_SYSTEM}<|im_end|>\n"
                            "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n")
  with_system = [{"role": "system", "content": "Be brief."}] + msgs
  assert tok.chat(with_system, add_generation_prompt=False) == (
      "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWhat is 2+2?<|im_end|>\n")
  ids = tok.encode(tok.chat(msgs))
  assert ids[0] == 1 and ids.count(2) == 2 and ids[-4:] == tok.encode("<|im_start|>assistant\n")
  with pytest.raises(ValueError, match="role"):
    tok.chat([{"content": "no role"}])


def test_equals_transformers_gguf_tokenizer(tok, gguf_path):
  transformers = pytest.importorskip("transformers")
  ref = transformers.AutoTokenizer.from_pretrained(os.path.dirname(gguf_path),
                                                   gguf_file=os.path.basename(gguf_path))
  for text in TEXTS:
    assert tok.encode(text) == ref(text, add_special_tokens=False)["input_ids"], text
  assert tok.encode("Hi", add_bos=None) == ref("Hi")["input_ids"]   # neither adds BOS by default
  conversations = [[{"role": "user", "content": "Hi!"}],
                   [{"role": "system", "content": "Short answers."}, {"role": "user", "content": "2+2?"},
                    {"role": "assistant", "content": "4"}, {"role": "user", "content": "3+3?"}]]
  for msgs in conversations:
    for gen in (True, False):
      assert tok.chat(msgs, add_generation_prompt=gen) == ref.apply_chat_template(
          msgs, tokenize=False, add_generation_prompt=gen)


def test_tokenizer_json_with_config_files(tok, fields, tmp_path):
  tok.backend.save(str(tmp_path / "tokenizer.json"))
  (tmp_path / "tokenizer_config.json").write_text(json.dumps({
      "add_bos_token": True, "bos_token": "<|im_start|>", "eos_token": {"content": "<|im_end|>"},
      "pad_token": "<|endoftext|>", "chat_template": fields["tokenizer.chat_template"]}))
  (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))
  loaded = Tokenizer.from_hf_dir(str(tmp_path))
  assert (loaded.bos_token_id, loaded.eos_token_ids, loaded.pad_token_id, loaded.add_bos) == (1, (2, 0), 0, True)
  assert loaded.chat_template == fields["tokenizer.chat_template"]
  assert loaded.special_tokens == {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}
  assert loaded.chat([{"role": "user", "content": "Hi"}]).startswith(f"<|im_start|>system\n{SMOL_SYSTEM}<|im_end|>")
  assert loaded.encode("Hi 42") == [1] + tok.encode("Hi 42")
  assert Tokenizer.from_hf_dir(str(tmp_path / "nothing")) is None


def _llama3_style_backend():
  """A tiny byte-level BPE with Llama 3's special tokens and a post-processor that prepends BOS."""
  from tokenizers import AddedToken, Tokenizer as Backend, decoders, models, pre_tokenizers, processors
  from tokenizers.trainers import BpeTrainer
  backend = Backend(models.BPE())
  backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  backend.decoder = decoders.ByteLevel()
  specials = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
  trainer = BpeTrainer(vocab_size=300, special_tokens=[AddedToken(s, special=True) for s in specials],
                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
  backend.train_from_iterator(["hello world, the user asks and the assistant answers"] * 20, trainer)
  bos = backend.token_to_id("<|begin_of_text|>")
  backend.post_processor = processors.TemplateProcessing(single="<|begin_of_text|> $A",
                                                         special_tokens=[("<|begin_of_text|>", bos)])
  return backend


def test_llama3_format_and_bos_detected_from_the_post_processor(tmp_path):
  _llama3_style_backend().save(str(tmp_path / "tokenizer.json"))
  (tmp_path / "tokenizer_config.json").write_text(json.dumps({
      "bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>", "chat_template": cf.LLAMA3}))
  tok = Tokenizer.from_hf_dir(str(tmp_path))
  bos, eot = tok.token_to_id("<|begin_of_text|>"), tok.token_to_id("<|eot_id|>")
  assert tok.add_bos and tok.bos_token_id == bos and tok.eos_token_ids == (eot,) and tok.chat_template == cf.LLAMA3
  text = tok.chat([{"role": "system", "content": "Be kind. "}, {"role": "user", "content": "hello"}])
  assert text == ("<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nBe kind.<|eot_id|>"
                  "<|start_header_id|>user<|end_header_id|>\n\nhello<|eot_id|>"
                  "<|start_header_id|>assistant<|end_header_id|>\n\n")
  ids = tok.encode(text)
  assert ids[0] == bos and ids.count(bos) == 1 and ids.count(eot) == 2
  assert tok.encode("hello world")[0] == bos and tok.encode("hello world", add_bos=False)[0] != bos
  assert tok.chat([{"role": "user", "content": "x"}], chat_template=cf.QWEN2).startswith("<|im_start|>system")


def test_save_and_load_keep_everything(tok, tmp_path):
  tok.save(str(tmp_path))
  back = Tokenizer.load(str(tmp_path))
  assert back.settings() == tok.settings()
  for text in TEXTS:
    assert back.encode(text) == tok.encode(text)
  assert Tokenizer.load(str(tmp_path / "missing")) is None


def test_pre_tokenizers_and_unsupported_metadata(fields):
  def pieces(pre, text):
    t = Tokenizer.from_gguf_metadata({**fields, "tokenizer.ggml.pre": pre})
    return [p for p, _ in t.backend.pre_tokenizer.pre_tokenize_str(text)]
  assert pieces("smollm", "x 12345") == ["x", "Ġ", "1", "2", "3", "4", "5"]
  assert pieces("llama-bpe", "x 12345") == ["x", "Ġ", "123", "45"]
  assert pieces("qwen2", "x 12345") == ["x", "Ġ", "1", "2", "3", "4", "5"]
  assert pieces("gpt2", "x 12345") == ["x", "Ġ12345"]
  with pytest.raises(ValueError, match="tokenizer.ggml.pre='mystery'"):
    Tokenizer.from_gguf_metadata({**fields, "tokenizer.ggml.pre": "mystery"})
  with pytest.raises(ValueError, match="tokenizer.ggml.model='llama'"):
    Tokenizer.from_gguf_metadata({**fields, "tokenizer.ggml.model": "llama"})
  no_chat = Tokenizer.from_gguf_metadata({k: v for k, v in fields.items() if k != "tokenizer.chat_template"})
  assert no_chat.chat_template is None   # no template is guessed from the vocabulary
  with pytest.raises(ValueError, match="no chat template"):
    no_chat.chat([{"role": "user", "content": "hi"}])
  assert no_chat.chat([{"role": "user", "content": "hi"}], chat_template=cf.QWEN2).endswith("<|im_start|>assistant\n")
