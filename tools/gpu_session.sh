#!/usr/bin/env bash
# One device call's work, in parts: tools/gpu_session.sh PART [PART...]; results under $OUT (or ./gpu-out).
#
#   setup    the carried wheels (.whl/) and TandemLLM itself (not editable) into /tmp/site; versions; the card
#   tests    the GPU tests: the CUDA runners' conformance and checks, the kernels against their references,
#            `tandem serve --device cuda` end to end, the side lane on the CUDA path
#   serve    tools/bench_serve_gpu.py at the 27B shape (the checkpoint written on the machine's disk)
#   engine   tools/bench_gpu.py engine with the shipped defaults (no tuning)
#   lfm25    the LFM2 GPU tests (triton_moe, LfmCudaRunner, tandem serve on CUDA), then tools/bench_lfm25_gpu.py
#            at the 24B-A2B and 8B-A1B-like shapes against transformers (budget LFM25_BUDGET, default 240 s)
#   lfmfuse  the fused LFM2 step's GPU tests (route_plan, combine_add_norm, the partials' consumers, verify =
#            decode at the 24B-A2B widths), then the lfm25 part (profile it apart: PROFILE_TARGETS=lfm24,lfm8)
#   mtp      the graphed MTP head's GPU tests (test_qwen38_mtp_gpu.py), then tools/bench_mtp.py at the 27B shape,
#            graphs against eager, depths 1..4, within MTP_BUDGET seconds (default 150); $OUT/mtp.md, mtp.log
#   flashnext  the Flash-Next GPU tests (test_flashnext_gpu.py: its kernels, FlashNextCudaRunner with graphs), then
#            tools/bench_flashnext_gpu.py at the published shape (experts cut to 224 of 512) against transformers
#            (budget FLASHNEXT_BUDGET, default 300 s); $OUT/flashnext.md, flashnext.json
#   profile  tools/profile_gpu.py: the decode and verify steps kernel by kernel (PROFILE_TARGETS of lfm24, lfm8,
#            qwen27, flashnext; default
#            lfm24,lfm8,qwen27); $OUT/profile.md, profile.json
#
# The device machine has no registry: .whl/ holds what its image lacks (fastapi, uvicorn, pydantic,
# llguidance, gguf, openai, jsonschema, transformers 5.24.0, flash-linear-attention, ...).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PATH=/tmp/site/bin:$PATH PYTHONPATH=/tmp/site
start=$(date +%s)
say() { echo "[$(( $(date +%s) - start ))s] $*"; }

setup() {
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        || { echo "wheel install failed"; exit 3; }
    python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-compile --upgrade --target /tmp/site \
        . plugins/llama plugins/qwen38_27b plugins/drafters plugins/lfm25 plugins/flashnext 2>&1 | tail -3
    python3 -c "import torch, triton, transformers, fastapi, tandem_core, tandem_qwen38; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__, torch.cuda.get_device_name())"
    tandem plugins | head -12
    nvidia-smi --query-gpu=name,memory.used,memory.total,clocks.sm --format=csv,noheader
    df -h /tmp . | tail -2
}

tests() {
    timeout 420 python3 -m pytest -q -x -p no:cacheprovider -o addopts="" \
        ${TESTS:-plugins/qwen38_27b/tests/test_qwen38_gpu.py tests/test_gpu_kernels.py \
        plugins/llama/tests/test_llama_runner.py::TestLlamaCudaRunner tests/test_server_gpu.py \
        tests/test_side_lane.py} 2>&1 | tee "$OUT/tests.log" | tail -40
}

serve() {
    timeout 560 python3 tools/bench_serve_gpu.py --out "$OUT/serve" --ckpt /tmp/ckpt27b --shape 27b \
        --budget ${SERVE_BUDGET:-480} ${SERVE_ARGS:-} 2>&1 | tee "$OUT/serve.log" | tail -60
    cp "$OUT/serve/serve.md" "$OUT/serve/serve.json" "$OUT/" 2>/dev/null
}

engine() {
    timeout 560 python3 tools/bench_gpu.py engine --out "$OUT/engine" --no-tune --budget ${ENGINE_BUDGET:-420} \
        2>&1 | tee "$OUT/engine.log" | tail -60
    cp "$OUT/engine/engine.json" "$OUT/" 2>/dev/null
}

