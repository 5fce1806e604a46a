#!/usr/bin/env bash
# Train the block drafter for the default model (SmolLM2-135M-Instruct) on one H200, then benchmark it on CUDA.
#
#   tools/train_block_drafter_gpu.sh PART [PART...]        results under $OUT (or ./gpu-out)
#
#   split    (run HERE, not on the device) cut the pulled GGUF into .smol/part-?? of 30 MiB (the device has no
#            network and a call carries at most 64 MiB); add /.smol/ to .git/info/exclude first
#   stash    (device) copy the carried .smol/part-?? to /tmp/tandem-block/parts/, which outlives the call while
#            the machine stays warm (two parts a call, see below)
#   setup    (device) tools/gpu_session.sh setup: the carried wheels (.whl/) and TandemLLM into /tmp/site
#   model    (device) the GGUF into $TANDEM_HOME/models/smollm2-135m/: `tandem pull` when the hub answers, else the
#            stashed parts joined; its sha256 checked against the registry's
#   data     tandem train-drafter --stage data on cuda: $BATCH prompts a forward (0: auto, 256 on CUDA) through the
#            Llama runner's batched generator, $WORKERS process(es), for $DATA_BUDGET seconds at most; the shards
#            hold tokens only (the train stage computes the features)
#   train    tandem train-drafter --stage train on cuda, for $TRAIN_BUDGET seconds at most (resumes); each step's
#            features come from one batched forward of the target
#   bench    tools/bench_block_drafter.py on cuda (held-out code, agent and chat prompts): $OUT/block-drafter.md
#   collect  the drafter (config.json, model.safetensors), log.jsonl, the registry snippet (size, sha256) to $OUT
#
# Every stage resumes: a second call continues the shards and the training from their last checkpoint (the work
# folder, /tmp/tandem-block/work, stays while the machine is warm). The default budgets fit data and training in
# one 10-minute call, the benchmark in the next:
#
#   call 1: carry [.smol/part-aa, .smol/part-ab]        command: tools/train_block_drafter_gpu.sh stash
#   call 2: carry [.smol/part-ac, .smol/part-ad, .whl]  command: tools/train_block_drafter_gpu.sh stash setup \
#                                                                model data train collect
#   call 3: (nothing carried)                           command: tools/train_block_drafter_gpu.sh bench collect
#   (30 MiB parts: 2 x 30 MiB + the 2.4 MB tree, then 30 + 4 + 26 MB of wheels + the tree, each under 64 MiB;
#   call 2 runs about 9.5 minutes: setup ~40 s, data 280 s + the load, train 200 s + the load; collect brings
#   the drafter back even if the machine is gone before call 3, which then needs the setup again)
#
# How many samples call 2 makes: ESTIMATED from the structure, not yet measured. A decode step of 256 rows of
# SmolLM2-135M is about 800 eager kernel launches (30 layers) plus reading every row's KV (about 6 GB a step at
# 1000 columns), say 10-20 ms; 256 answers of up to 256 tokens then take about 3-5 s (plus the prompts' forward
# and ~0.5 s of prompt building on the CPU), about 50-80 samples a second: 280 s should give ~14K-22K samples,
# 70-100x the 210 the one-prompt-a-time stage made in 185 s with 8 workers. The data record in log.jsonl
# (samples, seconds) is the measurement; raise DATA_BUDGET (or run `data` again: it resumes) for more.
# Training then sees ~650 steps of 16 samples in 200 s (0.3 s a step in session 6, plus one batched target
# forward a step for the features): about half an epoch of 20K samples, so the steps, not the data, limit it.
# Batch-256 answers are bf16 and may differ from the serving engine's greedy text where two logits tie within
# bf16 rounding (docs/speculation.md, section 7): fine for labels.
#
# Shipping the result (here, after the run): copy $OUT/drafter-config.json and $OUT/drafter-model.safetensors to
# tandem_core/shipped/models/smollm2-135m/drafters/block/config.json and .../model.safetensors, paste
# $OUT/registry-snippet.yaml into that model.yaml (top level), add "block" to its methods, and put
# $OUT/block-drafter.md's section into docs/measurements/block-drafter.md; `tandem registry --check` then checks
# the sizes, `tandem pull` copies and verifies the files, and `--spec auto` (the default) drafts with them.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PATH=/tmp/site/bin:$PATH PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
BASE=${BASE:-/tmp/tandem-block}
export TANDEM_HOME=${TANDEM_HOME:-$BASE/home}
WORK=${WORK:-$BASE/work}
PARTS_SRC=${PARTS_SRC:-.smol}   # where split writes the parts and stash reads them (in the checkout)
MODEL=smollm2-135m
GGUF_NAME=SmolLM2-135M-Instruct.Q4_1.gguf
DEVICE=${DEVICE:-cuda}           # cpu: the same flow on the CPU (a smoke test, tiny budgets)
WORKERS=${WORKERS:-1}            # processes answering prompts (1: one batched generator owns the GPU)
BATCH=${BATCH:-0}                # prompts a forward; 0: auto (256 on CUDA, 8 on the CPU); 1: the old one-at-a-time path
SAMPLES=${SAMPLES:-40000}        # an upper bound: the budget stops the stage first
DATA_BUDGET=${DATA_BUDGET:-280}
TRAIN_BUDGET=${TRAIN_BUDGET:-200}
STEPS=${STEPS:-8000}
BENCH_PROMPTS=${BENCH_PROMPTS:-6}
MAX_NEW=${MAX_NEW:-256}
MAX_PROMPT=${MAX_PROMPT:-768}
SLACK=${SLACK:-120}             # seconds a stage may run past its budget (the model loads, the last sample)
start=$(date +%s)
say() { echo "[$(( $(date +%s) - start ))s] $*"; }
sha_of_registry() { python3 -c "import yaml,sys; print(yaml.safe_load(open('tandem_core/shipped/models/$MODEL/model.yaml'))['source']['sha256'])"; }

