"""One table of bad inputs (issues 2, 3, 4 and 7): each fails with the right error type and a message naming the
value and the rule — and, for `sj.generate`, before anything is compiled."""
import dataclasses
import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import specache_jax as sj
from specache_jax import decode, sharding
from specache_jax.errors import ConfigError
from specache_jax.model_config import ModelConfig, from_hf_config
from specache_jax.offload import MemoryPlanError
from tests.tiny import TinyModel, tiny_config, tiny_model

PROMPT = [[5, 6, 7, 8, 9]]


@functools.lru_cache(maxsize=None)
def _model():
  return tiny_model(seed=2, head_dim=16, n_heads=4, n_kv_heads=2, ffn_dim=32, max_position=64)


def _gen(prompts=PROMPT, model=None, **kw):
  kw.setdefault("max_new_tokens", 4)
  return sj.generate(model or _model(), prompts, **kw)


def _params(fn):
  """The tiny model with its params transformed by fn(copy of params)."""
  m = _model()
  params = jax.tree.map(lambda x: x, m.params)
  fn(params)
  return TinyModel(m.config, params)


def _set(tree, path, value):
  for key in path[:-1]:
    tree = tree[key]
  tree[path[-1]] = value


def _hf_dir(tmp_path, safetensors_bytes: bytes):
  cfg = {"model_type": "llama", "hidden_size": 32, "num_attention_heads": 4, "num_key_value_heads": 2,
         "num_hidden_layers": 1, "intermediate_size": 64, "vocab_size": 50, "max_position_embeddings": 128}
  (tmp_path / "config.json").write_text(json.dumps(cfg))
  (tmp_path / "model.safetensors").write_bytes(safetensors_bytes)
  return str(tmp_path)


def _load(path):
  return sj.load_model(path, use_cache=False)


f64 = lambda p: _set(p, ("layers", "wq"), np.asarray(p["layers"]["wq"], np.float64))

