#!/usr/bin/env bash
# The kernels' and the engine's invariance and correctness tests with the C++ kernels built for each
# instruction-set target named (gcc -march values; RUVLLM_KERNEL_ARCH, src/ruvllm/cpu_build.py), one
# after another: the paths a CPU other than this one takes, tested on this one. A target this CPU
# cannot run fails at its first kernel call (SIGILL): name only what it has.
#   scripts/test_isa.sh                      # x86-64 (the plain C++ paths) and x86-64-v3 (AVX2, FMA)
#   scripts/test_isa.sh sapphirerapids       # AVX-512 VNNI's dot products, on a CPU that has them
# Each target's first run builds its kernels (~70-90 s of CPU) into the usual cache, under its own name.
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/python ] || scripts/bootstrap.sh
TESTS=(tests/unit/test_cpu_matmul.py tests/unit/test_cpu_matmul_order.py tests/unit/test_cpu_attention_kernel.py
       tests/unit/test_cpu_ops.py tests/unit/test_lora_kernel.py tests/unit/test_token_mask.py
       tests/unit/test_learning_fused.py tests/unit/test_dense_linear.py tests/unit/test_packed_backward.py
       tests/unit/test_sliding_window_attention.py tests/e2e/test_invariants.py
       tests/e2e/test_logits_vs_transformers.py tests/e2e/test_greedy_vs_transformers.py)
archs=("$@")
[ ${#archs[@]} -gt 0 ] || archs=(x86-64 x86-64-v3)
status=0
for arch in "${archs[@]}"; do
  isa=$(RUVLLM_KERNEL_ARCH=$arch .venv/bin/python -c "from ruvllm.cpu_build import target_isa; print(' '.join(target_isa()) or 'plain C++')")
  echo "== -march=$arch: $isa"
  RUVLLM_KERNEL_ARCH=$arch .venv/bin/python -I -W ignore src/ruvllm/cpu_build.py
  RUVLLM_KERNEL_ARCH=$arch OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} .venv/bin/python -m pytest "${TESTS[@]}" \
    -n "${RUVLLM_TEST_WORKERS:-2}" --dist loadfile -q -rs -p no:warnings || status=1
done
exit $status
