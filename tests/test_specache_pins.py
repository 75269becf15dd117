"""Pinned greedy tokens of `cache_config("specache", bits=1, preset="robust")` and of the faithful default
(bits=1, group_size=64, residual=64, topk=64) on a tiny random model, simulated and offloaded: a refactor of
SpeCache's config or its decode loop must give these tokens exactly. The fixture
(tests/fixtures/specache_tokens.json) records the commit it was made at; `python -m tests.test_specache_pins`
rewrites it (only for an intended change of the tokens)."""
import json
import pathlib
import subprocess

import numpy as np
import pytest

import specache_jax as sj
from tests.tiny import random_prompts, tiny_model

FIXTURE = pathlib.Path(__file__).parent / "fixtures" / "specache_tokens.json"
CONFIGS = {
    "robust": dict(bits=1, preset="robust"),
    "faithful": dict(bits=1, group_size=64, residual=64, topk=64),
}
NEW_TOKENS = 24


def _model():
  return tiny_model(seed=3, head_dim=64)        # group_size 64 divides head_dim


def _prompts(vocab):
  """Two ragged rows; the longer repeats a 40-token span of itself (prompt lookup and its anchors engage)."""
  a, b = random_prompts(13, [260, 233], vocab)
  return [a + a[100:140], b]


def _tokens(name: str, offload: bool):
  model = _model()
  out = sj.generate(model, _prompts(model.config.vocab_size), max_new_tokens=NEW_TOKENS, stop_tokens=(),
                    cache=sj.cache_config("specache", offload=offload, **CONFIGS[name]))
  return np.asarray(out.tokens).tolist()


@pytest.mark.parametrize("offload", [False, True], ids=["simulated", "offloaded"])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_pinned_tokens_are_unchanged(name, offload):
  want = json.loads(FIXTURE.read_text())["tokens"][name]
  assert _tokens(name, offload) == want


def main():
  commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
  tokens = {}
  for name in CONFIGS:
    sim, off = _tokens(name, False), _tokens(name, True)
    assert sim == off, f"{name}: offloaded tokens differ from simulated"
    tokens[name] = sim
  rows = ",\n".join(f"  {json.dumps(k)}: {json.dumps(v)}" for k, v in tokens.items())
  FIXTURE.write_text(f'{{"commit": "{commit}", "configs": {json.dumps(CONFIGS)}, "new_tokens": {NEW_TOKENS},\n'
                     f' "tokens": {{\n{rows}}}}}\n')


if __name__ == "__main__":
  main()
