"""config.extra_methods (cache-method labels added from the command line) and LongBench's per-model presets."""
from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest

from configs import ablations as ablations_cfg
from configs import longbench as longbench_cfg
from configs import needle_rank as needle_rank_cfg
from configs import niah as niah_cfg
from experiments.lib import ablations, methods
from specache_jax.caches import cache_config
from specache_jax.data import longbench as lb
from specache_jax.errors import ConfigError

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_parse_extra_reads_labels_methods_and_typed_values():
  got = methods.parse_extra(" kivi2_g32 = kivi: bits=2, group_size=32 ;spec1_robust=specache:bits=1,preset=robust;"
                            ";ref=full;s=specache:exact_on_miss=true,speculative=False,one_bit=kivi;"
                            "h=h2o:match=spec1_robust,recent=none;p=specache:spec_row=text")
  assert got == {
      "kivi2_g32": dict(name="kivi", bits=2, group_size=32),
      "spec1_robust": dict(name="specache", bits=1, preset="robust"),
      "ref": dict(name="full"),
      "s": dict(name="specache", exact_on_miss=True, speculative=False, one_bit="kivi"),
      "h": dict(name="h2o", match="spec1_robust", recent=None),
      "p": dict(name="specache", spec_row="text"),
  }
  assert [type(methods.parse_value(v)) for v in ("3", "-2", "0.5", "1e-3", "TRUE", "robust")] == \
      [int, int, float, float, bool, str]
  assert methods.parse_extra("") == {} and methods.parse_extra(" ; ") == {}


@pytest.mark.parametrize("text,message", [
    ("kivi_2bit", r"part 'kivi_2bit' must be 'label=method' or 'label=method:key=value"),
    ("=kivi:bits=2", r"part '=kivi:bits=2' must be"),
    ("a=:bits=2", r"part 'a=:bits=2' must be"),
    ("a b=full", r"label 'a b' .* must use only letters"),
    ("a,b=full", r"label 'a,b'"),
    ("a=kiwi:bits=2", r"extra_methods a \('a=kiwi:bits=2'\): cache method 'kiwi' is unknown \(did you mean 'kivi'"),
    ("a=kivi:bits", r"extra_methods a: setting 'bits' must be key=value"),
    ("a=kivi:bits=2,,residual=128", r"extra_methods a: setting '' must be key=value"),
    ("a=kivi:bits=", r"setting 'bits=' must be key=value"),
    ("a=kivi:bits=2,bits=1", r"extra_methods a: setting 'bits' given twice"),
    ("a=full;b=kivi;a=kivi:bits=1", r"label 'a' appears twice \('a=kivi:bits=1'\)"),
    ("b=kivi:topk=64", r"extra_methods b .*unknown setting\(s\) \['topk'\] for cache method 'kivi'; allowed"),
    ("c=kivi:bits=3", r"extra_methods c .*bits=3 must be one of"),
    ("d=specache:bits=1,preset=nope", r"extra_methods d .*preset='nope' is not a SpeCache preset"),
])
def test_parse_extra_names_the_bad_part(text, message):
  with pytest.raises(ConfigError, match=message):
    methods.parse_extra(text)


def test_extra_labels_join_the_config_and_run_after_run_methods():
  c = niah_cfg.get_config("test")
  c.run_methods = "full,kivi_1bit"
  c.extra_methods = "kivi2_g32=kivi:bits=2,group_size=32;h2o_g32=h2o:match=kivi2_g32;spec_r=specache:preset=robust"
  assert methods.labels(c) == ["full", "kivi_1bit", "kivi2_g32", "h2o_g32", "spec_r"]
  c.run_methods = "spec_r,full"                              # named in run_methods: run there, not appended twice
  assert methods.labels(c) == ["spec_r", "full", "kivi2_g32", "h2o_g32"]
  assert methods.spec_of(c, "kivi2_g32") == dict(name="kivi", bits=2, group_size=32)
  assert "kivi2_g32" not in c.methods                        # the config itself is untouched
  parts = methods.settings_fingerprint_parts(c, "spec_r")
  assert parts["preset_settings"]["topk"] == cache_config("specache", preset="robust").topk
  assert methods.settings_fingerprint_parts(c, "h2o_g32")["match_spec"] == dict(name="kivi", bits=2, group_size=32)


