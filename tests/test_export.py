"""`python -m experiments.export` on the tiny model: one artifact per (method, phase, platform), and the decode
steps of SpeCache (default and robust preset, simulated and offloaded) and KIVI carry the platform's Pallas kernel
— a Triton call for cuda, a Mosaic call for tpu — with the default attention_impl ("auto")."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

from experiments.lib import export

ROOT = Path(__file__).resolve().parents[1]
KERNEL = {"cuda": "triton", "tpu": "mosaic"}


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
  out = tmp_path_factory.mktemp("export")
  done = subprocess.run([sys.executable, "-m", "experiments.export", "--platforms=cuda,tpu", f"--out={out}"],
                        cwd=ROOT, capture_output=True, text=True, timeout=600)
  assert done.returncode == 0, done.stderr[-4000:]
  return out, json.loads((out / "custom_calls.json").read_text()), done.stdout


def test_one_artifact_per_method_phase_and_platform(exported):
  out, report, stdout = exported
  keys = {f"{m}.{ph}.{pl}" for m in export.METHODS for ph in export.PHASES for pl in ("cuda", "tpu")}
  assert set(report) == keys
  for key in keys:
    assert (out / f"{key}.mlirbc").stat().st_size > 0
    assert f"{key}: " in stdout                           # printed with its custom calls


@pytest.mark.parametrize("method", ["specache", "specache_robust", "specache_offload", "kivi"])
@pytest.mark.parametrize("platform", ["cuda", "tpu"])
def test_low_bit_decode_steps_carry_the_platforms_pallas_kernel(exported, method, platform):
  _, report, _ = exported
  assert report[f"{method}.decode.{platform}"]["kernel"] == KERNEL[platform], report[f"{method}.decode.{platform}"]


def test_methods_without_a_pallas_kernel_export_without_one(exported):
  _, report, _ = exported
  for method in ("full", "streaming", "h2o"):
    for platform in ("cuda", "tpu"):
      assert report[f"{method}.decode.{platform}"]["kernel"] is None


def test_custom_calls_are_read_from_the_stablehlo_text():
  text = ('%0 = stablehlo.custom_call @tpu_custom_call(%arg0) {backend_config = "..."}\n'
          '%1 = stablehlo.custom_call @__gpu$xla.gpu.triton(%0)\n"stablehlo.custom_call"(%1) '
          '{call_target_name = "triton_kernel_call"}')
  calls = export.custom_calls(text)
  assert calls == ["__gpu$xla.gpu.triton", "tpu_custom_call", "triton_kernel_call"]
  assert export.kernel_family(calls) == "triton" and export.kernel_family(["tpu_custom_call"]) == "mosaic"
  assert export.kernel_family(["specache_top_k"]) is None
