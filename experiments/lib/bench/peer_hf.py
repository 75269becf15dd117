"""The peer of the peer benchmark (bench/peer.py): HF transformers (torch) on our model's weights, decoding
greedily with an explicit cache object (`DynamicCache`, or quanto's `QuantizedCache`), and the greedy-token
parity of ours and it. torch and transformers are imported where they are used (the test extras)."""
from __future__ import annotations

import os
import time

import numpy as np

from experiments.lib.bench.common import random_prompts
from specache_jax import api
from specache_jax.errors import ConfigError

PEER_CACHES = ("dynamic", "quanto")
_TORCH_DTYPES = {"float32": "float32", "bfloat16": "bfloat16", "float16": "float16"}



# ----------------------------------------------------------------------------------------------- the HF model
def hf_config(cfg):
  """The transformers config of our ModelConfig (LLaMA family; Qwen2 for q/k/v bias)."""
  from transformers import LlamaConfig, MistralConfig, Qwen2Config
  rs = cfg.rope_scaling
  rope = {"rope_type": rs.rope_type, "rope_theta": cfg.rope_theta}
  if rs.rope_type == "linear":
    rope["factor"] = rs.factor
  elif rs.rope_type == "llama3":
    rope.update(factor=rs.factor, low_freq_factor=rs.low_freq_factor, high_freq_factor=rs.high_freq_factor,
                original_max_position_embeddings=rs.original_max_position)
  cls = {"llama": LlamaConfig, "mistral": MistralConfig, "qwen2": Qwen2Config}[cfg.architecture]
  extra = {"sliding_window": None} if cfg.architecture == "mistral" else {}
  if cfg.architecture == "llama":
    extra["attention_bias"] = cfg.qkv_bias
  return cls(vocab_size=cfg.vocab_size, hidden_size=cfg.dim, intermediate_size=cfg.ffn_dim,
             num_hidden_layers=cfg.n_layers, num_attention_heads=cfg.n_heads, num_key_value_heads=cfg.n_kv_heads,
             head_dim=cfg.head_dim, rms_norm_eps=cfg.norm_eps, max_position_embeddings=cfg.max_position,
             tie_word_embeddings=cfg.tie_embeddings, rope_parameters=rope, **extra)


def hf_state_dict(cfg, params) -> dict:
  """Our params (DESIGN.md layout, [in, out], layers stacked) as an HF state dict ([out, in], one per layer)."""
  import torch
  t = lambda x: torch.from_numpy(np.array(x, np.float32))                 # a writable copy
  lay = params["layers"]
  sd = {"model.embed_tokens.weight": t(params["embed"]), "model.norm.weight": t(params["final_norm"])}
  names = {"wq": "self_attn.q_proj", "wk": "self_attn.k_proj", "wv": "self_attn.v_proj", "wo": "self_attn.o_proj",
           "w_gate": "mlp.gate_proj", "w_up": "mlp.up_proj", "w_down": "mlp.down_proj"}
  for i in range(cfg.n_layers):
    p = f"model.layers.{i}."
    sd[p + "input_layernorm.weight"] = t(lay["attn_norm"][i])
    sd[p + "post_attention_layernorm.weight"] = t(lay["mlp_norm"][i])
    for ours, theirs in names.items():
      sd[p + theirs + ".weight"] = t(np.asarray(lay[ours][i], np.float32).T)
    for b, proj in (("bq", "q_proj"), ("bk", "k_proj"), ("bv", "v_proj")):
      if b in lay:
        sd[p + f"self_attn.{proj}.bias"] = t(lay[b][i])
  sd["lm_head.weight"] = sd["model.embed_tokens.weight"] if cfg.tie_embeddings else t(np.asarray(
      params["lm_head"], np.float32).T)
  return sd


def hf_model(model, weights: str = "params", attn: str = "sdpa", device: str = "cpu", gguf_path: str = ""):
  """A transformers CausalLM with our model's weights, in its dtype, in eval mode.

  weights: "params" — our loaded params converted tensor by tensor (the same numbers by construction);
  "gguf" — transformers' own GGUF loader on the file ours was loaded from (`gguf_path`), as a new user would."""
  import torch
  import transformers
  dtype = getattr(torch, _TORCH_DTYPES[str(model.params["embed"].dtype)])
  if weights == "gguf":
    if not gguf_path.endswith(".gguf"):
      raise ConfigError(f"hf_weights='gguf' needs a .gguf checkpoint; the model came from {gguf_path!r}")
    hf = transformers.AutoModelForCausalLM.from_pretrained(os.path.dirname(gguf_path),
                                                           gguf_file=os.path.basename(gguf_path), dtype=dtype,
                                                           attn_implementation=attn)
  elif weights == "params":
    hf = transformers.AutoModelForCausalLM.from_config(hf_config(model.config), attn_implementation=attn,
                                                       dtype=torch.float32)
    missing, unexpected = hf.load_state_dict(hf_state_dict(model.config, model.params), strict=False)
    if unexpected or set(missing) - {"lm_head.weight"}:
      raise ConfigError(f"HF state dict mismatch: missing {missing}, unexpected {unexpected}")
    hf = hf.to(dtype)
  else:
    raise ConfigError(f"hf_weights={weights!r} must be 'params' or 'gguf'")
  return hf.to(device).eval()


