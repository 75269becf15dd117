"""Faults of the host store's worker, injected through the real numpy store: a gather or a write that raises,
and a gather that stalls, surface at the runtime's next wait as errors naming the layer group — bounded in
time, never a hang, never tokens from rows the store failed to hold."""
import threading
import time

import numpy as np
import pytest

import specache_jax as sj
from specache_jax import host_worker, offload
from specache_jax.errors import ConfigError
from tests.tiny import random_prompts, tiny_model

SPEC = dict(bits=1, group_size=8, residual=8, topk=4)
NEW = 12


def _model():
  return tiny_model(seed=5, head_dim=16, n_layers=4)


def _prompts(model):
  return random_prompts(3, [30, 21], model.config.vocab_size)


class _FaultyStore(offload.NumpyHostStore):
  """The numpy store whose worker runs `fault(layers)` in the `at`-th gather of the group holding `layer`
  (counting from 1), or inside the write named `write` (e.g. "block write of layer 1")."""
  layer, at, fault, write = 1, 3, None, None
  seen: list = []

  def gather(self, layers, kappas_BKX):
    if self.layer in layers:
      type(self).seen.append(time.monotonic())
      if len(type(self).seen) == self.at and self.fault is not None:
        self.fault(layers)
    return super().gather(layers, kappas_BKX)

  def _write(self, what, job):
    if what == self.write:
      return super()._write(what, lambda: (job(), self.fault(what)))
    return super()._write(what, job)


@pytest.fixture
def faulty(monkeypatch):
  """Every offloaded run in the test gets a _FaultyStore (make_store builds it for host_store="numpy")."""
  cls = type("Faulty", (_FaultyStore,), {"seen": []})
  monkeypatch.setattr(offload, "NumpyHostStore", cls)
  return cls


def _offloaded(model, prompts):
  return sj.generate(model, prompts, max_new_tokens=NEW, stop_tokens=(),
                     cache=sj.cache_config("specache", offload=True, host_store="numpy", **SPEC))


def test_a_gather_that_raises_mid_generation_names_its_layer_group_and_chains_the_cause(faulty):
  model = _model()
  prompts = _prompts(model)
  want = sj.generate(model, prompts, max_new_tokens=NEW, stop_tokens=(), cache=sj.cache_config("specache", **SPEC))

  def boom(layers):
    raise OSError(f"injected fault in {layers}")
  faulty.fault = staticmethod(boom)
  with pytest.raises(offload.HostStoreError, match=r"fetch of layers \[1\] failed in the worker: OSError: "
                                                    r"injected fault in \(1,\)") as err:
    _offloaded(model, prompts)
  assert isinstance(err.value.__cause__, OSError) and not isinstance(err.value, TimeoutError)
  assert len(faulty.seen) == faulty.at                  # raised at the wait for that very fetch, mid-decoding
  faulty.fault = None                                    # the next run gets a fresh store: the exact tokens
  np.testing.assert_array_equal(_offloaded(model, prompts).tokens, want.tokens)


def test_a_failed_block_write_fails_the_next_fetch_instead_of_serving_stale_rows(faulty):
  """A ring flush that raises in the worker: the rows it should have written are missing, so the next fetch
  of any layer group refuses (naming the write that failed), rather than gathering zeros."""
  model = _model()

  def boom(what):
    raise MemoryError(f"injected while {what}")
  faulty.fault, faulty.write = staticmethod(boom), "block write of layer 1"
  with pytest.raises(offload.HostStoreError, match=r"fetch of layers \[\d\] failed in the worker: the block "
                                                    r"write of layer 1 failed earlier in the worker \(MemoryError"
                                                    ) as err:
    _offloaded(model, _prompts(model))
  assert isinstance(err.value.__cause__, offload.HostStoreError)
  assert isinstance(err.value.__cause__.__cause__, MemoryError)


def test_a_stalled_gather_times_out_after_fetch_timeout_s_and_names_the_group(faulty, monkeypatch):
  """The worker blocks inside one group's gather (until released): the runtime's wait on that fetch gives up
  after $SPECACHE_JAX_FETCH_TIMEOUT_S with HostFetchTimeout; the stalled thread does not block the next run."""
  model = _model()
  prompts = _prompts(model)
  _offloaded(model, prompts)                             # compiled: the timing below is the wait's alone
  faulty.seen.clear()
  release, stalled_at = threading.Event(), []

  def stall(layers):
    stalled_at.append(time.monotonic())
    release.wait(60)
  faulty.fault = staticmethod(stall)
  monkeypatch.setenv(offload.FETCH_TIMEOUT_ENV, "0.5")
  try:
    with pytest.raises(offload.HostFetchTimeout, match=r"fetch of layers \[1\] was not ready after "
                                                       r"fetch_timeout_s=0.5 s: the store's worker thread is stalled"):
      _offloaded(model, prompts)
    waited = time.monotonic() - stalled_at[0]
    assert 0.5 <= waited < 10, waited                    # the timeout, plus at most a step's dispatch
    faulty.fault = None
    monkeypatch.setenv(offload.FETCH_TIMEOUT_ENV, "60")
    t0 = time.monotonic()
    _offloaded(model, prompts)                           # a new store and worker: unaffected by the stalled one
    assert time.monotonic() - t0 < 30
  finally:
    release.set()


def test_a_stalled_fetch_of_a_two_layer_group_names_both_layers_and_abandons_the_queue():
  """On the store alone (a group of layers 2 and 3): the timeout names the group's layers; the fetch queued
  behind the stalled one is cancelled, and closing the store does not wait for the stalled thread."""
  cfg = _model().config
  release = threading.Event()

  class Stalling(offload.NumpyHostStore):
    def gather(self, layers, kappas_BKX):
      if layers == (2, 3):
        release.wait(60)
      return super().gather(layers, kappas_BKX)

  store = Stalling(4, 1, cfg.n_kv_heads, 64, cfg.head_dim, np.float32, fetch_timeout_s=0.3)
  kappas = (np.zeros((1, cfg.n_kv_heads, SPEC["topk"]), np.int32),) * 2
  try:
    stuck, behind = store.fetch((2, 3), kappas), store.fetch((0, 1), kappas)
    with pytest.raises(offload.HostFetchTimeout, match=r"fetch of layers \[2, 3\] was not ready after "
                                                       r"fetch_timeout_s=0.3 s"):
      stuck.result()
    t0 = time.monotonic()
    store.close()                                        # abandoned: returns at once
    assert time.monotonic() - t0 < 1
  finally:
    release.set()
  with pytest.raises(offload.HostStoreError, match=r"cancelled: an earlier fetch of this store timed out"):
    behind.result()


def test_fetch_timeout_setting_is_validated(monkeypatch):
  monkeypatch.setenv(offload.FETCH_TIMEOUT_ENV, "soon")
  with pytest.raises(ConfigError, match=r"SPECACHE_JAX_FETCH_TIMEOUT_S='soon' must be a finite number"):
    host_worker.resolve_fetch_timeout()
  monkeypatch.delenv(offload.FETCH_TIMEOUT_ENV)
  assert host_worker.resolve_fetch_timeout() == host_worker.FETCH_TIMEOUT_DEFAULT_S
  assert host_worker.resolve_fetch_timeout(2.5) == 2.5
  for bad in (0, -1.0, float("inf"), float("nan")):
    with pytest.raises(ConfigError, match=r"fetch_timeout_s=.* must be a finite number of seconds > 0"):
      host_worker.resolve_fetch_timeout(bad)
