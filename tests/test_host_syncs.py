"""The offloaded runtime's host reads: none in a speculative step (only `generate`'s stop checks, every
`sync_every` steps), one per step where the algorithm needs it (exact_on_miss's miss flags), and the same tokens,
counts and statistics whatever `sync_every` is."""
import jax
import numpy as np
import pytest

import specache_jax as sj
from specache_jax.runtime import OffloadRuntime
from tests.tiny import random_prompts, tiny_model

KW = dict(bits=1, group_size=8, residual=8, topk=4)


def _model():
  return tiny_model(seed=31, head_dim=16)


def _runtime(model, store="numpy", batch=3, max_len=96, **settings):
  method = sj.cache_config("specache", offload=True, host_store=store, **dict(KW, **settings))
  return OffloadRuntime(model.params, model.config, method, batch=batch, max_len=max_len)


def _reads_per_step(rt, model, steps=12, lengths=(12, 37, 25)):
  """(the runtime's host reads inside each `advance`, the tokens' speculative hits after each step)."""
  toks, lens = sj.pad_prompts(random_prompts(7, list(lengths), model.config.vocab_size))
  spec = sj.decode.SamplingSpec.make(0.0, 1.0, (), 0)
  state, pending = rt.begin(toks, lens, jax.random.key(0), spec, steps + 1)
  reads, hits = [], []
  for _ in range(steps):
    before = rt.host_reads
    state, pending = rt.advance(state, pending, spec)
    reads.append(rt.host_reads - before)
    hits.append(float(np.asarray(state.spec_hits)))        # the test's own read, not the runtime's
  return reads, hits


@pytest.mark.parametrize("store", ["numpy", "pinned_host"])
def test_a_speculative_step_reads_nothing_on_the_host(store):
  """Faithful 1-bit SpeCache, offloaded: no decoding step reads a device value on the dispatching thread, and
  steps whose guesses hit are among them."""
  model = _model()
  reads, hits = _reads_per_step(_runtime(model, store), model)
  assert reads == [0] * len(reads)
  assert np.diff([0.0] + hits).max() > 0, "no step's guess hit: the test did not see a hitting step"


def test_exact_on_miss_reads_the_miss_flags_once_a_step_and_nonspeculative_reads_nothing():
  """exact_on_miss must know before the step's attention whether any row missed: one read a step, hit or
  miss; the non-speculative ablation always fetches on the critical path and reads nothing."""
  model = _model()
  rt = _runtime(model, exact_on_miss=True)
  reads, _ = _reads_per_step(rt, model)
  assert reads == [1] * len(reads)
  before = rt.host_reads
  rt.read(np.zeros(3, bool))                               # flags already on the host: no device read
  assert rt.host_reads == before
  reads, _ = _reads_per_step(_runtime(model, speculative=False), model)
  assert reads == [0] * len(reads)


def _stop_token(model, prompts, method_kw):
  """A token row 0 of the simulated run samples at step 5 (a stop token then ends the generation early)."""
  sim = sj.generate(model, prompts, max_new_tokens=20, cache=sj.cache_config("specache", **method_kw),
                    stop_tokens=())
  return int(np.asarray(sim.tokens)[0, 5])


@pytest.mark.parametrize("settings", [{}, {"preset": "robust", "topk": 8}], ids=["faithful", "robust"])
def test_stop_checks_every_n_steps_keep_tokens_counts_and_statistics(settings):
  """Stop checks every 1, 3 or 64 steps: the steps run past the last stop token write the pad id and count
  nothing, so tokens, num_tokens and the statistics equal the simulated run's; the runtime's host reads in
  `generate` are prefill's lengths, the stop checks, and (exact_on_miss) one miss read per step."""
  model = _model()
  kw = dict(KW, **settings)
  prompts = random_prompts(9, [30], model.config.vocab_size)
  stop = _stop_token(model, prompts, kw)
  sim = sj.generate(model, prompts, max_new_tokens=20, cache=sj.cache_config("specache", **kw),
                    stop_tokens=(stop,))
  assert int(np.asarray(sim.num_tokens)[0]) < 20, "the stop token did not end the simulated run early"
  toks, lens = sj.pad_prompts(prompts)
  method = sj.cache_config("specache", offload=True, host_store="numpy", **kw)
  for every in (1, 3, 64):
    rt = OffloadRuntime(model.params, model.config, method, batch=1, max_len=96, sync_every=every)
    out = rt.generate(toks, lens, 20, jax.random.key(0), stop_tokens=(stop,), pad_id=stop)   # as sj.generate
    np.testing.assert_array_equal(out.tokens, sim.tokens)
    np.testing.assert_array_equal(out.num_tokens, sim.num_tokens)
    assert jax.tree.map(np.asarray, out.stats).keys() == sim.stats.keys()
    for name in sim.stats:
      np.testing.assert_allclose(np.asarray(out.stats[name]), np.asarray(sim.stats[name]), err_msg=name)
    done_at = int(np.asarray(sim.num_tokens)[0]) - 1          # the step that sampled the stop token
    flagged = -(-done_at // every) * every                     # the first stop flag issued after it
    assert rt._step_index == min(19, flagged + 1)              # ... read after the next step is dispatched
    checks = 1 + (rt._step_index - 1) // every                 # the flags read: begin's, then every N steps
    miss_reads = rt._step_index if method.speculation.exact_on_miss else 0
    assert rt.host_reads == 1 + checks + miss_reads            # 1: prefill's lengths

@pytest.mark.parametrize("every", [0, -2, 1.5, True])
def test_sync_every_must_be_a_positive_int(every):
  model = _model()
  with pytest.raises(ValueError, match="sync_every"):
    OffloadRuntime(model.params, model.config, sj.cache_config("specache", offload=True, **KW), batch=1,
                   max_len=64, sync_every=every)
