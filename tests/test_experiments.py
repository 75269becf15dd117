"""The experiment launchers' logic end to end on the random tiny model (never SmolLM2), and resumability."""
from __future__ import annotations

import json
import os
import pathlib
import signal
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs import ablations as ablations_cfg
from configs import hitrate as hitrate_cfg
from configs import longbench as longbench_cfg
from configs import niah as niah_cfg
from configs import perplexity as perplexity_cfg
from experiments.lib import ablations, hitrate, longbench, models, niah, perplexity
from experiments.lib.store import CorruptResultWarning, ResultStore, fingerprint
from experiments.lib.teacher_forcing import teacher_forced_nll
import specache_jax as sj
from specache_jax.data import longbench as lb
from specache_jax.data import niah as niah_data
from specache_jax.model.decoder import forward_full

ROOT = pathlib.Path(__file__).resolve().parents[1]
FIXTURES = ROOT / "tests" / "fixtures" / "longbench"


@pytest.fixture(scope="module")
def tiny():
  return models.load("tiny-random")


def _cfg(module, tmp_path, **overrides):
  c = module.get_config("test")
  c.output_dir = str(tmp_path)
  for k, v in overrides.items():
    c[k] = v
  return c


def _without_seconds(table: str) -> list[list[str]]:
  """Table rows without the timing column (timings differ between runs, results must not)."""
  rows = [[c.strip() for c in line.strip("|").split("|")] for line in table.splitlines()]
  drop = rows[0].index("seconds")
  return [[c for i, c in enumerate(r) if i != drop] for r in rows]


# ---------------------------------------------------------------------------------------------- store
def test_store_is_atomic_resumable_and_fingerprinted(tmp_path):
  path = tmp_path / "r.json"
  store = ResultStore(path)
  fp = fingerprint("model", {"bits": 1})
  assert store.pending([("a", fp), ("b", fp)]) == [("a", fp), ("b", fp)]
  store.put_many({"a": {"x": 1}}, fp)
  again = ResultStore(path)
  assert again.done("a", fp) and not again.done("b", fp)
  assert not again.done("a", fingerprint("model", {"bits": 2}))      # other settings: recompute
  assert again.get("a")["run_id"] == store.run_id != again.run_id
  assert not list(tmp_path.glob(".*.tmp"))                            # no temporary file left behind
  path.write_text("{not json")
  with pytest.warns(CorruptResultWarning, match="is damaged"):
    assert ResultStore(path).cells == {}                              # set aside (tests/test_sweep_resume.py)


# ---------------------------------------------------------------------------------- teacher forcing
# Shapes and methods as in configs/perplexity.py:test, so the perplexity test reuses these compiles.
TF_SHAPE, TF_PREFIX = (1, 300), 40


def _tokens(seed):
  return jnp.asarray(np.random.RandomState(seed).randint(1, 128, size=TF_SHAPE), jnp.int32)


@pytest.mark.parametrize("name,settings", [("full", {}), ("specache", dict(bits=1, topk=384))])
def test_teacher_forcing_equals_the_cache_free_forward(tiny, name, settings):
  """Full cache, and SpeCache with k ≥ every position (exact by construction), through the two-row decode
  path token by token, give the cache-free forward's log-likelihoods."""
  toks = _tokens(1)
  logp = jax.nn.log_softmax(forward_full(tiny.params, tiny.config, toks), axis=-1)
  ref = -np.asarray(jnp.take_along_axis(logp[:, :-1], toks[:, 1:, None], axis=-1)[..., 0])
  nll, hits = teacher_forced_nll(tiny.params, toks, cfg=tiny.config, method=sj.cache_config(name, **settings),
                                 prefix=TF_PREFIX)
  np.testing.assert_allclose(np.asarray(nll), ref[:, TF_PREFIX - 1:], atol=1e-4)
  assert np.asarray(hits).shape == (TF_SHAPE[0],)


def test_teacher_forcing_oracle_speculation_hits_every_step(tiny):
  toks = _tokens(3)
  method = sj.cache_config("specache", bits=1)
  nll, hits = teacher_forced_nll(tiny.params, toks, cfg=tiny.config, method=method, prefix=TF_PREFIX,
                                 spec_row="text")
  assert int(hits[0]) == TF_SHAPE[1] - TF_PREFIX - 1                  # the guess is the text's next token
  own, own_hits = teacher_forced_nll(tiny.params, toks, cfg=tiny.config, method=method, prefix=TF_PREFIX)
  assert int(own_hits[0]) < int(hits[0])
  np.testing.assert_array_equal(np.asarray(nll)[:, :2], np.asarray(own)[:, :2])   # prefill + 1st step agree


