"""The real model: SmolLM2-135M-Instruct from the embedded GGUF (issue 2 and 3's SmolLM2 checks)."""
import jax.numpy as jnp
import numpy as np
import pytest

import specache_jax as sj
from specache_jax.data import corpora
from specache_jax.decode import init_cache
from specache_jax.model.decoder import forward_jit

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def model():
  return sj.load_model("smollm2-135m")


def test_greedy_capital_of_france(model):
  ids = model.tokenizer.encode("The capital of France is")
  out = sj.generate(model, [ids], max_new_tokens=4, stop_tokens=())
  assert model.tokenizer.decode(out.tokens[0].tolist()).startswith(" Paris")


def _essay_ids(model, n):
  name, text = corpora.paul_graham_essays()[0]
  ids = model.tokenizer.encode(text)
  assert len(ids) >= n, name
  return ids[:n]


def test_specache_with_topk_covering_the_context_equals_full_each_step(model):
  cfg, params = model.config, model.params
  ids = _essay_ids(model, 150)
  toks = jnp.asarray([ids])
  ref = forward_jit(params, cfg, toks, None, None, "prefill")[0][0, 135:]  # cache-free logits
  method = sj.cache_config("specache", bits=1, group_size=64, residual=64, topk=160)
  cache = init_cache(method, cfg, 1, method.slots(160), jnp.float32)
  _, cache, _ = forward_jit(params, cfg, toks[:, :135], cache, method, "prefill")
  _, cache, _ = forward_jit(params, cfg, toks[:, 135:136], cache, method, "predecode")
  worst = 0.0
  for t in range(135, 150):
    spec = toks[:, min(t + 1, 149)]
    logits, cache, _ = forward_jit(params, cfg, jnp.stack([toks[:, t], spec], 1), cache, method, "decode")
    worst = max(worst, float(jnp.max(jnp.abs(logits[0, 0] - ref[t - 135]))))
  assert worst <= 1e-4 * max(1.0, float(jnp.max(jnp.abs(ref)))), worst


def test_needles_retrieved_by_full_specache_2bit_and_1bit_robust(model, tmp_path):
  """Held on the cells of results/niah where they were measured to retrieve (1024 tokens, depths 0.25 and 0.75):
  SpeCache 2-bit (g64, R64, k64) and SpeCache 1-bit k=64 with the robust preset (candidates, exact_on_miss,
  prompt lookup; results/speculation/niah). Recorded there, not asserted: on this 135M model SpeCache 1-bit at
  k=64 retrieves no needle (speculation misses; it answers "eat a sandwich." and drops "Dolores Park"), and 2-bit
  misses 3 of 6 cells. (1-bit at k=256 retrieved these cells too; dropped from this test for CI time.)"""
  from configs.niah import get_config
  from experiments.lib import niah
  config = get_config("cpu")
  config.lengths = "1024"
  config.depths = "0.25,0.75"
  config.run_methods = "full,specache_2bit,specache_1bit_robust"
  config.output_dir = str(tmp_path)
  result = niah.run(config, model=model, log=lambda *_: None)
  by_method = {}
  for key, rec in result.records.items():
    label, cell = key.split("/", 1)
    by_method.setdefault(label, {})[cell] = rec["correct"]
  full = by_method["full"]
  assert len(full) == 2 and all(full.values()), full          # cases chosen where the full cache succeeds
  for label in ("specache_2bit", "specache_1bit_robust"):
    assert all(by_method[label][c] for c, ok in full.items() if ok), (label, by_method[label])
