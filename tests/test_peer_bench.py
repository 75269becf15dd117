"""The peer benchmark (HF transformers vs ours in one interleaved run): the HF model built from our weights
computes our logits, the byte and FLOP formulas, and `configs/peer_bench.py:test` end to end through the
launcher (table structure, and both sides' greedy tokens equal on the tiny model). No timing is asserted."""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys

import jax.numpy as jnp
import numpy as np
import pytest

from configs import peer_bench as peer_cfg
from experiments.lib import methods as exp_methods
from experiments.lib import models as exp_models
from experiments.lib.bench import machine, peer, peer_hf
from experiments.lib.bench import models as bench_models
from experiments.lib.perplexity import text_windows
import specache_jax as sj
from specache_jax.caches.budget import device_bytes_at

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("optimum.quanto")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def tiny():
  return bench_models.load("random:tiny", "", 0)


def test_hf_model_from_our_params_computes_our_logits(tiny):
  hf = peer_hf.hf_model(tiny, "params", "eager")
  ids = np.random.RandomState(0).randint(0, tiny.config.vocab_size, size=(2, 19))
  ours = np.asarray(sj.forward(tiny, ids.tolist()))
  with torch.no_grad():
    theirs = hf(torch.as_tensor(ids, dtype=torch.long)).logits.numpy()
  assert np.abs(ours).max() > 0.1
  np.testing.assert_allclose(ours, theirs, rtol=0, atol=1e-4)


@pytest.mark.parametrize("cache", ["dynamic", "quanto"])
def test_hf_runner_prefill_then_steps(tiny, cache):
  hf = peer_hf.hf_model(tiny)
  tokens = np.random.RandomState(1).randint(0, tiny.config.vocab_size, size=(2, 40)).astype(np.int32)
  spec = {"cache": cache} if cache == "dynamic" else {"cache": cache, "nbits": 2, "q_group_size": 16,
                                                       "residual_length": 16}
  r = peer_hf.HFRunner(hf, spec, tokens, np.full(2, 40))
  assert r.prefill() > 0 and r.chain(3) > 0
  rec = r.finish()
  assert r.tokens().shape == (2, 4) and rec["seq_length"] == 43 and rec["cache_bytes_held"] > 0
  with pytest.raises(ValueError, match="equal-length prompts"):
    peer_hf.HFRunner(hf, spec, tokens, np.array([40, 39]))
  with pytest.raises(ValueError, match="must be one of"):
    peer_hf.HFRunner(hf, {"cache": "static"}, tokens, np.full(2, 40))


def test_bytes_and_flops_formulas():
  cfg = exp_models.SHAPES["smollm2-135m"]
  from specache_jax.model_config import ModelConfig
  cfg = ModelConfig(**cfg, name="smollm2")
  full = sj.cache_config("full")
  for s, b in [(1024, 1), (8192, 4)]:
    assert peer.peer_cache_bytes({"cache": "dynamic"}, cfg, s, b, 4) == device_bytes_at(full, cfg, s, jnp.float32, b)
  q = peer.peer_cache_bytes({"cache": "quanto", "nbits": 2, "q_group_size": 64}, cfg, 8192, 1, 4)
  assert q == 2 * 30 * 3 * 8192 * 64 * (2 / 8 + 2 * 4 / 64)
  flops = peer.prefill_flops(cfg, 1, 8192)                       # the issue's ≈ 4.5 TFLOP counts the whole LM head
  assert 3.9e12 < flops < 4.2e12
  assert peer.prefill_flops(cfg, 4, 1024) == 4 * peer.prefill_flops(cfg, 1, 1024)
  # a decode step at context 1 is a one-token prefill; rows scale batch x width; attention 4·L·heads·h per position
  assert peer.decode_flops(cfg, 1, 1) == peer.prefill_flops(cfg, 1, 1)
  assert peer.decode_flops(cfg, 4, 8192, 2) == 8 * peer.decode_flops(cfg, 1, 8192)
  assert peer.decode_flops(cfg, 1, 8192) - peer.decode_flops(cfg, 1, 4096) == 4 * 30 * 9 * 64 * 4096


def test_machine_limits_are_measured():
  m = machine.measure(8 << 20, 128, 2, "cpu", repeats=2)
  assert m["read_bandwidth"]["best_Bps"] > 1e8 and m["matmul"]["best_flops"] > 1e7
  assert m["read_bandwidth"]["best_Bps"] == max(m["read_bandwidth"][k] for k in m["read_bandwidth"]["best_of"])


