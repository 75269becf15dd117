"""RULER (Hsieh et al. 2024, NVIDIA/RULER), generated here: 13 tasks fitted to a token budget with the
model's own tokenizer, and RULER's scoring. `generate(task, length, index, seed, tokenizer)` -> `Sample`."""
from specache_jax.data.ruler.sample import Sample, chat, plain, sample_id
from specache_jax.data.ruler.scoring import clean, sample_score, string_match_all, string_match_part
from specache_jax.data.ruler.tasks import SHORT, SYNTHETIC, TASKS, generate, gen_tokens

__all__ = ["SHORT", "SYNTHETIC", "TASKS", "Sample", "chat", "clean", "gen_tokens", "generate", "plain",
           "sample_id", "sample_score", "string_match_all", "string_match_part"]