def test_extra_labels_are_checked_against_config_methods():
  c = niah_cfg.get_config("test")
  c.extra_methods = "mine=full;kivi_1bit=kivi:bits=1"
  with pytest.raises(ConfigError, match=r"adds \['kivi_1bit'\], already in config.methods"):
    methods.labels(c)
  c.extra_methods = "h=h2o:match=nowhere"
  with pytest.raises(ConfigError, match=r"extra_methods h: match='nowhere' names no label"):
    methods.labels(c)
  c.run_methods, c.extra_methods = "", ""
  with pytest.raises(ConfigError, match="selects no method"):
    methods.labels(c)
  c.extra_methods = "only=full"                              # an empty run_methods plus extras runs the extras
  assert methods.labels(c) == ["only"]


def test_every_sweep_config_with_methods_has_extra_methods():
  import importlib
  for name in ("niah", "ruler", "perplexity", "longbench", "hitrate", "ablations", "throughput", "caches_bench",
               "cpu_kernel_bench", "peer_bench"):
    c = importlib.import_module(f"configs.{name}").get_config()
    assert c.extra_methods == "", name
  assert "extra_methods" not in needle_rank_cfg.get_config("test")   # it has no methods
  c = ablations_cfg.get_config("test")
  c.extra_methods = "x=full"
  assert ablations.part_config(c, "niah").extra_methods == "x=full"


def _launch(*args):
  return subprocess.run([sys.executable, "-m", *args], cwd=ROOT, capture_output=True, text=True,
                        env=dict(os.environ), timeout=600)


def test_niah_launcher_runs_a_method_added_on_the_command_line(tmp_path):
  proc = _launch("experiments.niah", "--config=configs/niah.py:test", f"--config.output_dir={tmp_path}",
                 "--config.run_methods=full", "--config.lengths=336",
                 "--config.extra_methods=kivi2_g32=kivi:bits=2,group_size=32,residual=32")
  assert proc.returncode == 0, proc.stderr[-3000:]
  rows = [line.split("|")[1].strip() for line in proc.stdout.splitlines() if line.startswith("|")]
  assert rows[2:] == ["full", "kivi2_g32"], proc.stdout
  cells = json.loads((tmp_path / "results.json").read_text())["cells"]
  settings = [r["settings"] for k, r in cells.items() if k.startswith("kivi2_g32")]
  assert settings and all(s == dict(name="kivi", bits=2, group_size=32, residual=32, one_bit="kivi",
                                    attention_impl="auto") for s in settings), settings
  bad = _launch("experiments.niah", "--config=configs/niah.py:test", f"--config.output_dir={tmp_path}",
                "--config.extra_methods=k=kivi:bits=2,grup_size=32")
  assert bad.returncode != 0
  assert "ConfigError: extra_methods k ('k=kivi:bits=2,grup_size=32'): unknown setting(s) ['grup_size']" \
      in bad.stderr, bad.stderr[-3000:]


# ------------------------------------------------------------------------------------ LongBench presets


@pytest.mark.parametrize("preset", list(longbench_cfg.PRESETS))
def test_longbench_presets_run_table_1_at_the_models_context(preset):
  p = longbench_cfg.PRESETS[preset]
  c = longbench_cfg.get_config(f"gpu_{preset}")
  assert (c.model_preset, c.max_prompt_tokens, c.batch_size) == (preset, p["max_prompt_tokens"], p["batch_size"])
  assert c.model == "" and c.dtype == "bfloat16" and c.limit == 0 and c.output_dir.endswith(preset)
  longest = max(lb.max_new_tokens(task) for task, _ in lb.PAPER_TASKS)
  assert c.max_prompt_tokens + longest <= p["context"]          # the longest answer fits the model's context
  labels = methods.labels(c)
  assert labels[:len(longbench_cfg.TABLE1)] == list(longbench_cfg.TABLE1)
  built = {label: methods.spec_of(c, label) for label in labels}
  for bits in (1, 2):
    for kind, residual in (("kivi", 128), ("specache", 64)):
      for g, suffix in ((32, "_g32"), (64, "")):
        spec = built[f"{kind}_{bits}bit{suffix}"]
        assert (spec["name"], spec["bits"], spec["group_size"], spec["residual"]) == (kind, bits, g, residual)
  assert built["specache_1bit_g32"]["topk"] == 64 and built["h2o"]["match"] == "specache_1bit"


def test_longbench_context_presets_differ_by_model():
  prompt = {p: longbench_cfg.get_config(f"gpu_{p}").max_prompt_tokens for p in longbench_cfg.PRESETS}
  assert prompt["llama2_7b_chat"] == 3500 and prompt["llama3_8b_instruct"] == 7500
  assert prompt["mistral_7b_instruct"] == prompt["longchat_7b_32k"] == 31500
  with pytest.raises(ValueError, match="must be one of cpu, gpu_llama2_7b_chat, .*gpu, test"):
    longbench_cfg.get_config("gpu_llama9")