def test_teacher_forcing_low_bit_differs(tiny):
  toks = _tokens(2)
  full, _ = teacher_forced_nll(tiny.params, toks, cfg=tiny.config, method=sj.cache_config("full"),
                               prefix=TF_PREFIX)
  low, _ = teacher_forced_nll(tiny.params, toks, cfg=tiny.config,
                              method=sj.cache_config("kivi", bits=1, group_size=64, residual=128),
                              prefix=TF_PREFIX)
  diff = np.abs(np.asarray(full) - np.asarray(low))
  assert diff[:, :128 - TF_PREFIX].max() < 1e-4        # KIVI's 16-bit residual still holds everything
  assert diff[:, 256 - TF_PREFIX:].max() > 1e-2


# ------------------------------------------------------------------------------------------ perplexity
def test_perplexity_end_to_end_and_rerun_reuses_cells(tiny, tmp_path):
  cfg = _cfg(perplexity_cfg, tmp_path)
  res = perplexity.run(cfg, model=tiny, log=lambda *_: None)
  labels = cfg.run_methods.split(",")
  assert res.computed == len(labels) and res.skipped == 0
  for label in labels:
    rec = res.records[f"{label}/w0"]
    assert sum(rec["count"].values()) == cfg.window_tokens - cfg.prefix_tokens
    assert all(np.isfinite(v) for v in rec["nll_sum"].values())
  assert (tmp_path / "perplexity.png").stat().st_size > 0
  summary = (tmp_path / "summary.md").read_text()
  assert "python -m experiments.perplexity" in summary and "| specache_1bit |" in summary
  again = perplexity.run(cfg, model=tiny, log=lambda *_: None)
  assert again.computed == 0 and again.skipped == len(labels) and again.table == res.table


# ------------------------------------------------------------------------------------------- hit rate
def test_hitrate_end_to_end(tiny, tmp_path):
  cfg = _cfg(hitrate_cfg, tmp_path, run_methods="specache_1bit,specache_1bit_eom,specache_1bit_nonspec")
  res = hitrate.run(cfg, model=tiny, log=lambda *_: None)
  nonspec = res.records["specache_1bit_nonspec"]             # no speculative row: no token hit rate, no drift
  assert "exact_hit_rate" not in nonspec and nonspec["sync_fetch_rate"] == 1.0
  assert not {"topk_hit_rate_on_miss", "topk_hit_rate_on_hit"} & set(nonspec)   # no speculative token: no split
  assert "| specache_1bit_nonspec | – |" in (tmp_path / "summary.md").read_text()
  for label in ("specache_1bit", "specache_1bit_eom"):
    rec = res.records[label]
    assert 0.0 <= rec["exact_hit_rate"] <= 1.0 and 0.0 <= rec["topk_hit_rate"] <= 1.0
    assert len(rec["topk_hit_rate_per_layer"]) == tiny.config.n_layers
    assert rec["tokens"] == cfg.num_prompts * cfg.max_new_tokens        # no stop token: full length
    for key in ("topk_hit_rate", "unfetched_mass", "drift"):            # the miss anatomy, split hit / miss
      assert len(rec[f"{key}_on_miss_per_layer"]) == tiny.config.n_layers
      assert 0.0 <= rec[f"{key}_on_hit"] <= 2.0 and 0.0 <= rec[f"{key}_on_miss"] <= 2.0
    # the overall mean is the hit and miss means weighted by their step counts
    misses = 1.0 - rec["exact_hit_rate"]
    assert rec["unfetched_mass"] == pytest.approx(
        rec["unfetched_mass_on_hit"] * (1 - misses) + rec["unfetched_mass_on_miss"] * misses, abs=0.05)
  assert "sync_fetch_rate" not in res.records["specache_1bit"]
  assert 0.0 < res.records["specache_1bit_eom"]["sync_fetch_rate"] <= 1.0
  summary = (tmp_path / "summary.md").read_text()
  assert "| specache_1bit_eom |" in summary and "unfetched mass (after hit / miss)" in summary
  assert (tmp_path / "hitrate.png").stat().st_size > 0
  cfg.run_methods = "full"
  with pytest.raises(ValueError, match="hit rates are SpeCache's"):
    hitrate.run(cfg, model=tiny, log=lambda *_: None)