def _torch_nbytes(x) -> int:
  """Bytes of a tensor, including the inner tensors of a tensor subclass (quanto's packed codes/scales)."""
  if hasattr(x, "__tensor_flatten__"):
    names, _ = x.__tensor_flatten__()
    return int(sum(_torch_nbytes(getattr(x, n)) for n in names))
  return int(x.numel() * x.element_size()) if x is not None and hasattr(x, "numel") else 0


class HFRunner:
  """HF transformers decoding greedily with an explicit cache object (`cache=`, transformers 5's name for
  `past_key_values`), prefill and decode timed apart; only the last position's logits (`logits_to_keep=1`, as
  `generate` does).

  spec: {"cache": "dynamic"} or {"cache": "quanto", "nbits", "q_group_size", "residual_length", "axis_key",
  "axis_value"}. Prompts must all have the same length (no attention mask: the fast path a new user gets)."""
  mode = "hf"

  def __init__(self, hf, spec: dict, tokens, lengths):
    import torch
    self.torch, self.hf, self.spec = torch, hf, dict(spec)
    if self.spec.get("cache") not in PEER_CACHES:
      raise ConfigError(f"peer cache={self.spec.get('cache')!r} must be one of {PEER_CACHES}")
    tokens = np.asarray(tokens)
    if not (np.asarray(lengths) == tokens.shape[1]).all():
      raise ConfigError(f"the HF peer needs equal-length prompts; got lengths {np.asarray(lengths).tolist()}")
    self.device = next(hf.parameters()).device
    self.ids = torch.as_tensor(tokens, dtype=torch.long, device=self.device)
    self.record = {"mode": self.mode, "peer": dict(self.spec), "attn_implementation": hf.config._attn_implementation}
    self.carry, self.generated = None, []

  def _sync(self):
    if self.device.type == "cuda":
      self.torch.cuda.synchronize()

  def new_cache(self):
    from transformers import DynamicCache, QuantizedCache
    if self.spec["cache"] == "dynamic":
      return DynamicCache(config=self.hf.config)
    kw = {k: self.spec[k] for k in ("nbits", "q_group_size", "residual_length", "axis_key", "axis_value")
          if k in self.spec}
    return QuantizedCache(backend="quanto", config=self.hf.config, **kw)

  def _forward(self, ids, cache):
    with self.torch.inference_mode():
      out = self.hf(input_ids=ids, cache=cache, use_cache=True, logits_to_keep=1)
      return out.logits[:, -1].argmax(-1, keepdim=True)                # [B, 1]

  def prefill(self) -> float:
    self.carry = None
    self._sync()
    t0 = time.perf_counter()
    cache = self.new_cache()
    tok = self._forward(self.ids, cache)
    self._sync()
    sec = time.perf_counter() - t0
    self.carry, self.generated = (tok, cache), [tok]
    return sec

  def chain(self, n: int) -> float:
    tok, cache = self.carry
    self._sync()
    t0 = time.perf_counter()
    for _ in range(n):
      tok = self._forward(tok, cache)
      self.generated.append(tok)
    self._sync()
    sec = (time.perf_counter() - t0) / n
    self.carry = (tok, cache)
    return sec

  def tokens(self) -> np.ndarray:
    """The greedy tokens since the last prefill (the first from the prefill): [B, n] int."""
    return self.torch.cat(self.generated, dim=1).cpu().numpy()

  def finish(self) -> dict:
    cache = self.carry[1]
    if self.spec["cache"] == "dynamic":
      held = sum(_torch_nbytes(l.keys) + _torch_nbytes(l.values) for l in cache.layers)
    else:
      held = sum(_torch_nbytes(l._quantized_keys) + _torch_nbytes(l._quantized_values) + _torch_nbytes(l.keys)
                 + _torch_nbytes(l.values) for l in cache.layers)
    return dict(self.record, cache_bytes_held=int(held), seq_length=int(cache.get_seq_length()))


# ------------------------------------------------------------------------------------------------- the parity
def greedy_parity(model, hf, seed: int, batch: int, prompt_len: int, new_tokens: int) -> dict:
  """The same greedy tokens from ours (`sj.generate`, full cache) and the peer (HFRunner, DynamicCache)?"""
  tokens, lengths = random_prompts(seed, batch, prompt_len, model.config.vocab_size)
  ours = np.asarray(api.generate(model, tokens, max_new_tokens=new_tokens, temperature=0.0, stop_tokens=()).tokens)
  peer = HFRunner(hf, {"cache": "dynamic"}, tokens, lengths)
  peer.prefill()
  if new_tokens > 1:
    peer.chain(new_tokens - 1)
  theirs = peer.tokens()[:, :new_tokens]
  same = ours == theirs
  first = [int(np.argmin(r)) if not r.all() else None for r in same]
  return {"batch": batch, "prompt_len": prompt_len, "new_tokens": new_tokens, "equal": int(same.sum()),
          "total": int(same.size), "first_mismatch_per_row": first, "ours": ours.tolist(), "peer": theirs.tolist()}
