#!/usr/bin/env bash
# The GPU suite in one device call: GPU tests, then the benchmarks, then one table.
#
# Here (CPU machine), once:   bash ../shared/device/kit.sh && bash bench/gpu_suite.sh prepare
#   packs the kit into .kit/ and SmolLM2's tokenizer files into .gpu_assets/ (both git-ignored).
# There (device `run`, carry [".kit", ".gpu_assets"]):   bash bench/gpu_suite.sh
#   suite.log, tests.xml and one JSON per benchmark go to $OUT (or /tmp/pdserve-gpu). SUITE="tests decode prefill offline" picks
#   parts. Each part has its own time limit so one hang cannot eat the whole call; all four
#   together may outlast one 600 s call, so split them over two (the machine stays warm between).
# SmolLM2's real weights (tests/gpu/test_smollm2_gpu.py): its GGUF (98 MB) exceeds what one call
#   carries, so `prepare` splits it into .gpu_model_a and .gpu_model_b. While the machine stays
#   warm, before the suite's call: one call carrying [".gpu_model_a"] and one carrying
#   [".gpu_model_b"], each running `bash bench/gpu_suite.sh stash` (a later call's copy drops
#   paths an earlier call carried, so each part is kept in /tmp there); the suite joins them.
#   Without them those tests skip.
set -uo pipefail
cd "$(dirname "$0")/.."

if [ "${1:-}" = prepare ]; then
  grep -qx '/.gpu_assets/' .git/info/exclude 2>/dev/null || echo '/.gpu_assets/' >> .git/info/exclude
  mkdir -p .gpu_assets/tokenizer
  dir=$(python3 -c 'from workers.model.loader import resolve_model, DEFAULT_MODEL; print(resolve_model(DEFAULT_MODEL))')
  cp "$dir"/tokenizer.json "$dir"/tokenizer_config.json "$dir"/chat_template.jinja .gpu_assets/tokenizer/
  # The GGUF reader transformers needs, which the GPU machine's image lacks (pure Python).
  rm -rf .gpu_assets/site && mkdir -p .gpu_assets/site
  site=$(python3 -c 'import gguf, os; print(os.path.dirname(os.path.dirname(gguf.__file__)))')
  cp -r "$site"/gguf "$site"/gguf-*.dist-info .gpu_assets/site/  # its version: transformers checks it
  gguf=$(python3 -c 'from workers.model.loader import DEFAULT_MODEL, _embedded_gguf; print(_embedded_gguf(DEFAULT_MODEL))')
  for part in a b; do
    grep -qx "/.gpu_model_$part/" .git/info/exclude || echo "/.gpu_model_$part/" >> .git/info/exclude
    mkdir -p .gpu_model_$part
  done
  head -c $((56 * 2**20)) "$gguf" > .gpu_model_a/part
  tail -c +$((56 * 2**20 + 1)) "$gguf" > .gpu_model_b/part
  du -sh .gpu_assets .gpu_model_a .gpu_model_b
  exit 0
fi

SMOLLM2_PARTS=/tmp/pdserve-smollm2
if [ "${1:-}" = stash ]; then  # there: keep the GGUF part this call carried
  mkdir -p "$SMOLLM2_PARTS"
  for part in a b; do
    if [ -s .gpu_model_$part/part ]; then cp .gpu_model_$part/part "$SMOLLM2_PARTS/part_$part"; fi
  done
  ls -l "$SMOLLM2_PARTS"
  exit 0
fi

OUT=${OUT:-/tmp/pdserve-gpu}
mkdir -p "$OUT"
SUITE=${SUITE:-tests decode prefill offline}  # also: decode_tc (tensor-core decode, JIT ~80 s),
# kv2 (NIXL between two GPUs: a kind with 2+ GPUs), decode_tp (decode steps over two GPUs, tensor
# parallel, CUDA graphs against eager: also a kind with 2+ GPUs), serving (HTTP through Ray Serve,
# 1 prefill + 1 decode replica against 2 colocated ones, Llama-3-8B shapes: 2+ GPUs), compare (each layer's FlashInfer attention in
# the engine against the torch reference, on SmolLM2's real weights: needs the stashed GGUF),
# attn (FlashInfer's decode attention alone, planned each way it can be, against its KV floor),
# kvstaged (a heterogeneous-TP staged read of VRAM against the direct one: on one GPU its bytes
# are checked, its speed is UCX's TCP fallback; on two, the decode rank has a GPU of its own)
KIT_ONLY="flashinfer deps nixl ray" source .kit/setup.sh  # nixl, ray: the VRAM hand-off
export PYTHONUNBUFFERED=1 PDSERVE_TOKENIZER_DIR=$PWD/.gpu_assets/tokenizer
export PDSERVE_CACHE=/tmp/pdserve-cache TOKENIZERS_PARALLELISM=false
export PYTHONPATH=$PWD/.gpu_assets/site:$PYTHONPATH
if [ -s "$SMOLLM2_PARTS/part_a" ] && [ -s "$SMOLLM2_PARTS/part_b" ]; then
  export PDSERVE_SMOLLM2_GGUF=$SMOLLM2_PARTS/SmolLM2-135M-Instruct.Q4_1.gguf
  cat "$SMOLLM2_PARTS/part_a" "$SMOLLM2_PARTS/part_b" > "$PDSERVE_SMOLLM2_GGUF"
