#!/usr/bin/env bash
# One prepared run on a GPU machine: build with CUDA, the test files with CUDA cases on CUDA (the
# Triton kernels for real, not interpreted; the decoder's CUDA paths in test_decoder_devices.py;
# the other tests run on CPU in CI; test_verify_split.py's two graphs replayed on two streams among them),
# bench_verify_knobs (the split kernel's launch settings side by side at B = 64, 16, 256 and 1: ticket
# prefetch, stage-2 lag, relaxed poll, chunks per work item, two programs per multiprocessor), bench_verify on a reduced grid (its default providers: the split kernel, fused_triton, and the
# one-program-per-row kernel of bench/ops/rows_kernel.py, fused_triton_rows, side by side, each also under CUDA graph replay
# at B <= 16; the device copy behind pct_of_copy), bench_e2e on random-weight models of the
# embedded pair's and feature draft's shapes (the target's GGUF does not travel; acceptance
# figures come from CPU runs), and the exactness audit of the Triton kernel (--quick). Works offline from a fresh copy
# of the repository. The limits of the tests, the audit and the five benchmarks add up to 505 s (565 s with the grace
# periods); the build, random_pair.py and the
# set-up take about a minute (on the VM: 24 s to build on 2 cores, 9 s for the random pair), and
# the embedded target's conversion up to 90 s more where its wheel is installed (not in the GPU
# image): inside one 10-minute device call. bench_verify and bench_e2e write what they measured
# when stopped at their limit (timeout then exits 124).
#
#   bash bench/gpu_check.sh [OUT_DIR]      # default: $OUT, else bench/results/gpu-<date>
#   GPU_CHECK_DRY_RUN=1 bash bench/gpu_check.sh /tmp/out   # anywhere: the files exist, the tests collect,
#                                          # every command printed, not run
#   SPECDEC_COMMIT=$(git rev-parse --short=12 HEAD) ...   # where the copy has no .git (a copied
#                                          # working tree): the commit every result row records
#
# Leaves in OUT_DIR: env.txt, build.log, tests.log, audit.log, audit-verifier-ours-triton.{txt,json}, bench_verify_knobs.{csv,txt}, bench_verify.{csv,txt,png},
# bench_e2e.{csv,txt,png}, trees/bench_e2e.{csv,txt,png} and gpu_check.log (everything printed). With $OUT set and
# no OUT_DIR given (a remote runner that returns a few files from $OUT), they are written elsewhere and packed
# into $OUT/gpu_check.tgz after every stage (and on exit), gpu_check.log copied beside it.
set -uo pipefail
cd "$(dirname "$0")/.."
if [ $# -eq 0 ] && [ -n "${OUT:-}" ]; then
    OUT_DIR=$(mktemp -d)
    pack() {  # tar exits 1 when a file changed as it read it (the log): still a good archive
        tar czf "$OUT/gpu_check.tgz.part" --warning=no-file-changed -C "$OUT_DIR" .
        [ $? -le 1 ] && mv "$OUT/gpu_check.tgz.part" "$OUT/gpu_check.tgz"
        cp "$OUT_DIR/gpu_check.log" "$OUT/gpu_check.log" 2>/dev/null || true
    }
else
    OUT_DIR=${1:-bench/results/gpu-$(date -u +%Y%m%d)}
    pack() { :; }
fi
mkdir -p "$OUT_DIR"
exec > >(tee "$OUT_DIR/gpu_check.log") 2>&1
TEE_PID=$!
# on exit: close our ends of the pipe and wait for tee to write the last lines, then pack
trap 'exec >&- 2>&-; wait $TEE_PID 2>/dev/null; pack' EXIT
PY=${PYTHON:-python3}
# GPU_CHECK_DRY_RUN=1: on any machine, print every command instead of running it, after checking that
# the files it names exist and that its test files collect (pytest --collect-only): the run prepared.
DRY_PY=$PY
if [ "${GPU_CHECK_DRY_RUN:-0}" = 1 ]; then
    PY="echo [dry-run] $PY"
    nvidia-smi() { echo "[dry-run] nvidia-smi $*"; }
fi
export PYTHONUNBUFFERED=1 TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0} MAX_JOBS=${MAX_JOBS:-16}
start=$(date +%s)
stamp() { pack; echo "[gpu_check +$(( $(date +%s) - start ))s] $*"; }