def test_configs_have_cpu_gpu_test_and_robust_variants():
  for arg in ("cpu", "gpu", "test", "robust"):
    c = peer_cfg.get_config(arg)
    assert c.reference in c.peers
    assert set(peer._labels(c.scaling.run_methods)) <= set(c.methods)
  robust = peer_cfg.get_config("robust")
  built = {label: exp_methods.build(robust, label, None, 4096, "float32") for label in exp_methods.labels(robust)}
  assert all(m.offload for label, m in built.items() if label != "full")
  assert (built["specache_1bit_cand2_offload"].speculation.candidates == 2
          and built["specache_1bit_eom_offload"].speculation.exact_on_miss)
  with pytest.raises(ValueError, match="must be one of cpu, gpu, test, robust"):
    peer_cfg.get_config("tpu")


def test_cell_prompts_are_random_tokens_or_windows_of_a_corpus(tiny):
  c = peer_cfg.get_config("test")
  tokens, lengths = peer.cell_prompts(c, tiny, 400, 2, 336)
  assert tokens.shape == (2, 336) and lengths.tolist() == [336, 336]
  c.prompts = "austen"
  with_text = exp_models.load("tiny-random")                     # the character tokenizer
  tokens, lengths = peer.cell_prompts(c, with_text, 400, 2, 336)
  np.testing.assert_array_equal(tokens, text_windows(with_text.tokenizer, "austen", 2, 336))
  assert lengths.tolist() == [336, 336]
  with pytest.raises(ValueError, match="needs the checkpoint's tokenizer"):
    peer.cell_prompts(c, tiny, 400, 2, 336)                      # random:tiny has none
  c.prompts = "shakespeare"
  with pytest.raises(ValueError, match="prompts='shakespeare' must be 'random' or a corpus"):
    peer.cell_prompts(c, with_text, 400, 2, 336)