fi
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm --format=csv,noheader
python3 -c 'import torch, transformers, flashinfer; print("torch", torch.__version__,
  "transformers", transformers.__version__, "flashinfer", flashinfer.__version__)'
tok=(--tokenizer-dir "$PDSERVE_TOKENIZER_DIR")
status=0
DEADLINE=${DEADLINE:-550}  # seconds into this script by which every part must have ended
part() {  # part NAME SECONDS COMMAND...: run one part with a limit, log it, remember failures
  local name=$1 limit=$2; shift 2
  case " $SUITE " in *" $name "*) ;; *) return 0 ;; esac
  [ $((DEADLINE - SECONDS)) -lt "$limit" ] && limit=$((DEADLINE - SECONDS))
  [ "$limit" -gt 10 ] || { echo "SUITE $name skipped: no time left"; status=1; return 0; }
  local t0=$SECONDS
  echo "SUITE $name: $*" | tee -a "$OUT/suite.log"
  timeout -k 10 "$limit" "$@" 2>&1 | tee -a "$OUT/suite.log"
  local rc=${PIPESTATUS[0]}
  echo "SUITE $name rc=$rc in $((SECONDS - t0)) s"
  [ "$rc" = 0 ] || status=1
}
part tests 330 python3 -m pytest tests/gpu tests/e2e/test_nixl_transfer.py -m gpu -q -rs -p no:cacheprovider \
  --junitxml="$OUT/tests.xml"
part decode 180 python3 -m bench.bench_decode "${tok[@]}" --profile --json "$OUT/decode.json"
part decode_tp 200 python3 -m bench.bench_decode "${tok[@]}" --tp 2 --cases 1x1024,16x1024,64x2048 --profile \
  --json "$OUT/decode_tp.json"
part prefill 80 python3 -m bench.bench_prefill "${tok[@]}" --profile --json "$OUT/prefill.json"
part offline 170 python3 -m bench.bench_offline_gpu "${tok[@]}" --json "$OUT/offline.json"
part kv2 150 python3 bench/bench_kv_transfer.py --device cuda --num-gpus 1 --layout llama3-8b \
  --tokens 512,2048,8192 --json
staged=(--device cuda --layout llama3-8b --tp 2)
[ "$(nvidia-smi -L | wc -l)" -ge 2 ] && staged+=(--decode-own-gpu)  # reads over NVLink
part kvstaged 120 python3 bench/bench_kv_staged.py "${staged[@]}"
part serving 420 python3 bench/bench_serving.py --device cuda --tokenizer-dir "$PDSERVE_TOKENIZER_DIR" \
  --shape llama3-8b --num-prompts 200 --input-len 2048 --output-len 256 --range-ratio 0.25 \
  --request-rate 8,12 --goodput ttft:500 tpot:25 --json "$OUT/serving.json"
part compare 120 python3 -m bench.compare_attention_backends
part attn 90 python3 -m bench.bench_decode_attention --json "$OUT/attn.json"
part decode_tc 240 python3 -m bench.bench_decode "${tok[@]}" \
  --set kernels.flashinfer_decode_tensor_cores=true --json "$OUT/decode_tc.json"
if compgen -G "$FLASHINFER_WORKSPACE_BASE/.cache/flashinfer/*/*/cached_ops/*/*.so" >/dev/null; then
  kit_save_jit  # modules the prebuilt archive lacked: bring $OUT/fi-aot-*.tar.xz back to .kit/
fi
python3 -m bench.gpu_table "$OUT"
exit $status