# (id, call(tmp_path), error type, message regex, goes through sj.generate)
CASES = [
    # ---- issue 2: checkpoints, architecture, prompts ----
    ("missing_file", lambda t: _load(str(t / "nope")), ValueError,
     r"'.*nope' is neither a registered model nor an existing path", False),
    ("corrupt_safetensors", lambda t: _load(_hf_dir(t, b"\x10\x00\x00\x00not a header")), ValueError,
     r"model\.safetensors is truncated or corrupt: header length \d+ exceeds", False),
    ("missing_tensor", lambda t: _gen(model=_params(lambda p: p["layers"].pop("wk"))), ConfigError,
     r"params\['layers'\] is missing \['wk'\] required by the model config", True),
    ("wrong_shape", lambda t: _gen(model=_params(lambda p: _set(p, ("layers", "w_up"), p["layers"]["w_up"][:, :, :8]))),
     ConfigError, r"params\['layers'\]\['w_up'\] has shape \(2, 48, 8\); the model config needs \(2, 48, 32\)", True),
    ("unsupported_architecture", lambda t: tiny_config(architecture="gpt2"), ConfigError,
     r"architecture='gpt2' is not supported; expected one of", False),
    ("unsupported_hf_model_type", lambda t: from_hf_config({"model_type": "gpt_neox"}), ConfigError,
     r"model_type='gpt_neox' .* is not supported", False),
    ("kv_heads_not_dividing_heads", lambda t: tiny_config(n_heads=6, n_kv_heads=4), ConfigError,
     r"n_kv_heads=4 must divide n_heads=6", False),
    ("prompt_longer_than_context", lambda t: _gen([list(range(1, 70))]), ValueError,
     r"prompt length 69 \+ max_new_tokens 4 = 73 exceeds the model's context max_position=64", True),
    ("empty_prompt", lambda t: _gen([[]]), ValueError, r"empty prompt: prompt lengths \[0\] must all be >= 1", True),
    ("empty_row_in_batch", lambda t: _gen([[1, 2], []]), ValueError, r"prompt lengths \[2, 0\] must all be >= 1", True),
    # ---- issue 3: cache configs ----
    ("bits_not_supported", lambda t: sj.cache_config("kivi", bits=3), ConfigError,
     r"bits=3 must be one of \(1, 2, 4, 8\)", False),
    ("group_not_dividing_head_dim", lambda t: _gen(cache=sj.cache_config("kivi", group_size=32, residual=32)),
     ConfigError, r"group_size=32 must divide head_dim=16", True),
    ("group_not_dividing_residual", lambda t: sj.cache_config("specache", group_size=8, residual=12), ConfigError,
     r"group_size=8 must divide residual=12", False),
    ("topk_negative", lambda t: sj.cache_config("specache", topk=-1), ConfigError,
     r"topk=-1 must be an integer >= 0", False),
    ("topk_larger_than_cache", lambda t: _gen(cache=sj.cache_config("specache", group_size=8, residual=8, topk=1000)),
     ConfigError, r"topk=1000 is larger than the cache \(128 slots", True),
    ("budget_not_above_sink", lambda t: sj.cache_config("streaming", budget=4, sink=4), ConfigError,
     r"budget=4 must be larger than sink=4", False),
    ("h2o_recent_above_budget", lambda t: sj.cache_config("h2o", budget=8, recent=9), ConfigError,
     r"recent=9 must be <= budget=8", False),
    ("unknown_method", lambda t: sj.cache_config("specahce"), ConfigError,
     r"cache method 'specahce' is unknown \(did you mean 'specache'\?\)", False),
    ("unknown_setting", lambda t: sj.cache_config("kivi", topk=4), ConfigError,
     r"unknown setting\(s\) \['topk'\] for cache method 'kivi'", False),
    ("cache_not_a_config", lambda t: _gen(cache=3), ConfigError, r"cache=3 must be a cache method config", True),
    # ---- issue 4: a run that cannot fit fails up front with the numbers ----
    ("offload_does_not_fit", lambda t: _gen(
        model=TinyModel(dataclasses.replace(_model().config, max_position=2 ** 40), _model().params),
        max_new_tokens=2 ** 36, cache=sj.cache_config("specache", offload=True, group_size=8, residual=8, topk=4)),
     MemoryPlanError, r"needs [0-9.]+ GiB .* but only [0-9.]+ GiB of RAM is available", True),
    # ---- issue 7: inputs, context, mesh, dtypes ----
    ("token_above_vocab", lambda t: _gen([[1, 2, 97, 3]]), ValueError,
     r"token id 97 at row 0, position 2 is outside the vocabulary \[0, vocab_size=97\)", True),
    ("token_negative", lambda t: _gen([[4, 5], [1, -3, 2]]), ValueError,
     r"token id -3 at row 1, position 1 is outside the vocabulary", True),
    ("float_tokens", lambda t: _gen(np.asarray([[1.5, 2.0]])), ValueError,
     r"tokens have dtype=float64 .*token ids must be integers", True),
    ("max_new_tokens_overflow", lambda t: _gen(max_new_tokens=60), ValueError,
     r"prompt length 5 \+ max_new_tokens 60 = 65 exceeds the model's context max_position=64", True),
    ("speculative_row_overflow", lambda t: _gen(max_new_tokens=59, cache=sj.cache_config(
        "specache", group_size=8, residual=8, topk=4)), ValueError, r"5 \+ max_new_tokens 59 \+ 1 = 65 exceeds", True),
    ("max_new_tokens_zero", lambda t: _gen(max_new_tokens=0), ValueError,
     r"max_new_tokens=0 must be an integer >= 1", True),
    ("temperature_negative", lambda t: _gen(temperature=-0.5), ValueError, r"temperature=-0.5 must be >= 0", True),
    ("top_p_zero", lambda t: _gen(top_p=0.0), ValueError, r"top_p=0.0 must be in \(0, 1\]", True),
    ("stop_token_outside_vocab", lambda t: _gen(stop_tokens=(200,)), ValueError,
     r"stop_tokens \[200\] lie outside the vocabulary", True),
    ("lengths_wrong_shape", lambda t: _gen([[1, 2, 3]], lengths=[3, 3]), ValueError,
     r"lengths has shape \(2,\); it needs one length per row: \(1,\)", True),
    ("mesh_data_not_dividing_batch", lambda t: _gen([[1, 2], [3], [4]], mesh=sharding.make_mesh(2, 1)),
     ConfigError, r"mesh data=2 must divide the batch size 3", True),
    ("mesh_model_not_dividing_kv_heads", lambda t: _gen(mesh=sharding.make_mesh(1, 4)), ConfigError,
     r"mesh model=4 must divide n_kv_heads=2", True),
    ("mesh_wrong_axis_names", lambda t: _gen(mesh=jax.make_mesh((1, 2), ("batch", "heads"))), ConfigError,
     r"mesh axes \('batch', 'heads'\) must be exactly \('data', 'model'\)", True),
    ("float64_params_without_x64", lambda t: _gen(model=_params(f64)), ConfigError,
     r"params\['layers'\]\['wq'\] has dtype=float64 but jax_enable_x64 is off", True),
    ("int_params", lambda t: _gen(model=_params(lambda p: _set(p, ("embed",), p["embed"].astype(jnp.int8)))),
     ConfigError, r"params\['embed'\] has dtype=int8, which the decoder cannot run", True),
    ("float8_params", lambda t: _gen(model=_params(
        lambda p: _set(p, ("final_norm",), p["final_norm"].astype(jnp.float8_e4m3fn)))), ConfigError,
     r"params\['final_norm'\] has dtype=float8_e4m3fn, which the decoder cannot run", True),
    ("forward_token_outside_vocab", lambda t: sj.forward(_model(), [[3, 400]]), ValueError,
     r"token id 400 at row 0, position 1 is outside the vocabulary", False),
    ("eos_outside_vocab", lambda t: _gen(model=TinyModel(dataclasses.replace(_model().config, eos_token_ids=(120,)),
                                                          _model().params)),
     ConfigError, r"eos_token_ids=\[120\] lie outside the vocabulary \[0, vocab_size=97\)", True),
]


@pytest.mark.parametrize("call,error,message,via_generate", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_input_fails_clearly(tmp_path, call, error, message, via_generate):
  compiled_before = decode.start_jit._cache_size()
  with pytest.raises(error, match=message):
    call(tmp_path)
  if via_generate:                       # checked before anything was compiled
    assert decode.start_jit._cache_size() == compiled_before


def test_valid_inputs_pass_every_check():
  """The same checks let the good inputs through (so the table's errors come from the bad value alone)."""
  m = _model()
  out = _gen(model=TinyModel(m.config, jax.tree.map(lambda x: x.astype(jnp.float16), m.params)),
             max_new_tokens=3)
  assert out.tokens.shape == (1, 3)
  assert isinstance(m.config, ModelConfig)
