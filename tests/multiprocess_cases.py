"""The tiny model, prompts and method settings a multi-process run and its one-process reference share."""
from tests.tiny import random_prompts, tiny_model

LENGTHS = [21, 9, 14, 5]          # a ragged batch of 4: data=2 or 4 splits it
METHODS = {
    "full": ("full", dict()),
    "kivi": ("kivi", dict(bits=2, group_size=8, residual=16)),
    "specache": ("specache", dict(bits=1, group_size=8, residual=8, topk=4)),
    "specache_offload": ("specache", dict(bits=1, group_size=8, residual=8, topk=4, offload=True)),
    "quest_offload": ("quest", dict(budget=8, page_size=4, offload=True)),
    "infllm_offload": ("infllm", dict(budget=14, n_init=2, block_size=3, repr_topk=2, local=6, offload=True)),
}


def model_and_prompts():
  mdl = tiny_model(seed=11, head_dim=16, n_heads=4, n_kv_heads=4, ffn_dim=32)
  return mdl, random_prompts(5, LENGTHS, mdl.config.vocab_size)
