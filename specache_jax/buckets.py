"""Shape buckets: the lengths a generate call compiles for, so that nearby prompt and generation lengths reuse
one compiled program.

A call is compiled for three sizes: the prompt array's width (the prompt is cut to its longest row and
right-padded to that row's bucket; each row's length is a traced value, so the padding does not change the
tokens), the output buffer's width (the number of new tokens is a traced loop bound; the buffer is sliced to
`max_new_tokens` on the host) and the cache slots (`decode.slots_for` of the bucketed prompt width plus the
bucketed output width). A `BucketPolicy` maps a length to its bucket: the smallest of `floor` and `2**k * r`
(r in the ratios) that holds it, rounded up to a multiple of `quantum`. The prompt's default ratios
(1, 1.25, 1.5, 1.75) give 16, 32, 48, 64, 80, 96, 112, 128, 160, ..., 1024, 1280, 1536, 1792, 2048, ...: at
most 25% padding past 64 tokens (the prefill's cost), four programs per doubling. The output's (1,) above 64 gives
64, 128, 256, ...: a wider buffer costs no compute (the loop stops at `max_new_tokens`), only cache slots
(`decode.SLOT_ROUNDING` rounds them to 128 anyway). `None`
(`buckets=None` in `sj.generate`) compiles for the exact lengths (the prompt array rounded to 16, the slots
to `decode.SLOT_ROUNDING`).
"""
from __future__ import annotations

import dataclasses
import math

from specache_jax.errors import ConfigError


def _check_ratios(name: str, ratios) -> None:
  if not isinstance(ratios, tuple) or not ratios or any(not 1.0 <= float(r) < 2.0 for r in ratios):
    raise ConfigError(f"{name}={ratios!r} must be a non-empty tuple of values in [1, 2) (bucket sizes 2**k * r)")


@dataclasses.dataclass(frozen=True)
class BucketPolicy:
  """Lengths -> buckets: the smallest of the floor and `2**k * r` (k >= 0, r in the ratios) at least the
  length, rounded up to a multiple of `quantum`: `floor` and `prompt_ratios` for the prompt's width,
  `new_token_floor` and `new_token_ratios` for the output's."""
  floor: int = 16
  prompt_ratios: tuple[float, ...] = (1.0, 1.25, 1.5, 1.75)
  new_token_ratios: tuple[float, ...] = (1.0,)
  new_token_floor: int = 64
  quantum: int = 16

  def __post_init__(self):
    if isinstance(self.floor, bool) or not isinstance(self.floor, int) or self.floor < 1:
      raise ConfigError(f"floor={self.floor!r} must be an int >= 1 (the smallest bucket)")
    for name in ("new_token_floor", "quantum"):
      value = getattr(self, name)
      if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{name}={value!r} must be an int >= 1 (the smallest output width; buckets are "
                          "multiples of quantum)")
    _check_ratios("prompt_ratios", self.prompt_ratios)
    _check_ratios("new_token_ratios", self.new_token_ratios)

  def bucket(self, n: int, ratios: tuple[float, ...], floor: int | None = None) -> int:
    """The bucket of a length n >= 1 under `ratios` (floor: `floor` unless given)."""
    floor = self.floor if floor is None else floor
    if n <= floor:
      size = floor
    else:
      k = max(0, math.floor(math.log2(n)) - 1)
      size = min(c for j in (k, k + 1, k + 2) for r in ratios if (c := math.ceil(2 ** j * r)) >= n)
    return -(-size // self.quantum) * self.quantum

  def prompt(self, n: int) -> int:
    """The prompt width for a longest row of n tokens."""
    return self.bucket(n, self.prompt_ratios)

  def new_tokens(self, n: int) -> int:
    """The output width for n new tokens."""
    return self.bucket(n, self.new_token_ratios, self.new_token_floor)


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
  which generates `new_tokens`. Bucketed, the prompt array is cut to `longest` and padded to its bucket, capped
  at the model's context (`max_position`) but never below the longest row rounded to 16; the slot need
  likewise. None: the array's width rounded to 16, the exact slot need."""
  if policy is None:
    return Shapes(-(-width // 16) * 16, new_tokens, longest + new_tokens)
  prompt_width = max(-(-longest // 16) * 16, min(policy.prompt(longest), max_position // 16 * 16))
  out_width = policy.new_tokens(new_tokens)
  slot_tokens = max(longest + new_tokens, min(prompt_width + out_width, max_position))
  return Shapes(prompt_width, out_width, slot_tokens)
