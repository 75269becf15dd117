"""Models for the experiments: the real loaders, plus a seeded random tiny model with a character tokenizer.

`load("tiny-random")` builds a 2-layer random LLaMA whose vocabulary is the 128 ASCII codes, so every launcher
can run end to end in seconds (tests, the notebook's smoke variant) without a checkpoint. Its answers are
noise: use it to exercise the pipeline, never to read accuracy off. Every other name or path goes to
`specache_jax.load_model`.
"""
from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from specache_jax import chat_template
from specache_jax.api import generate
from specache_jax.arrays import DTYPES
from specache_jax.checkpoints.registry import Model, load_model
from specache_jax.model.init import init_params
from specache_jax.model_config import ModelConfig

TINY_PREFIX = "tiny-random"
# Named model shapes: the benchmarks' `random:<shape>` models (bench/models.py) and the memory plans.
SHAPES = {
    # SmolLM2-135M(-Instruct): the project's embedded checkpoint.
    "smollm2-135m": dict(architecture="llama", vocab_size=49152, dim=576, n_layers=30, n_heads=9, n_kv_heads=3,
                         head_dim=64, ffn_dim=1536, norm_eps=1e-5, rope_theta=100000.0, max_position=8192,
                         tie_embeddings=True, eos_token_ids=(2,)),
    # Llama-3.2-1B: a mid-size GQA decoder for the GPU sweep.
    "llama3.2-1b": dict(architecture="llama", vocab_size=128256, dim=2048, n_layers=16, n_heads=32, n_kv_heads=8,
                        head_dim=64, ffn_dim=8192, norm_eps=1e-5, rope_theta=500000.0, max_position=131072,
                        tie_embeddings=True, eos_token_ids=(128009,)),
    # Llama-3-8B: the paper's scale (GPU check, memory plans).
    "llama3-8b": dict(architecture="llama", vocab_size=128256, dim=4096, n_layers=32, n_heads=32, n_kv_heads=8,
                      head_dim=128, ffn_dim=14336, norm_eps=1e-5, rope_theta=500000.0, max_position=8192,
                      tie_embeddings=False, eos_token_ids=(128001, 128009)),
    # A few-layer toy with head_dim 16 for the benchmark's own tests (group sizes up to 16).
    "tiny": dict(architecture="llama", vocab_size=97, dim=48, n_layers=2, n_heads=6, n_kv_heads=2, head_dim=16,
                 ffn_dim=64, rope_theta=10000.0, max_position=4096, eos_token_ids=()),
}



# Plain ChatML (no default system turn), written out character by character.
CHATML_TEMPLATE = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + "
                   "'<|im_end|>' + '\\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
                   "{% endif %}")


class CharTokenizer:
  """One id per ASCII character (others become '?'); a ChatML chat template written out as plain text;
  EOS = id 0 (NUL)."""
  vocab_size = 128
  eos_id = 0
  chat_template = CHATML_TEMPLATE

  def encode(self, text: str) -> list[int]:
    return [ord(c) if 0 < ord(c) < 128 else ord("?") for c in text]

  def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
    del skip_special_tokens
    return "".join(chr(int(i)) for i in ids if 0 < int(i) < 128)

  def chat(self, messages: Sequence[dict], add_generation_prompt: bool = True) -> str:
    return chat_template.render(self.chat_template, messages, add_generation_prompt=add_generation_prompt)


def tiny_random(seed: int = 0, dtype=jnp.float32, max_position: int = 4096) -> Model:
  """head_dim 64 so the paper's group sizes (32, 64) and the launchers' default settings apply unchanged."""
  cfg = ModelConfig(architecture="llama", vocab_size=CharTokenizer.vocab_size, dim=64, n_layers=2, n_heads=4,
                    n_kv_heads=2, head_dim=64, ffn_dim=128, rope_theta=10000.0, max_position=max_position,
                    tie_embeddings=True, eos_token_ids=(CharTokenizer.eos_id,), name=TINY_PREFIX)
  return Model(cfg, init_params(cfg, jax.random.key(seed), dtype, scale=0.3), CharTokenizer(), TINY_PREFIX)


def load(name: str, dtype: str = "") -> Model:
  """`tiny-random` or `tiny-random:<seed>`, else whatever `specache_jax.load_model` accepts."""
  if dtype and dtype not in DTYPES:
    raise ValueError(f"dtype={dtype!r} must be '' (the checkpoint's own) or one of {sorted(DTYPES)}")
  if name == TINY_PREFIX or name.startswith(TINY_PREFIX + ":"):
    seed = int(name.split(":", 1)[1]) if ":" in name else 0
    return tiny_random(seed, DTYPES.get(dtype, jnp.float32))
  kwargs = {"dtype": DTYPES[dtype]} if dtype else {}
  return load_model(name, **kwargs)


def chat_ids(tokenizer, user_text: str) -> list[int]:
  """The token ids of a one-turn chat prompt ending with the assistant header (the model answers next)."""
  return list(tokenizer.encode(tokenizer.chat([{"role": "user", "content": user_text}])))


def stop_ids(model) -> tuple[int, ...]:
  return tuple(int(t) for t in model.config.eos_token_ids)


def decode_answer(tokenizer, ids: Sequence[int], num: int, stops: Sequence[int]) -> str:
  """Text of the first `num` generated ids, without the stop token."""
  kept = [int(t) for t in list(ids)[:num] if int(t) not in set(stops)]
  return tokenizer.decode(kept)


def to_host(x) -> np.ndarray:
  """A (possibly sharded, possibly multi-process) array as numpy on every process."""
  if not getattr(x, "is_fully_addressable", True):            # rows live on other hosts' devices
    from jax.experimental import multihost_utils
    return np.asarray(multihost_utils.process_allgather(x, tiled=True))
  return np.asarray(x)


def generate_rows(model, prompts, *, mesh=None, return_stats: bool = False, **kwargs):
  """`sj.generate` over a ragged list of prompts -> (tokens [n, T] numpy, num_tokens [n] numpy, stats | None).

  On a mesh the batch is padded to a multiple of its data axis by repeating the last prompt (a sweep's last
  batch, or one prompt, need not divide it); the padded rows are dropped from the outputs.
  """
  n = len(prompts)
  rows = list(prompts)
  if mesh is not None and n:
    rows += [rows[-1]] * (-n % int(dict(mesh.shape)["data"]))
  result = generate(model, rows, mesh=mesh, return_stats=return_stats, **kwargs)
  out, stats = result if return_stats else (result, None)
  return to_host(out.tokens)[:n], to_host(out.num_tokens)[:n], stats
