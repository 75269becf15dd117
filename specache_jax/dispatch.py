"""Which implementation runs each op of a decoding step: the one place that chooses.

`attention_impl` (SpeCacheConfig, KiviConfig; IMPLS) names a kernel family:
  "auto"                  the platform's kernels, chosen for the platform the program is LOWERED for
                          (`lax.platform_dependent`: a program exported for cuda or tpu on a CPU host gets the
                          GPU or TPU kernel): the XLA:CPU kernels (`cpu_kernels`) on cpu, Pallas Triton
                          (`pallas_kernels`) on cuda, Pallas Mosaic TPU (`pallas_kernels.tpu`) on tpu, the jnp
                          reference on any other platform;
  "jnp"                   the jnp reference (XLA's ops) everywhere;
  "cpu"                   the XLA:CPU kernels (the CPU backend only);
  "pallas"                the Triton kernels (a GPU only);
  "pallas_tpu"            the Mosaic TPU kernels (a TPU only);
  "pallas_interpret", "pallas_tpu_interpret"   those Pallas kernels in interpret mode (any backend; tests).
An explicit kernel family that cannot run on the backend is refused when the config meets it (`check_backend`,
from `validation.check_cache_config`), and one whose mixed attention kernel does not take the cache's layout when
it meets the model (`check_layout`, from the configs' `validate`). Other ops without a kernel of the family, or
with a shape their kernel does not take, run the reference: "pallas" still takes XLA's top-k and the full cache's
dense attention; "auto" takes the reference wherever the platform's kernel does not apply.

Ops (each call site asks here): `mixed_attention` (SpeCache's and KIVI's low-bit + 16-bit attention: every
family), `dense_attention` (the full cache's decode attention), `prefill_attention`, `top_k`, `scatter_top_k`,
`take_rows`, `greedy`, `ring_keys`, `dense` (the model's weight products) (XLA:CPU kernels or the reference).
Ops called without a config take "auto". `on_cpu_only` is the CPU-only lowering choice of the fusion barriers (a conditional on the
CPU, none elsewhere).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels import _common as triton_common
from pallas_kernels.mixed_decode_attention import MixedAttentionBlock
from pallas_kernels.mixed_decode_attention import mixed_decode_attention as triton_mixed
from pallas_kernels.tpu import _common as tpu_common
from pallas_kernels.tpu.mixed_decode_attention import MixedAttentionTPUBlock
from pallas_kernels.tpu.mixed_decode_attention import mixed_decode_attention as tpu_mixed
from specache_jax import cpu_kernels as ck
from specache_jax.cpu_kernels import dense_attention as cpu_dense
from specache_jax.cpu_kernels import mixed_attention as cpu_attention
from specache_jax.cpu_kernels import prefill_attention as cpu_prefill
from specache_jax.cpu_kernels import ring_keys as cpu_ring
from specache_jax.cpu_kernels import select
from specache_jax.errors import ConfigError

IMPLS = ("auto", "jnp", "cpu", "pallas", "pallas_tpu", "pallas_interpret", "pallas_tpu_interpret")
# The backends (jax.default_backend() or a lowering platform) an explicit family runs on; absent: any.
RUNS_ON = {"cpu": ("cpu",), "pallas": ("gpu", "cuda", "rocm"), "pallas_tpu": ("tpu",)}
# Lowering platform -> the family "auto" takes there (any other platform: the reference).
AUTO = {"cpu": "cpu", "cuda": "pallas", "tpu": "pallas_tpu"}
_INTERPRET = {"pallas_interpret": "pallas", "pallas_tpu_interpret": "pallas_tpu"}


def check_impl(impl: str) -> None:
  if impl not in IMPLS:
    raise ConfigError(f"attention_impl={impl!r} must be one of {IMPLS}")


def check_backend(impl: str, platform: str | None = None) -> None:
  """Refuses an explicit kernel family the backend cannot run, with the reason. platform: jax.default_backend()
  (None) or a lowering platform (cpu, cuda, rocm, tpu)."""
  check_impl(impl)
  platform = platform or jax.default_backend()
  runs_on = RUNS_ON.get(impl)
  if runs_on is not None and platform not in runs_on:
    raise ConfigError(f"attention_impl={impl!r} runs on {runs_on[0]} only; this backend is {platform!r} (use "
                      "'auto' for this platform's kernels, or an interpret-mode family for tests)")
  if impl == "cpu" and not ck.available():
    raise ConfigError(f"attention_impl='cpu' needs the XLA:CPU kernels, which are {ck.status()}")


def cpu_kernels_on() -> bool:
  """Whether "auto" programs may take the XLA:CPU kernels: the CPU is the default backend (elsewhere they are
  not even built) and they are built (`cpu_kernels.available()`)."""
  return jax.default_backend() == "cpu" and ck.available()


def on_cpu_only(*args, cpu, default):
  """cpu(*args) in programs lowered for the CPU, default(*args) for every other platform."""
  return jax.lax.platform_dependent(*args, cpu=cpu, default=default)


def choose(impl: str, reference, *args, cpu=None, pallas=None, pallas_tpu=None):
  """reference(*args), or the kernel `impl` picks: cpu(*args), pallas(*args, interpret=) or
  pallas_tpu(*args, interpret=) — None where the op has no such kernel or it does not take these shapes.
  "auto": one branch per platform (`lax.platform_dependent`), so the lowering platform decides."""
  check_impl(impl)
  kernels = dict(cpu=cpu, pallas=pallas and functools.partial(pallas, interpret=False),
                 pallas_tpu=pallas_tpu and functools.partial(pallas_tpu, interpret=False))
  if impl == "auto":
    if not cpu_kernels_on():
      kernels["cpu"] = None
    branches = {platform: kernels[family] for platform, family in AUTO.items() if kernels[family] is not None}
    if not branches:
      return reference(*args)
    return jax.lax.platform_dependent(*args, default=reference, **branches)
  if impl in _INTERPRET:
    kernel = {"pallas": pallas, "pallas_tpu": pallas_tpu}[_INTERPRET[impl]]
    kernel = kernel and functools.partial(kernel, interpret=True)
  else:
    kernel = kernels.get(impl)
  return (kernel or reference)(*args)


def _layout_ok(check, *args) -> bool:
  try:
    check(*args)
  except ValueError:
    return False
  return True


def triton_supports(bits: int, group_size: int, head_dim: int) -> bool:
  """Whether the Triton mixed attention takes this layout (its default block)."""
  return _layout_ok(triton_common.check_quant_layout, bits, group_size, head_dim, MixedAttentionBlock().block_s)


def tpu_block(group_size: int) -> MixedAttentionTPUBlock:
  """The Mosaic kernel's block for key groups of `group_size`: 512 slots, or 8 groups where that is more."""
  need = 8 * group_size
  return MixedAttentionTPUBlock(block_s=max(512, -(-need // 128) * 128))


def tpu_supports(bits: int, group_size: int, head_dim: int) -> bool:
  """Whether the Mosaic TPU mixed attention takes this layout (`tpu_block`)."""
  return _layout_ok(lambda: tpu_common.check_quant_layout(bits, group_size, head_dim,
                                                          tpu_block(group_size).block_s))


def _mixed_supports(bits: int, group_size: int, head_dim: int) -> dict:
  """family -> whether its mixed attention kernel takes this layout."""
  return dict(cpu=cpu_attention.supports(bits, group_size, head_dim), pallas=triton_supports(bits, group_size, head_dim),
              pallas_tpu=tpu_supports(bits, group_size, head_dim))


def check_layout(impl: str, bits: int, group_size: int, head_dim: int) -> None:
  """Refuses an explicit kernel family whose mixed attention kernel does not take the low-bit layout."""
  check_impl(impl)
  family = _INTERPRET.get(impl, impl)
  if family in ("cpu", "pallas", "pallas_tpu") and not _mixed_supports(bits, group_size, head_dim)[family]:
    raise ConfigError(f"attention_impl={impl!r}: its mixed attention kernel does not take {bits=}, "
                      f"{group_size=}, {head_dim=} (use 'auto' or 'jnp')")


def mixed_attention(impl: str, reference, q, low, lowbit_len, exclude, extra_k, extra_v, extra_mask, *,
                    bits: int, group_size: int, sm_scale: float, prob_rows: int | None = None,
                    lowbit_values: bool = True, probabilities: bool = True):
  """The mixed low-bit + 16-bit decode attention (`pallas_kernels.mixed_decode_attention`'s contract) by the
  family `impl` picks, else reference() (a function of no arguments returning what the kernels return).

  low: the low-bit cache (`lowbit.LowBit`: k/v codes, scales, zeros); extra_k / extra_v: sequences of
  [B, K, E_i, H] segments (the CPU kernel reads them in place; the Pallas kernels get them concatenated, in
  q's dtype). probabilities=False: only the output is returned (by every branch, the reference included)."""
  h = q.shape[-1]
  kw = dict(bits=bits, group_size=group_size, sm_scale=sm_scale, prob_rows=prob_rows, lowbit_values=lowbit_values)
  low_args = (low.k_codes, low.k_scale, low.k_zero, low.v_codes, low.v_scale, low.v_zero, lowbit_len, exclude)
  pick = (lambda res: res) if probabilities else (lambda res: res[0])

  def cpu():
    return pick(cpu_attention.mixed_decode_attention(q, *low_args, tuple(extra_k), tuple(extra_v), extra_mask,
                                                     **kw))

  def joined():
    return (jnp.concatenate([x.astype(q.dtype) for x in extra_k], axis=2),
            jnp.concatenate([x.astype(q.dtype) for x in extra_v], axis=2))

  def pallas(interpret):
    return pick(triton_mixed(q, *low_args, *joined(), extra_mask, interpret=interpret, **kw))

  def pallas_tpu(interpret):
    return pick(tpu_mixed(q, *low_args, *joined(), extra_mask, interpret=interpret, block=tpu_block(group_size),
                          **kw))

  return choose(impl, reference,
                cpu=cpu if cpu_attention.applies(bits, group_size, h) else None,
                pallas=pallas if triton_supports(bits, group_size, h) else None,
                pallas_tpu=pallas_tpu if tpu_supports(bits, group_size, h) else None)


def dense_attention(impl: str, reference, q, k, v, lengths, sm_scale: float):
  """The full cache's decode attention (`cpu_kernels.dense_attention` where it applies) or reference(q, k, v,
  lengths)."""
  rows = q.shape[2] // k.shape[1] * q.shape[1]
  kernel = lambda q, k, v, lengths: cpu_dense.decode_attention(q, k, v, lengths + 1, sm_scale)  # noqa: E731
  return choose(impl, reference, q, k, v, lengths,
                cpu=kernel if cpu_dense.applies(k.dtype, q.shape[-1], rows) else None)


def prefill_attention(impl: str, reference, q, k, v, lengths, sm_scale: float):
  """The prompt's causal attention (`cpu_kernels.prefill_attention` where it applies) or reference(q, k, v,
  lengths)."""
  kernel = lambda *a: cpu_prefill.causal_attention(*a, sm_scale)    # noqa: E731
  return choose(impl, reference, q, k, v, lengths,
                cpu=kernel if cpu_prefill.applies(q.shape[-1]) else None)


def top_k(scores, k: int, impl: str = "auto"):
  """int32 indices of `lax.top_k(scores, k)`: the XLA:CPU kernel for float32 scores, else lax.top_k (XLA:CPU's
  TopK sorts the whole axis: 10.6 ms for SmolLM2's 49152 logits, k = 3)."""
  if scores.dtype != jnp.float32:
    return jax.lax.top_k(scores, k)[1].astype(jnp.int32)
  return choose(impl, lambda y: select.top_k_indices_reference(y, k), scores,
                cpu=(lambda y: select.top_k_indices(y, k)) if select.applies() else None)


def scatter_top_k(impl: str, reference, low, extra, pos, limit, k: int):
  """κ's choice from an attention's two probability parts: the XLA:CPU fused scatter + top-k, or
  reference(low, extra, pos, limit)."""
  return choose(impl, reference, low, extra, pos, limit,
                cpu=(lambda *a: select.scatter_top_k(*a, k)) if select.applies() else None)


def take_rows(buf, idx, impl: str = "auto"):
  """Rows of buf [B, K, S, H] at idx [B, K, X]: the XLA:CPU row copy, or XLA's gather."""
  return choose(impl, select.take_rows_reference, buf, idx, cpu=select.take_rows if select.applies() else None)


def greedy(x, impl: str = "auto"):
  """The greedy token of logits [..., V] -> int32 [...]: the XLA:CPU argmax kernel for float32 logits, else
  jnp.argmax."""
  if x.dtype != jnp.float32 or x.ndim < 1 or x.shape[-1] == 0:
    return jnp.argmax(x, axis=-1).astype(jnp.int32)
  return choose(impl, select.argmax_reference, x, cpu=select.argmax if select.applies() else None)


def ring_keys(ring_k, k_codes, k_scale, k_zero, lengths, *, bits: int, group_size: int, dtype=jnp.float32,
              impl: str = "auto"):
  """The low-bit ring's key columns (`cpu_kernels.ring_keys`' contract): its kernel where it `applies`, else its
  reference."""
  kw = dict(bits=bits, group_size=group_size, dtype=dtype)
  return choose(impl, functools.partial(cpu_ring.ring_keys_reference, **kw), ring_k, k_codes, k_scale, k_zero,
                lengths.astype(jnp.int32), cpu=(functools.partial(cpu_ring.ring_keys, **kw)
                              if cpu_ring.applies(ring_k, k_scale, dtype) else None))


def dense(x, *ws, transposed: bool = False, impl: str = "auto"):
  """x [..., D] times each weight [D, N_i] (or [N_i, D] when `transposed`) -> [..., N_i]: the model's weight
  products (an array for one weight, a tuple for several: q/k/v or gate/up, which share their input). On the CPU,
  float32 operands with few rows (a decoding step: `cpu_kernels.dense_applies`) take `skinny_matmul`, one call for
  all the weights; everything else (prefill, bf16 weights, other platforms) is XLA's dot."""
  kernel = functools.partial(ck.dense_kernel, transposed=transposed)
  outs = choose(impl, functools.partial(ck.dense_reference, transposed=transposed), x, *ws,
                cpu=kernel if ck.dense_applies(x, ws, transposed) else None)
  return outs[0] if len(ws) == 1 else outs