stamp "environment"
{
    date -u
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm,clocks.max.mem --format=csv
    $PY - <<'PYEOF'
import torch, triton, transformers, platform
print("python", platform.python_version(), "| torch", torch.__version__, "| cuda", torch.version.cuda,
      "| triton", triton.__version__, "| transformers", transformers.__version__)
print("device", torch.cuda.get_device_name(0), "| SMs", torch.cuda.get_device_properties(0).multi_processor_count)
PYEOF
    git rev-parse HEAD 2>/dev/null || true
} | tee "$OUT_DIR/env.txt"

stamp "build (CUDAExtension, TORCH_CUDA_ARCH_LIST=$TORCH_CUDA_ARCH_LIST)"
# --no-deps: the image has every dependency and there is no network there.
USE_CUDA=1 $PY -m pip install --no-build-isolation --no-deps --no-index -e . >"$OUT_DIR/build.log" 2>&1
build_rc=$?
if [ $build_rc -ne 0 ] && grep -q "cannot find -lcudart" "$OUT_DIR/build.log"; then
    # torch links against CUDA_HOME/lib64/libcudart.so, and infers CUDA_HOME from where nvcc is;
    # where nvcc sits outside its toolkit (seen on the CPU VMs: /usr/local/bin/nvcc, the
    # libraries in /usr/local/cuda-13.0/lib), point CUDA_HOME at the toolkit holding libcudart.so.
    for cudart in $(find /usr/local /opt /usr/lib -name libcudart.so 2>/dev/null); do
        home=$(dirname "$(dirname "$cudart")")
        [ -x "$home/bin/nvcc" ] || continue
        export CUDA_HOME=$home
        stamp "build again with CUDA_HOME=$CUDA_HOME (libcudart.so was not where torch looked)"
        USE_CUDA=1 $PY -m pip install --no-build-isolation --no-deps --no-index -e . >>"$OUT_DIR/build.log" 2>&1
        build_rc=$?
        break
    done
fi
tail -n 5 "$OUT_DIR/build.log"
$PY - <<'PYEOF'
import torch
import specdec_kernels.ops.extension as e
print("extension loaded:", e.HAS_EXT)
if e.HAS_EXT:  # the OpenMP build: its loops on torch's threads, one libgomp in the process
    torch.ops.specdec.skinny_linear(torch.ones(2, 8), torch.ones(4, 8), None)
    print("intra_op_parallel:", torch.ops.specdec.intra_op_parallel(), "| libgomp mapped:",
          sorted({l.split()[-1] for l in open("/proc/self/maps") if "gomp" in l}))
PYEOF

# The embedded target, if its wheel is installed, converted once here rather than by 8 test
# workers at a time (its tests skip when the wheel is absent, as on a machine without network).
timeout 90 $PY -c "from specdec_kernels.models.embedded import default_target_path as d; print('embedded target:', d())" 2>&1 | tail -n 1

# The test files with CUDA cases (the kernels, the CUDA op, the decoder on the GPU); the rest CI
# runs on CPU anyway. SIGINT at the limit makes pytest print its summary of
# failures and skips so far (SIGTERM would lose it); KILL 10 s later if it does not stop. Two
# threads per worker: 8 workers with torch's 16 threads each oversubscribed the 16 cores 8x.
CUDA_TESTS="python_tests/ops/kv/test_kv_cache.py python_tests/ops/verify/test_verify_exact.py python_tests/ops/verify/test_verify_properties.py
 python_tests/ops/verify/test_verify_edges.py python_tests/ops/verify/test_verify_distribution.py python_tests/ops/verify/test_verify_greedy_fast_path.py
 python_tests/ops/verify/test_verify_sampling_fast_path.py python_tests/ops/verify/test_verify_split.py python_tests/decoding/test_decoder_devices.py
 python_tests/decoding/test_decoder_triton_verify.py python_tests/bench/test_bench_verify.py python_tests/ops/verify/test_verify_contract.py python_tests/ops/verify/test_verify_packed.py
 python_tests/ops/kv/test_cpp_ops_layouts.py python_tests/integrations/test_integration_flashinfer.py
 python_tests/ops/verify/test_verify_draft_logits.py python_tests/ops/verify/test_verify_min_p.py python_tests/ops/verify/test_block_verify_kernel.py
 python_tests/ops/tree/test_tree_verify_kernel.py python_tests/ops/kv/test_gather_kv.py"
missing=0
for f in $CUDA_TESTS bench/ops/bench_verify_knobs.py bench/ops/bench_verify.py bench/decoding/random_pair.py \
         bench/decoding/bench_e2e.py; do
    [ -f "$f" ] || { echo "gpu_check: missing $f"; missing=1; }