# ------------------------------------------------------------------------------------------ LongBench
def test_longbench_on_fixtures_resumes_and_scores(tiny, tmp_path):
  cfg = _cfg(longbench_cfg, tmp_path, tasks="trec,lcc", stop_after=1, batch_size=2)
  first = longbench.run(cfg, model=tiny, log=lambda *_: None)
  assert first.computed == 2                                          # stopped after one batch
  cfg.stop_after = 0
  res = longbench.run(cfg, model=tiny, log=lambda *_: None)
  data = lb.read_jsonl_dir(FIXTURES, ["trec", "lcc"])
  total = 2 * sum(len(v) for v in data.values())
  assert res.computed == total - 2 and res.skipped == 2
  for label in ("full", "specache_1bit"):
    for task, examples in data.items():
      lines = [json.loads(x) for x in (tmp_path / label / f"{task}.jsonl").read_text().splitlines()]
      assert [x["_id"] for x in lines] == [ex.id for ex in examples]
      rescored = lb.scorer(task, [x["pred"] for x in lines], [x["answers"] for x in lines],
                           examples[0].all_classes)
      assert res.records[label][task] == rescored
  assert json.loads((tmp_path / "scores.json").read_text()) == res.records
  assert "| TREC | LCC |" in res.table.splitlines()[0].replace("Method | ", "")


def test_longbench_stop_tokens_include_newline_for_samsum(tiny):
  assert longbench.stop_tokens_for(tiny, "samsum") == (0, ord("\n"))
  assert longbench.stop_tokens_for(tiny, "trec") == (0,)


# ----------------------------------------------------------------------------------------------- NIAH
def test_niah_cases_and_table(tiny, tmp_path):
  cfg = _cfg(niah_cfg, tmp_path)
  res = niah.run(cfg, model=tiny, log=lambda *_: None)
  lengths, depths = niah.grid(cfg)
  labels = cfg.run_methods.split(",")
  assert res.computed == len(labels) * len(lengths) * len(depths)
  for label in labels:
    for n in lengths:
      for d in depths:
        rec = res.records[niah.cell_id(label, n, d)]
        assert abs(rec["prompt_tokens"] - n) <= 8 and isinstance(rec["correct"], bool)
  rows = _without_seconds(res.table)
  assert [r[0] for r in rows[2:]] == labels
  for label in labels:
    assert (tmp_path / f"heatmap_{label}.png").stat().st_size > 0
  assert (tmp_path / "heatmaps.png").exists()


def test_niah_runs_the_retrieval_methods_and_says_why_a_cell_cannot_run(tiny, tmp_path):
  """Quest and InfLLM sized to SpeCache 1-bit's bytes: at these lengths the tiny model's SpeCache bytes are below
  InfLLM's smallest budget (its paper's 128 initial tokens + a block of 128), so its cells are not run and the
  summary says why; Quest's run."""
  cfg = _cfg(niah_cfg, tmp_path, run_methods="full,quest,infllm")
  logs = []
  res = niah.run(cfg, model=tiny, log=logs.append)
  lengths, depths = niah.grid(cfg)
  assert res.computed == 2 * len(lengths) * len(depths)
  assert all(res.records[niah.cell_id("quest", n, d)]["settings"]["name"] == "quest" for n in lengths for d in depths)
  assert not any(key.startswith("infllm/") for key in res.records)
  summary = (tmp_path / "summary.md").read_text()
  for n in lengths:
    assert f"- infllm: not run at {n} tokens (specache uses" in summary
    assert any(line.startswith(f"niah infllm @ {n} tokens: not run") for line in logs)
  assert [r[0] for r in _without_seconds(res.table)[2:]] == ["full", "quest"]


def test_niah_answer_check_reads_the_needle(tiny, tmp_path):
  cfg = _cfg(niah_cfg, tmp_path)
  case = niah.build_cases(cfg, tiny.tokenizer, [320], [0.5])[320, 0.5]
  assert case.check("Eat a SANDWICH in dolores park.") and not case.check("Sit in Dolores Park.")
  assert tiny.tokenizer.decode(case.prompt_ids).startswith("<|im_start|>user\n")
  assert cfg.needle in tiny.tokenizer.decode(case.prompt_ids)


