#!/usr/bin/env bash
# The GPU check, in one go (about 9 minutes on one H100 or H200): the demo trained on the GPU
# (bf16, its preflight included), then a Qwen2.5-0.5B-shaped model with random weights (no
# download) -- rollout tokens/s for each engine present (grpolab's decode step on its static
# cache among them), a GRPO step's time split and peak memory (uneven completions padded and
# packed among them), the log-prob table at real shapes, and a 2-process FSDP2 run when
# more than one GPU is visible. Every part has its own time limit; a part that fails or whose
# component is missing is reported and the rest still runs.
#
#     bash bench/gpu_check.sh OUT_DIR      # tables as markdown and JSON in OUT_DIR
set -uo pipefail

OUT=${1:?usage: bench/gpu_check.sh OUT_DIR}
mkdir -p "$OUT"
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
[ -x .venv/bin/python ] && [ -z "${PYTHON:-}" ] && PY=.venv/bin/python
SUMMARY="$OUT/summary.md"
: >"$SUMMARY"

say() { echo "$*" | tee -a "$SUMMARY"; }

# part NAME SECONDS CMD...: run with a limit; record ok / failed (rc) / timed out.
part() {
    local name=$1 limit=$2
    shift 2
    say ""
    say "## $name"
    local tic=$SECONDS
    timeout --kill-after=10 "$limit" "$@" >"$OUT/$name.log" 2>&1
    local rc=$?
    local took=$((SECONDS - tic))
    tail -n 40 "$OUT/$name.log" | grep -E '^\||skipped|failed|Error' >>"$SUMMARY" || true
    grep -E '^\|' "$OUT/$name.log" || tail -n 5 "$OUT/$name.log"
    case $rc in
    0) say "($name: ok, ${took} s)" ;;
    124 | 137) say "($name: TIMED OUT after ${limit} s; partial log in $name.log)" ;;
    *) say "($name: FAILED rc=$rc after ${took} s; see $name.log)" ;;
    esac
}

say "# grpolab GPU check $(date -u +%Y-%m-%dT%H:%M:%SZ)"
if ! command -v nvidia-smi >/dev/null; then
    say "no nvidia-smi: no NVIDIA GPU on this machine; nothing to check"
    exit 1
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpus.csv"
NGPU=$(nvidia-smi --list-gpus | wc -l)
"$PY" - <<'EOF' | tee -a "$SUMMARY"
import importlib, torch, transformers
print(f"torch {torch.__version__} (cuda {torch.version.cuda}), transformers {transformers.__version__}")
for name in ("vllm", "peft", "flash_attn"):
    try:
        mod = importlib.import_module(name)
        print(f"{name} {getattr(mod, '__version__', '?')}")
    except Exception as e:
        print(f"{name}: not available ({type(e).__name__})")
EOF
say "GPUs visible: $NGPU"

# The demo on the GPU as a user runs it: runtime.precision=auto picks bf16 there, so its
# preflight is the bf16 one, and its held-out accuracy is bf16's beside the CPU's fp32.
part demo_cuda 200 "$PY" -m grpolab train --overwrite output_dir="$OUT/demo-run" \
    model.device=cuda logging.progress=false
grep -ho '"eval_accuracy": [0-9.]*' "$OUT/demo-run/metrics.jsonl" 2>/dev/null | tail -n 5 >>"$SUMMARY"
part train 200 "$PY" bench/gpu_check.py train "$OUT"
part rollout_hf 120 "$PY" bench/gpu_check.py rollout-hf "$OUT"
part rollout_vllm 120 "$PY" bench/gpu_check.py rollout-vllm "$OUT"
part logprobs 90 "$PY" bench/logprobs.py --device cuda --dtype bfloat16 --shapes qwen0.5b \
    --variants naive,fused,floor --repeats 3 --json "$OUT/logprobs.json"

if [ "$NGPU" -gt 1 ]; then
    part fsdp2 90 "$PY" -m torch.distributed.run --nproc_per_node 2 -m grpolab train \
        --overwrite output_dir="$OUT/fsdp2-run" max_steps=3 model.device=cuda \
        parallel.strategy=fsdp batch.prompts_per_step=8 eval.eval_examples=0 \
        logging.progress=false
    grep -h '"step"' "$OUT/fsdp2-run/metrics.jsonl" 2>/dev/null | tail -n 3 >>"$SUMMARY"
else
    say ""
    say "## fsdp2"
    say "(skipped: one GPU visible; the 2-rank FSDP2 path is tested on CPU by tests/test_distributed.py)"
fi

say ""
say "tables: $OUT/*.md and $OUT/*.json; logs: $OUT/*.log"
