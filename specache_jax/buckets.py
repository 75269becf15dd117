"""Shape buckets: the lengths a generate call compiles for, so that nearby prompt and generation lengths reuse
one compiled program.

A call is compiled for three sizes: the prompt array's width (the prompt is right-padded to it; each row's
length is a traced value, so the padding does not change the tokens), the output buffer's width (the number of
new tokens is a traced loop bound; the buffer is sliced to `max_new_tokens` on the host) and the cache slots
(`decode.slots_for` of the bucketed prompt width plus the bucketed output width). A `BucketPolicy` maps a
length to its bucket: the smallest of `floor` and `2**k * r` (r in `ratios`) that holds it, rounded up to a
multiple of `quantum`. The default, floor 16 and ratios (1, 1.5), gives 16, 32, 48, 64, 96, 128, 192, 256,
384, 512, 768, 1024, 1536, 2048, ...: at most 50% padding (and at most 33% past 32 tokens), and about two
programs per doubling of the length. `EXACT` (`buckets=None` in `sj.generate`) compiles for the lengths
themselves (the prompt rounded to 16, the slots to `decode.SLOT_ROUNDING`).
"""
from __future__ import annotations

import dataclasses
import math

from specache_jax.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class BucketPolicy:
  """Lengths -> buckets: the smallest of `floor` and `2**k * r` (k >= 0, r in `ratios`) at least the length,
  rounded up to a multiple of `quantum`."""
  floor: int = 16
  ratios: tuple[float, ...] = (1.0, 1.5)
  quantum: int = 16

  def __post_init__(self):
    if isinstance(self.floor, bool) or not isinstance(self.floor, int) or self.floor < 1:
      raise ConfigError(f"floor={self.floor!r} must be an int >= 1 (the smallest bucket)")
    if isinstance(self.quantum, bool) or not isinstance(self.quantum, int) or self.quantum < 1:
      raise ConfigError(f"quantum={self.quantum!r} must be an int >= 1 (buckets are multiples of it)")
    if not self.ratios or any(not 1.0 <= float(r) < 2.0 for r in self.ratios):
      raise ConfigError(f"ratios={self.ratios!r} must be a non-empty tuple of values in [1, 2) (bucket sizes "
                        "2**k * r)")

  def bucket(self, n: int) -> int:
    """The bucket of a length n >= 1."""
    if n <= self.floor:
      size = self.floor
    else:
      k = max(0, math.floor(math.log2(n)) - 1)
      size = min(c for j in (k, k + 1, k + 2) for r in self.ratios if (c := math.ceil(2 ** j * r)) >= n)
    return -(-size // self.quantum) * self.quantum


DEFAULT = BucketPolicy()


@dataclasses.dataclass(frozen=True)
class Shapes:
  """What a generate call compiles for: the prompt array's width, the output buffer's width, the slot need
  (tokens the cache must hold, before `decode.slots_for` adds a step's rows and rounds)."""
  prompt_width: int
  out_width: int
  slot_tokens: int


def plan(policy: BucketPolicy | None, width: int, longest: int, new_tokens: int, max_position: int) -> Shapes:
  """The compiled sizes of a call whose prompt array is `width` wide, whose longest row is `longest` tokens and
  which generates `new_tokens`. The bucketed slot need is capped at the model's context (`max_position`) but
  never below what the call needs; the prompt width likewise."""
  exact = -(-width // 16) * 16
  if policy is None:
    return Shapes(exact, new_tokens, longest + new_tokens)
  prompt_width = max(exact, min(policy.bucket(width), max_position // 16 * 16))
  out_width = policy.bucket(new_tokens)
  slot_tokens = max(longest + new_tokens, min(prompt_width + out_width, max_position))
  return Shapes(prompt_width, out_width, slot_tokens)