def test_niah_needle_set_asks_each_needle_at_every_cell(tiny, tmp_path):
  """more_needles: every named needle of NEEDLE_SET at every (length, depth), in its own cells; the config's
  own needle keeps its cell ids (an earlier store stays valid), and the table has a row per (method, needle)."""
  one = niah.run(_cfg(niah_cfg, tmp_path / "one", run_methods="full"), model=tiny, log=lambda *_: None)
  cfg = _cfg(niah_cfg, tmp_path / "set", run_methods="full,specache_1bit", more_needles="soup,train")
  res = niah.run(cfg, model=tiny, log=lambda *_: None)
  lengths, depths = niah.grid(cfg)
  assert res.computed == 2 * 3 * len(lengths) * len(depths)
  for n in lengths:
    for d in depths:
      assert res.records[niah.cell_id("full", n, d)]["answer"] == one.records[niah.cell_id("full", n, d)]["answer"]
      for key in ("soup", "train"):
        rec = res.records[niah.cell_id("specache_1bit", n, d, key)]
        assert rec["needle"] == key and rec["method"] == "specache_1bit"
  case = niah.build_cases(cfg, tiny.tokenizer, [320], [0.5], "soup")[320, 0.5]
  assert niah_data.NEEDLE_SET["soup"].needle in tiny.tokenizer.decode(case.prompt_ids)
  assert case.check("Smoked PAPRIKA.") and not case.check("A sandwich.")
  assert [r[0] for r in _without_seconds(res.table)[2:]] == [
      "full", "full (soup)", "full (train)", "specache_1bit", "specache_1bit (soup)", "specache_1bit (train)"]
  text = (tmp_path / "set" / "summary.md").read_text()
  assert "- specache_1bit, all needles: " in text and "`324@0.25` (soup)" in text
  assert (tmp_path / "set" / "heatmap_specache_1bit.png").stat().st_size > 0
  with pytest.raises(ValueError, match="must be one of"):
    niah.needles(_cfg(niah_cfg, tmp_path, more_needles="soup,kettle"))


def test_niah_killed_midway_resumes_to_the_uninterrupted_table(tiny, tmp_path):
  """A real kill (SIGKILL of a subprocess after its first stored cells), then a restart: the finished
  cells are reused (their run id survives) and the table equals an uninterrupted run's."""
  straight = niah.run(_cfg(niah_cfg, tmp_path / "straight"), model=tiny, log=lambda *_: None)
  out = tmp_path / "killed"
  results = out / "results.json"
  proc = subprocess.Popen([sys.executable, "-m", "experiments.niah", "--config=configs/niah.py:test",
                           f"--config.output_dir={out}"], cwd=ROOT, stdout=subprocess.DEVNULL,
                          stderr=subprocess.DEVNULL, env=dict(os.environ))
  deadline = time.time() + 90
  try:
    while not results.exists() and proc.poll() is None and time.time() < deadline:
      time.sleep(0.05)
  finally:
    proc.send_signal(signal.SIGKILL)
    proc.wait()
  before = json.loads(results.read_text())["cells"]                   # a complete file, never half-written
  total = len(straight.records)
  assert 0 < len(before) < total, "the subprocess was not stopped midway"
  resumed = niah.run(_cfg(niah_cfg, out), model=tiny, log=lambda *_: None)
  assert resumed.skipped == len(before) and resumed.computed == total - len(before)
  for cid, rec in before.items():
    assert resumed.records[cid]["run_id"] == rec["run_id"]             # not recomputed
  assert _without_seconds(resumed.table) == _without_seconds(straight.table)
  assert {c: r["answer"] for c, r in resumed.records.items()} == {
      c: r["answer"] for c, r in straight.records.items()}


def test_niah_stop_after_splits_a_sweep(tiny, tmp_path):
  cfg = _cfg(niah_cfg, tmp_path, stop_after=1, run_methods="full,specache_1bit")
  part = niah.run(cfg, model=tiny, log=lambda *_: None)
  assert part.computed == len(niah.grid(cfg)[1])                       # one batch: the depths of one length
  cfg.stop_after = 0
  rest = niah.run(cfg, model=tiny, log=lambda *_: None)
  assert rest.skipped == part.computed and rest.computed + rest.skipped == 2 * 2 * 2