split() {
    local src=${GGUF:-.tandem-test-cache/models/$MODEL/$GGUF_NAME}
    [ -f "$src" ] || { echo "no $src: run 'TANDEM_HOME=.tandem-test-cache tandem pull $MODEL' first"; exit 2; }
    mkdir -p "$PARTS_SRC" && rm -f "$PARTS_SRC"/part-*
    command split -b 30M "$src" "$PARTS_SRC"/part-
    ls -l "$PARTS_SRC"
}

stash() {
    mkdir -p "$BASE/parts"
    cp -v "$PARTS_SRC"/part-* "$BASE/parts/" 2>/dev/null || echo "no $PARTS_SRC/part-* carried in this call"
    ls -l "$BASE/parts"
}

setup() {
    tools/gpu_session.sh setup
}

model() {
    local dir=$TANDEM_HOME/models/$MODEL want
    want=$(sha_of_registry)
    mkdir -p "$dir"
    if [ ! -f "$dir/$GGUF_NAME" ]; then
        if ls "$BASE"/parts/part-* >/dev/null 2>&1; then
            cat "$BASE"/parts/part-* > "$dir/$GGUF_NAME.part" && mv "$dir/$GGUF_NAME.part" "$dir/$GGUF_NAME"
        else
            timeout 90 tandem pull "$MODEL" --quiet || { echo "no GGUF: no network, and no parts stashed"; exit 3; }
        fi
    fi
    local got
    got=$(sha256sum "$dir/$GGUF_NAME" | cut -d' ' -f1)
    [ "$got" = "$want" ] || { echo "GGUF sha256 $got is not the registry's $want"; rm -f "$dir/$GGUF_NAME"; exit 3; }
    say "model $dir/$GGUF_NAME verified"
}

data() {
    timeout $(( DATA_BUDGET + SLACK )) tandem train-drafter --model "$MODEL" -o "$WORK" --device "$DEVICE" --stage data \
        --samples "$SAMPLES" --max-new "$MAX_NEW" --max-prompt "$MAX_PROMPT" --workers "$WORKERS" --batch "$BATCH" --data-budget "$DATA_BUDGET" \
        2>&1 | grep -v '^\s*$' | tail -20
}

train() {
    timeout $(( TRAIN_BUDGET + SLACK )) tandem train-drafter --model "$MODEL" -o "$WORK" --device "$DEVICE" --stage train \
        --steps "$STEPS" --train-budget "$TRAIN_BUDGET" --layers 2 --target-layers 4 --block-size 16 \
        --samples-per-step 16 --anchors 24 --lr 8e-4 --warmup 100 --eval-every 200 --checkpoint-every 400 \
        2>&1 | tail -40
}

bench() {
    timeout $(( 180 + SLACK )) python3 tools/bench_block_drafter.py --model "$MODEL" --drafter "$WORK/drafter" --device "$DEVICE" \
        --prompts "$BENCH_PROMPTS" --max-new "${BENCH_NEW:-128}" --md "$OUT/block-drafter.md" --json "$OUT/bench.json" \
        --title "H200 (trained on the H200 by tools/train_block_drafter_gpu.sh)" 2>&1 | tail -30
}

collect() {
    cp "$WORK/drafter/config.json" "$OUT/drafter-config.json"
    cp "$WORK/drafter/model.safetensors" "$OUT/drafter-model.safetensors"
    cp "$WORK/log.jsonl" "$OUT/train-log.jsonl"
    python3 - "$WORK/drafter" > "$OUT/registry-snippet.yaml" <<'EOF'
import hashlib, sys
from pathlib import Path
d = Path(sys.argv[1])
print("drafters:\n  block:\n    description: block drafter trained by tools/train_block_drafter_gpu.sh\n"
      "    source: {kind: registry, path: drafters/block}\n    files:")
for name in ("config.json", "model.safetensors"):
    b = (d / name).read_bytes()
    print(f"      {name}: {{bytes: {len(b)}, sha256: {hashlib.sha256(b).hexdigest()}}}")
EOF
    cat "$OUT/registry-snippet.yaml"
    ls -l "$OUT"
}

for part in "$@"; do
    say "== $part"
    "$part" || { say "$part failed"; exit 4; }
done
say "done"
