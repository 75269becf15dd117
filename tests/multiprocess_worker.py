"""One process of a multi-process run (tests/test_multiprocess.py launches them): joins JAX's distributed runtime
over loopback with 2 CPU devices, lays a (data=2, model=2) mesh over every process's devices so that both axes
cross processes, generates with each method named and prints (process 0) one `TOKENS name [[...]]` line each.

  multiprocess_worker.py PORT NUM_PROCESSES PROCESS_ID METHOD[,METHOD...] [--fail=P]

--fail=P: process P raises before generating, the others go on (the test checks that they stop with an error)."""
import faulthandler
import json
import sys

import jax

jax.config.update("jax_num_cpu_devices", 2)
jax.config.update("jax_cpu_collectives_implementation", "gloo")

from specache_jax import multiprocess, sharding  # noqa: E402

DEADLINE_S = 280                # under the test's bound: a hang prints its threads and ends
FAIL_MESSAGE = "fails on purpose"


def crossed_devices():
  """Every process's devices, ordered so that a row-major (2, 2) mesh puts process p's two devices at (0, 0) and
  (1, 1) for p = 0 and at (0, 1) and (1, 0) for p = 1: the data axis and the model axis both cross processes."""
  by_process = {}
  for d in sorted(jax.devices(), key=lambda d: d.id):
    by_process.setdefault(d.process_index, []).append(d)
  (a0, a1), (b0, b1) = by_process[0], by_process[1]
  return [a0, b0, b1, a1]


def main(argv):
  port, n, pid, names = argv[:4]
  faulthandler.dump_traceback_later(DEADLINE_S, exit=True)    # a hang shows where, and ends
  multiprocess.initialize(coordinator_address=f"127.0.0.1:{port}", num_processes=int(n),
                                  process_id=int(pid), heartbeat_timeout_s=10, shutdown_timeout_s=20)
  import numpy as np
  import specache_jax as sj
  from specache_jax import offload
  from jax.experimental import multihost_utils
  from tests.multiprocess_cases import METHODS, model_and_prompts
  mdl, prompts = model_and_prompts()
  mesh = sharding.make_mesh(2, 2, devices=crossed_devices())
  store = offload.make_store("numpy", 2, 4, 4, 32, 16, np.float32, mesh=mesh)   # [L, 2, B, K, S, H] in all
  if int(pid) == 0:
    print("LAYOUT " + json.dumps([[d.process_index for d in row] for row in mesh.devices]), flush=True)
    print(f"STORE {store.nbytes} {2 * 2 * 4 * 4 * 32 * 16 * 4}", flush=True)
  store.close()
  if f"--fail={pid}" in argv:
    raise RuntimeError(FAIL_MESSAGE)
  for name in names.split(","):
    method, settings = METHODS[name]
    out = sj.generate(mdl, prompts, max_new_tokens=6, stop_tokens=(), cache=sj.cache_config(method, **settings),
                      mesh=mesh)
    tokens = np.asarray(multihost_utils.process_allgather(out.tokens, tiled=True))
    if int(pid) == 0:
      print(f"TOKENS {name} " + json.dumps(tokens.tolist()), flush=True)


if __name__ == "__main__":
  main(sys.argv[1:])