lfm25() {
    timeout ${LFM25_TEST_TIMEOUT:-240} python3 -m pytest -q -x -p no:cacheprovider -o addopts="" \
        ${LFM25_TESTS:-tests/test_gpu_moe.py plugins/lfm25/tests/test_lfm25_gpu.py} 2>&1 \
        | tee "$OUT/lfm25-tests.log" | tail -40
    timeout $(( ${LFM25_BUDGET:-240} + 60 )) python3 tools/bench_lfm25_gpu.py --out "$OUT/lfm25" \
        --budget ${LFM25_BUDGET:-240} ${LFM25_ARGS:-} 2>&1 | tee "$OUT/lfm25-bench.log" | tail -40
    cp "$OUT/lfm25/lfm25.md" "$OUT/lfm25/lfm25.json" "$OUT/" 2>/dev/null
}

lfmfuse() {
    # the fused LFM2 step (router partials into route_plan, K-split projections added in their consumers): its
    # kernel tests first (~2 min), then the lfm25 part without them (every other LFM2 GPU test, the benchmark); the
    # profile is its own call (PROFILE_TARGETS=lfm24,lfm8 tools/gpu_session.sh setup profile): one call's 10 min
    local new=(tests/test_gpu_moe.py::test_route_plan_from_partials_equals_route_and_the_plan
               tests/test_gpu_moe.py::test_grouped_experts_on_route_plans_blocks_equals_the_plan_kernel
               tests/test_gpu_moe.py::test_route_plan_replays_in_a_cuda_graph
               tests/test_gpu_moe.py::test_combine_add_norm_equals_the_combine_then_the_add_norm
               plugins/lfm25/tests/test_lfm25_gpu.py::test_the_partials_consumers_equal_them_reduced
               plugins/lfm25/tests/test_lfm25_gpu.py::test_wide_verify_rows_are_the_decode_rows_and_the_self_check_passes
               plugins/lfm25/tests/test_lfm25_gpu.py::test_wide_logits_track_the_fp32_reference_runner)
    timeout 300 python3 -m pytest -q -x -p no:cacheprovider -o addopts="" "${new[@]}" 2>&1 \
        | tee "$OUT/lfmfuse-tests.log" | tail -30
    LFM25_TESTS="tests/test_gpu_moe.py plugins/lfm25/tests/test_lfm25_gpu.py $(printf -- '--deselect=%s ' "${new[@]}")" \
        lfm25
}

flashnext() {
    timeout ${FLASHNEXT_TEST_TIMEOUT:-300} python3 -m pytest -q -x -p no:cacheprovider -o addopts="" \
        ${FLASHNEXT_TESTS:-plugins/flashnext/tests/test_flashnext_gpu.py} 2>&1 \
        | tee "$OUT/flashnext-tests.log" | tail -40
    timeout $(( ${FLASHNEXT_BUDGET:-300} + 90 )) python3 tools/bench_flashnext_gpu.py --out "$OUT/flashnext" \
        --budget ${FLASHNEXT_BUDGET:-300} ${FLASHNEXT_ARGS:-} 2>&1 | tee "$OUT/flashnext-bench.log" | tail -40
    cp "$OUT/flashnext/flashnext.md" "$OUT/flashnext/flashnext.json" "$OUT/" 2>/dev/null
}

mtp() {
    local budget=${MTP_BUDGET:-150}
    timeout $(( budget / 2 )) python3 -m pytest -q -x -p no:cacheprovider -o addopts="" \
        plugins/qwen38_27b/tests/test_qwen38_mtp_gpu.py 2>&1 | tee "$OUT/mtp-tests.log" | tail -30
    timeout $(( budget / 2 )) python3 tools/bench_mtp.py --shape 27b --device cuda --dtype bf16 --context 4096 \
        --rounds 20 --depths 1,2,3,4 --accepted 0,3 --heads graphs,eager --budget $(( budget / 2 - 30 )) \
        --out "$OUT/mtp.md" 2>&1 | tee "$OUT/mtp.log" | tail -30
}

profile() {
    timeout ${PROFILE_BUDGET:-300} python3 tools/profile_gpu.py --out "$OUT/profile" \
        --targets ${PROFILE_TARGETS:-lfm24,lfm8,qwen27} 2>&1 | tee "$OUT/profile.log" | tail -20
    cp "$OUT/profile/profile.md" "$OUT/profile/profile.json" "$OUT/" 2>/dev/null
}

for part in "$@"; do
    say "== $part"
    "$part"
done
say "done"