def test_peer_bench_end_to_end(tmp_path):
  out, plot = tmp_path / "peer_test", tmp_path / "scaling_test.png"
  proc = subprocess.run([sys.executable, "-m", "experiments.peer_bench", "--config=configs/peer_bench.py:test",
                         f"--config.out={out}", f"--config.plot={plot}"], cwd=ROOT, capture_output=True, text=True,
                        env=dict(os.environ), timeout=1200)
  assert proc.returncode == 0, proc.stderr[-3000:]
  result = json.loads((tmp_path / "peer_test.json").read_text())
  c = peer_cfg.get_config("test")
  ours, peers = peer._labels(c.run_methods), peer._labels(c.run_peers)
  # the two sides run the same model: identical greedy tokens
  par = result["parity"]
  assert par["equal"] == par["total"] == c.parity.batch * c.parity.new_tokens, par
  meta = result["meta"]
  assert meta["limits"]["torch_threads"] == meta["limits"]["jax_cpu_threads"] >= 1
  assert meta["limits"]["read_bandwidth"]["best_Bps"] > 0 and meta["limits"]["matmul"]["best_flops"] > 0
  assert meta["command"].startswith("python -m experiments.peer_bench")
  assert [(x["context"], x["batch"]) for x in result["cells"]] == [(s, b) for s in c.contexts for b in c.batches]
  for cell in result["cells"]:
    assert list(cell["methods"]) == ours + peers
    # the floor divides by the bandwidth measured while the cell ran (once per decode round)
    bw = cell["read_bandwidth"]
    assert len(bw["samples_Bps"]) == c.rounds and bw["median_Bps"] == statistics.median(bw["samples_Bps"]) > 0
    assert all(r["floor_step_s"] == pytest.approx(r["bytes_per_step"] / bw["median_Bps"])
               for r in cell["methods"].values())
    for label, rec in cell["methods"].items():
      assert "skipped" not in rec, (label, rec)
      assert rec["prefill_s"] > 0 and rec["step_s"] > 0 and len(rec["rounds_step_s"]) == c.rounds
      assert rec["tokens_per_s"] == pytest.approx(cell["batch"] / rec["step_s"])
      assert rec["bytes_per_step"] == rec["weight_bytes_per_step"] + rec["cache_bytes_per_step"]
      assert rec["x_floor"] == pytest.approx(rec["step_s"] / rec["floor_step_s"])
      assert rec["compute_floor_step_s"] == pytest.approx(rec["step_flops"] / meta["limits"]["matmul"]["best_flops"])
      assert rec["roofline_step_s"] == max(rec["floor_step_s"], rec["compute_floor_step_s"])
      assert rec["x_roofline"] == pytest.approx(rec["step_s"] / rec["roofline_step_s"])
      assert rec["x_roofline"] <= rec["x_floor"]
      assert rec["decode_speed_vs_ref"] > 0 and rec["prefill_time_vs_ref"] > 0
    ref = cell["methods"][c.reference]
    assert ref["decode_speed_vs_ref"] == 1.0 and ref["mode"] == "hf"
    full = cell["methods"]["full"]["cache_bytes_per_step"]
    assert cell["methods"][c.reference]["cache_bytes_per_step"] == full           # the same fp cache
    assert cell["methods"]["specache_1bit"]["cache_bytes_per_step"] < full
    # SpeCache decodes two rows per sequence (real + speculative): twice the full cache's step FLOPs
    assert cell["methods"]["specache_1bit"]["step_flops"] == 2 * cell["methods"]["full"]["step_flops"]
    assert cell["methods"][c.reference]["step_flops"] == cell["methods"]["full"]["step_flops"]
  assert len(result["targets"]) == 6 and all({"rule", "met", "values"} <= set(t) for t in result["targets"])
  points = result["scaling"]["points"]
  assert [p["context"] for p in points] == list(c.scaling.contexts)
  for p in points:
    assert list(p["methods"]) == peer._labels(c.scaling.run_methods)
    assert len(p["read_bandwidth"]["samples_Bps"]) == c.scaling.rounds
    assert all(r["step_s"] > 0 and r["x_floor"] > 0 for r in p["methods"].values()), p
  md = (tmp_path / "peer_test.md").read_text()
  assert md.splitlines()[0] == f"`{meta['command']}`"
  for text in ("## Decode tok/s", "## Prefill seconds", "## Every cell", "## Issue 10's targets",
               "## Decode step vs context", "| hf_quanto_2bit |", "## Read bandwidth while each cell ran", "(scaling_test.png)",
               f"**{par['total']}/{par['total']} equal**"):
    assert text in md, text
  assert plot.stat().st_size > 10_000
  # --merge: two runs as one report (here the run and a copy of it relabelled as another batch size)
  other = json.loads(json.dumps(result))
  for cell in other["cells"]:
    cell["batch"] += 100
  other["meta"]["command"] = "python -m experiments.peer_bench (the other run)"
  other["meta"]["prefill_rounds"] = meta["prefill_rounds"] + 2      # a run that prefilled more often
  (tmp_path / "other.json").write_text(json.dumps(other))
  merged_out = tmp_path / "merged"
  proc = subprocess.run([sys.executable, "-m", "experiments.peer_bench", "--config=configs/peer_bench.py:test",
                         f"--merge={tmp_path / 'peer_test.json'},{tmp_path / 'other.json'}",
                         f"--config.out={merged_out}", "--config.plot="], cwd=ROOT, capture_output=True, text=True,
                        env=dict(os.environ), timeout=600)
  assert proc.returncode == 0, proc.stderr[-3000:]
  merged = json.loads((tmp_path / "merged.json").read_text())
  want = sorted([(x["context"], x["batch"]) for x in result["cells"] + other["cells"]])
  assert [(x["context"], x["batch"]) for x in merged["cells"]] == want
  assert [r["command"] for r in merged["meta"]["merged_runs"]] == [meta["command"], other["meta"]["command"]]
  assert len(merged["targets"]) == 6 and merged["scaling"] == other["scaling"]
  md = (tmp_path / "merged.md").read_text()
  assert md.startswith("Merged from 2 runs") and "(the other run)" in md and "## Decode tok/s" in md
  n = meta["prefill_rounds"]
  assert [r["prefill_rounds"] for r in merged["meta"]["merged_runs"]] == [n, n + 2]
  assert f"prefills {n}–{n + 2}× in rotating order" in md and f"{n + 2} prefill(s) per method and cell" in md
  # a merged report takes a later run's cells: its runs stay listed one by one, the new run's cell replaces theirs
  third = json.loads(json.dumps(result))
  third["meta"]["command"] = "python -m experiments.peer_bench (a third run)"
  third["cells"][0]["from_the_third_run"] = True
  again = peer.merge([merged, third], peer_cfg.get_config("test").targets)
  assert [r["command"] for r in again["meta"]["merged_runs"]] == [meta["command"], other["meta"]["command"],
                                                                   third["meta"]["command"]]
  assert [(x["context"], x["batch"]) for x in again["cells"]] == want
  first = (result["cells"][0]["context"], result["cells"][0]["batch"])
  assert next(c for c in again["cells"] if (c["context"], c["batch"]) == first).get("from_the_third_run")