done
[ $missing -eq 0 ] || exit 1
if [ "${GPU_CHECK_DRY_RUN:-0}" = 1 ]; then
    $DRY_PY -m pytest --collect-only -q $CUDA_TESTS 2>&1 | tail -n 1
    [ "${PIPESTATUS[0]}" -eq 0 ] || { echo "gpu_check: the CUDA test files do not collect"; exit 1; }
fi
stamp "tests on CUDA"
OMP_NUM_THREADS=2 timeout -s INT -k 10 140 $PY -m pytest $CUDA_TESTS -q -n 8 -rfEs --durations=15 -p no:cacheprovider \
    >"$OUT_DIR/tests.log" 2>&1
tests_rc=$?
tail -n 40 "$OUT_DIR/tests.log"
# The exactness audit of the Triton kernel itself (under the interpreter on a CPU it takes minutes
# for a few hundred rows, so its report comes from here): every case at --quick size, 5,000 rows a call.
stamp "specdec audit --verifier ours --backend triton --quick"
timeout -s INT -k 10 45 $PY -m specdec_kernels audit --verifier ours --backend triton --quick \
    --save "$OUT_DIR/audit-verifier-ours-triton" >"$OUT_DIR/audit.log" 2>&1
audit_rc=$?
tail -n 32 "$OUT_DIR/audit.log"
# (the files without CUDA cases run on CPU in CI: their time here goes to the split kernel's
# settings, the figures that decide its defaults; bench_verify_knobs writes each row as it is measured)
stamp "bench_verify_knobs (the split kernel's launch settings side by side)"
timeout -s INT -k 10 160 $PY bench/ops/bench_verify_knobs.py --out "$OUT_DIR"
knobs_rc=$?

stamp "bench_verify (gpu grid)"
timeout -s INT -k 10 70 $PY bench/ops/bench_verify.py --grid gpu --out "$OUT_DIR"
verify_rc=$?

stamp "bench_e2e (random weights of the default pair's and feature draft's shapes, fp32)"
PAIR=$(mktemp -d)
$PY bench/decoding/random_pair.py "$PAIR" && \
# Sized to finish inside its limit (its defaults, every K at batch 1 and 8 and both temperatures,
# would not; stopped at the limit it writes the configurations it finished): greedy, K = 2 and
# auto, 4 prompts at batch 1 and 8 at batch 8, 64 tokens, the median of 3 runs after a warm-up.
timeout -s INT -k 10 60 $PY bench/decoding/bench_e2e.py --draft "$PAIR/draft" --target "$PAIR/target" --tokenizer "$PAIR/target" \
    --feature-draft "$PAIR/feature_draft" --feature-ks 2 --ks 2,auto --batch 1,8 --temperatures 0 \
    --num-prompts 8 --batch1-prompts 4 --warmup-tokens 8 \
    --device cuda --dtype fp32 --out "$OUT_DIR" --repeats 3 --max-new-tokens 64
e2e_rc=$?

# Trees against chains on the GPU, where a forward over 16-32 positions should cost about what
# one over 5 does (on the CPU it costs 1.2-10x): the target's step per tree shape is the figure
# (random weights: acceptance comes from the CPU runs). Batch 1, greedy, 2 prompts x 32 tokens.
stamp "bench_e2e trees (random weights, fp32)"
timeout -s INT -k 10 30 $PY bench/decoding/bench_e2e.py --draft "$PAIR/draft" --target "$PAIR/target" --tokenizer "$PAIR/target" \
    --ks 2,4 --tree-shapes "2,1,1,1;4,1,1,1;8,1,1,1;dynamic:32,4,4" --methods specdec,specdec_tree --batch 1 \
    --temperatures 0 --num-prompts 2 --warmup-tokens 4 --device cuda --dtype fp32 --out "$OUT_DIR/trees" \
    --repeats 1 --max-new-tokens 32
trees_rc=$?

stamp "done: build=$build_rc tests=$tests_rc audit=$audit_rc knobs=$knobs_rc bench_verify=$verify_rc bench_e2e=$e2e_rc trees=$trees_rc"
[ $build_rc -eq 0 ] && [ $tests_rc -eq 0 ] && [ $audit_rc -eq 0 ] && [ $knobs_rc -eq 0 ] && [ $verify_rc -eq 0 ] && [ $e2e_rc -eq 0 ]