# ------------------------------------------------------------------------------------------ ablations
def test_ablations_join_niah_and_perplexity(tiny, tmp_path):
  cfg = _cfg(ablations_cfg, tmp_path)
  res = ablations.run(cfg, model=tiny, log=lambda *_: None)
  labels = cfg.run_methods.split(",")
  for label in labels:
    row = res.records[label]
    assert row["niah_cells"] == 1 and set(row["ppl"]) == {"0–128", "128–300"}
  assert res.records["k0"]["settings"]["topk"] == 0 and res.records["non_speculative"]["spec_hit_rate"] is None
  assert (tmp_path / "niah" / "results.json").exists() and (tmp_path / "perplexity" / "results.json").exists()
  lines = res.table.splitlines()
  assert [line.split("|")[1].strip() for line in lines[2:]] == labels


def test_configs_have_cpu_gpu_and_test_variants():
  for module in (niah_cfg, perplexity_cfg, hitrate_cfg, ablations_cfg, longbench_cfg):
    for arg in ("cpu", "gpu", "test"):
      module.get_config(arg)
    with pytest.raises(ValueError, match="must be one of cpu, .*gpu, test"):
      module.get_config("tpu")
  assert niah_cfg.get_config().model == "smollm2-135m"


def _launch(*args):
  return subprocess.run([sys.executable, "-m", *args], cwd=ROOT, capture_output=True, text=True,
                        env=dict(os.environ), timeout=600)


def test_generate_launcher_prints_what_the_library_generates(tiny):
  """The CLI (absl flags + ml_collections config) against the same settings run in-process, and on a mesh."""
  from configs import generate as generate_cfg
  from specache_jax import sharding
  from experiments.lib import generate
  cfg = generate_cfg.get_config("tiny")
  cfg.cache, cfg.cache_settings = "specache", "bits=1,topk=8,residual=32,group_size=32"
  want = generate.run(cfg, model=tiny)
  assert want.new_tokens == cfg.max_new_tokens and want.text
  for data, model_axis in [(1, 2), (2, 2)]:          # data=2 > batch 1: the batch is padded, the pad dropped
    on_mesh = generate.run(cfg, model=tiny, mesh=sharding.make_mesh(data, model_axis))
    assert on_mesh.text == want.text, (data, model_axis)
  proc = _launch("experiments.generate", "--config=configs/generate.py:tiny", "--config.cache=specache",
                 f"--config.cache_settings={cfg.cache_settings}", "--mesh=1,2")
  assert proc.returncode == 0, proc.stderr[-2000:]
  assert proc.stdout.splitlines()[0] == want.text.splitlines()[0]


@pytest.mark.parametrize("args,message", [
    (["--mesh=2"], "--mesh='2' must be 'DATA,MODEL'"),
    (["--mesh=3,3"], "needs 9 devices; only 8"),
    (["--config.cache_settings=bits"], "cache_settings item 'bits' must look like name=value"),
    (["--config.cache=lru"], "cache method 'lru' is unknown"),
    (["--config.model=/nonexistent/model.gguf"], "CheckpointError"),
], ids=["mesh-one-axis", "mesh-too-big", "settings-no-value", "unknown-method", "missing-checkpoint"])
def test_generate_launcher_rejects_bad_flags_with_a_message(args, message):
  proc = _launch("experiments.generate", "--config=configs/generate.py:tiny", *args)
  assert proc.returncode != 0 and message in proc.stderr, proc.stderr[-2000:]
  assert "Traceback" not in proc.stderr


def test_sweep_launchers_without_a_sharded_path_refuse_a_mesh(tmp_path):
  proc = _launch("experiments.perplexity", "--config=configs/perplexity.py:test", "--mesh=1,2",
                 f"--config.output_dir={tmp_path}")
  assert proc.returncode != 0 and "runs on one device" in proc.stderr, proc.stderr[-2000:]


def test_a_per_label_option_is_refused_where_the_experiment_ignores_it(tiny, tmp_path):
  """perplexity's spec_row in a NIAH sweep would silently run plain SpeCache: it is an error instead."""
  from specache_jax.errors import ConfigError
  cfg = _cfg(niah_cfg, tmp_path)
  cfg.methods.specache_1bit_oracle = dict(name="specache", bits=1, spec_row="text")
  cfg.run_methods = "specache_1bit_oracle"
  with pytest.raises(ConfigError, match="does not use 'spec_row'"):
    niah.run(cfg, model=tiny, log=lambda *_: None)
