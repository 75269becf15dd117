"""Parity with HF transformers (torch float32, eager attention): logits of every tiny fixture (≤ 1e-4), greedy
generation (16 tokens, identical), and SmolLM2 from the embedded GGUF against transformers' own GGUF
conversion (≤ 1e-3)."""
from __future__ import annotations

import os

import numpy as np
import pytest

import hf_fixtures as fx
import specache_jax as sj
from specache_jax.checkpoints import registry

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

LENGTHS = (23, 9)   # a ragged, right-padded batch


@pytest.fixture(scope="module")
def fixtures(tmp_path_factory):
  """kind -> (specache Model, torch model)."""
  root = tmp_path_factory.mktemp("parity")
  out = {}
  for kind in fx.FIXTURES:
    hf = fx.build_model(kind, seed=3)
    hf.save_pretrained(str(root / kind))
    out[kind] = (registry.load_model(str(root / kind), use_cache=False), hf)
  return out


def _prompts(seed: int, vocab: int):
  rs = np.random.RandomState(seed)
  return [rs.randint(3, vocab, size=n).tolist() for n in LENGTHS]


def _torch_logits(hf, ids):
  with torch.no_grad():
    return hf(torch.tensor([ids], dtype=torch.long)).logits[0].numpy()


@pytest.mark.parametrize("kind", fx.FIXTURES)
def test_logits_match_transformers(fixtures, kind):
  model, hf = fixtures[kind]
  prompts = _prompts(0, model.config.vocab_size)
  logits = np.asarray(sj.forward(model, prompts))   # right-padded [B, T, V]
  assert logits.shape == (len(LENGTHS), max(LENGTHS), model.config.vocab_size)
  for row, ids in enumerate(prompts):
    ref = _torch_logits(hf, ids)
    assert np.abs(ref).max() > 1.0   # the fixture's logits are not flat
    np.testing.assert_allclose(logits[row, :len(ids)], ref, rtol=0, atol=1e-4)


@pytest.mark.parametrize("kind", fx.FIXTURES)
def test_greedy_generation_matches_transformers(fixtures, kind):
  model, hf = fixtures[kind]
  prompts = _prompts(1, model.config.vocab_size)
  out = sj.generate(model, prompts, max_new_tokens=16, temperature=0.0, stop_tokens=())
  ours = np.asarray(out.tokens)
  for row, ids in enumerate(prompts):
    with torch.no_grad():
      ref = hf.generate(torch.tensor([ids], dtype=torch.long), max_new_tokens=16, min_new_tokens=16,
                        do_sample=False, eos_token_id=None, pad_token_id=0)
    assert ours[row].tolist() == ref[0, len(ids):].tolist(), row


def _transformers_gguf_model(path: str):
  """transformers' own GGUF conversion (config, dequantization, Q/K reverse permutation) into a float32 eager
  LlamaForCausalLM. Built with `load_gguf_checkpoint` + `load_state_dict` because `from_pretrained(gguf_file=)`
  additionally requires `accelerate`, which this project does not install."""
  from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint
  config = transformers.AutoConfig.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))
  hf = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager", dtype=torch.float32)
  tensors = load_gguf_checkpoint(path, return_tensors=True, model_to_load=hf)["tensors"]
  missing, unexpected = hf.load_state_dict(tensors, strict=False)
  assert not unexpected and set(missing) <= {"lm_head.weight"}
  assert hf.lm_head.weight.data_ptr() == hf.model.embed_tokens.weight.data_ptr()   # tied
  return hf.eval()


PASSAGE = ("It was a bright cold day in April, and the clocks were striking thirteen. Winston Smith, his chin "
           "nuzzled into his breast in an effort to escape the vile wind, slipped quickly through the glass doors "
           "of Victory Mansions, though not quickly enough to prevent a swirl of gritty dust from entering along "
           "with him.")


@pytest.mark.slow
def test_smollm2_gguf_matches_transformers_gguf_loader(tmp_path):
  model = registry.load_model("smollm2-135m", cache_dir=str(tmp_path))
  ids = model.tokenizer.encode(PASSAGE)[:64]
  assert len(ids) == 64
  hf = _transformers_gguf_model(model.source)
  ref = _torch_logits(hf, ids)
  ours = np.asarray(sj.forward(model, [ids]))[0]
  np.testing.assert_allclose(ours, ref, rtol=0, atol=1e-3)
  prompt = model.tokenizer.encode("The capital of France is")
  out = sj.generate(model, [prompt], max_new_tokens=4, temperature=0.0)
  assert model.tokenizer.decode(np.asarray(out.tokens)[0].tolist()).startswith(" Paris")
