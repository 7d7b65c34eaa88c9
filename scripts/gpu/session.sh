#!/usr/bin/env bash
# One device call: every GPU check that needs no TransformerEngine, in priority order, each
# step bounded so that the call ends inside its limit and what was measured comes back.
#
#   carry [".whl"] (transformers as constraints.txt pins it, liger-kernel), then
#   [STEPS="verify pytest ..."] [PYTEST_FILES="tests/..."] bash scripts/gpu/session.sh [seconds]
#
# (default: every step that needs no TransformerEngine, 540 seconds; the steps: doctor bench
# head-memory verify pytest bench-7b qkv rotary check-liger adopt-liger; named in STEPS only: the peers
# at 7B, peer-compiled-7b peer-liger-7b (PEER_SEQ=256 or 1024); reprove (verify, pytest,
# adopt-liger and check-liger at once, the verification in VERIFY_SHARDS processes);
# pairs-256 / pairs-1024 (the original beside each of PAIRS_256 / PAIRS_1024 at Llama-2-7B's
# layer shape, LAYERS_256 / LAYERS_1024 layers, batch 8, one process per pair); with TE installed
# (stage_te.sh), also te-7b-bf16 te-7b-fp8 te-verify te-bench te-pytest)
#
# Writes under $OUT (11 files): session.log (versions, doctor, each step's exit code and
# time), bench.log, bench.json, head_memory.txt, verify.log, pytest_gpu.log, bench_7b.txt,
# bench_qkv.txt, bench_rotary.txt,
# check_liger.json, adopt_liger.log; the peers: peer_compiled_7b.txt, peer_liger_7b.txt; the te steps: te_7b_bf16.txt, te_7b_fp8.txt, te_verify.log, te_bench.log,
# te_pytest.log.
set -u
OUT=${OUT:-gpu_results}
mkdir -p "$OUT"
deadline=$(( $(date +%s) + ${1:-540} ))
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 LAYERSWAP_CACHE=/tmp/layerswap-cache
# torch's own cuDNN first: TransformerEngine loaded after a system cuDNN mixes the two builds
# (docs/gpu.md)
cudnn_lib=$(python3 -c "import os, nvidia.cudnn as c; print(os.path.join(list(c.__path__)[0], 'lib'))" 2>/dev/null)
[[ -n "$cudnn_lib" ]] && export LD_LIBRARY_PATH=$cudnn_lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
log() { echo "$*" | tee -a "$OUT/session.log"; }

# step NAME BUDGET FILE COMMAND...: run COMMAND for at most BUDGET seconds (less if the
# deadline is nearer), its output into $OUT/FILE
step() {
  local name=$1 budget=$2 file=$3; shift 3
  local left=$(( deadline - $(date +%s) - 5 ))
  (( left < budget )) && budget=$left
  if (( budget < 10 )); then log "== $name: not run (deadline)"; return; fi
  log "== $name (at most ${budget}s)"
  local started=$(date +%s)
  timeout -s TERM -k 10 "$budget" "$@" > "$OUT/$file" 2>&1
  local code=$?
  log "== $name: exit $code in $(( $(date +%s) - started ))s"
  tail -n 25 "$OUT/$file"
}

nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm --format=csv | tee -a "$OUT/session.log"
python3 -c "import torch, transformers, triton; print('torch', torch.__version__, 'transformers', transformers.__version__, 'triton', triton.__version__)" | tee -a "$OUT/session.log"
wanted() { [[ " ${STEPS:-doctor bench head-memory verify pytest bench-7b qkv rotary check-liger adopt-liger} " == *" $1 "* ]]; }
wanted doctor && python3 -m layerswap doctor 2>&1 | tee -a "$OUT/session.log"
# the benchmark model (0.85 B Llama, 8 x 512): verified, then every contender timed
wanted bench && step bench 120 bench.log python3 scripts/gpu/verify_and_bench.py \
  --out /tmp/bench --families '' --backends fused,liger \
  --contenders original,fused,fused+head,liger,liger+head
cp /tmp/bench/verify_and_bench.json "$OUT/bench.json" 2>/dev/null
wanted head-memory && step head-memory 90 head_memory.txt python3 benchmarks/bench_memory.py \
  --device cuda --vocab 128256 --hidden 4096 --layers 2 --batch 4 --seq 2048 --steps 3
# every family's tiny model: fused in fp32 and bf16, liger where it expresses the family
wanted verify && step verify 220 verify.log python3 scripts/gpu/verify_and_bench.py \
  --out /tmp/verify --skip-bench --backends fused,liger --hidden 256 --intermediate 512 \
  --layers 2 --heads 4 --kv-heads 2 --vocab 1024
wanted pytest && step pytest-gpu 200 pytest_gpu.log python3 -m pytest --full -m gpu -q \
  -p no:cacheprovider -n 4 ${PYTEST_FILES:-}
# Llama-2-7B's shape at the TransformerEngine tutorial's batch (8 x 256)
wanted bench-7b && step bench-7b 100 bench_7b.txt python3 scripts/gpu/verify_and_bench.py \
  --out /tmp/b7 --skip-verify --contenders original,fused --hidden 4096 --intermediate 11008 \
  --layers 32 --heads 32 --kv-heads 32 --batch 8 --seq 256 --warmup 2 --rounds 5
# the qkv slot at Llama-2-7B's layer shape, 8 layers: decoding (batch 1) and a training step
wanted qkv && step qkv 60 bench_qkv.txt python3 benchmarks/bench_qkv.py --device cuda \
  --dtype bfloat16 --layers 8 --hidden 4096 --new 64 --batch 8 --seq 256 --rounds 5
# the rotary slot at Llama-2-7B's layer shape: the rotation alone, and a training step
wanted rotary && step rotary 60 bench_rotary.txt python3 benchmarks/bench_rotary.py --device cuda \
  --dtype bfloat16 --layers 8 --hidden 4096 --batch 8 --seq 1024 --rounds 5
wanted check-liger && step check-liger 60 check_liger.json python3 -m layerswap check --all \
  --backend liger --json
# Liger-Kernel's own apply functions, every key, adopted, undone object for object, and
# the llama one proven on this GPU (tests/test_adopt_liger.py)
wanted adopt-liger && step adopt-liger 90 adopt_liger.log python3 -m pytest --full -q \
  -p no:cacheprovider -n 4 tests/test_adopt_liger.py
# the peers at Llama-2-7B's shape, one process per pair (two 7B contenders with AdamW are
# what one H200 holds): the original under torch.compile, and Liger's own patch (adopted,
# suspended while the original steps)
peers=(--skip-verify --hidden 4096 --intermediate 11008 --layers 32 --heads 32 --kv-heads 32
  --batch 8 --seq "${PEER_SEQ:-256}" --warmup 3 --rounds 5)
wanted peer-compiled-7b && step peer-compiled-7b 150 peer_compiled_7b.txt python3 \
  scripts/gpu/verify_and_bench.py --out /tmp/pc7b --contenders original,compiled "${peers[@]}"
wanted peer-liger-7b && step peer-liger-7b 120 peer_liger_7b.txt python3 \
  scripts/gpu/verify_and_bench.py --out /tmp/pl7b --contenders original,liger-patch "${peers[@]}"
# TransformerEngine at Llama-2-7B's shape, batch 8 x 256 (its tutorial's): two 7B contenders
# with AdamW are what one H200 holds, so bf16 and FP8 each run beside the original
seven_b=(--skip-verify --hidden 4096 --intermediate 11008 --layers 32 --heads 32 --kv-heads 32
  --batch 8 --seq 256 --warmup 2 --rounds 5)
wanted te-7b-bf16 && step te-7b-bf16 100 te_7b_bf16.txt python3 scripts/gpu/verify_and_bench.py \
  --out /tmp/te7b --contenders original,te-bf16 "${seven_b[@]}"
wanted te-7b-fp8 && step te-7b-fp8 100 te_7b_fp8.txt python3 scripts/gpu/verify_and_bench.py \
  --out /tmp/te7f --contenders original,te-fp8 --fp8-recipes "${TE_7B_RECIPE:-delayed}" "${seven_b[@]}"
# every family te expresses: bf16 and FP8 (current scaling) against the original; and te's
# norm and qkv slots on every family's own modules (bf16, forward and backward)
wanted te-verify && step te-verify 110 te_verify.log python3 scripts/gpu/verify_and_bench.py \
  --out /tmp/teverify --skip-bench --backends te --hidden 256 --intermediate 512 \
  --layers 2 --heads 4 --kv-heads 2 --vocab 1024
# the 0.85 B model at 8 x 512 (host-bound for te on the H100): eager and with every layer
# captured as CUDA graphs
wanted te-bench && step te-bench 150 te_bench.log python3 scripts/gpu/verify_and_bench.py \
  --out /tmp/tebench --families '' --backends te --skip-verify \
  --contenders "${TE_BENCH_CONTENDERS:-original,fused,fused-graphed,te,te-graphed}"
wanted te-pytest && step te-pytest 90 te_pytest.log python3 -m pytest --full -m gpu -q \
  -p no:cacheprovider -n 4 tests/test_te.py tests/test_te_slots.py tests/test_verify_fp8.py
# the re-proof, in parallel: tiny models leave the GPU mostly idle and the host is the bound,
# so the verification runs in VERIFY_SHARDS processes beside the GPU tests and the adoption
if wanted reprove; then
  export OMP_NUM_THREADS=${OMP_NUM_THREADS:-2}
  mapfile -t shards < <(python3 -c "
from layerswap.registry import families
names = sorted(families())
for index in range(${VERIFY_SHARDS:-4}):
    print(','.join(names[index::${VERIFY_SHARDS:-4}]))")
  for index in "${!shards[@]}"; do
    step "verify-$index" 220 "verify_$index.log" python3 scripts/gpu/verify_and_bench.py \
      --out "/tmp/verify$index" --skip-bench --families "${shards[$index]}" --backends fused,liger \
      --hidden 256 --intermediate 512 --layers 2 --heads 4 --kv-heads 2 --vocab 1024 &
  done
  step pytest-gpu 220 pytest_gpu.log python3 -m pytest --full -m gpu -q -p no:cacheprovider \
    -n 4 ${PYTEST_FILES:-} &
  step adopt-liger 220 adopt_liger.log python3 -m pytest --full -q -p no:cacheprovider -n 2 \
    tests/test_adopt_liger.py &
  step check-liger 220 check_liger.json python3 -m layerswap check --all --backend liger --json &
  wait
  unset OMP_NUM_THREADS
  # at most 8 files come back: the shards in one
  for index in "${!shards[@]}"; do cat "$OUT/verify_$index.log"; done > "$OUT/verify.log"
  rm -f "$OUT"/verify_*.log
  grep -h "^verification:" "$OUT/verify.log" | tee -a "$OUT/session.log"
fi
# one process per pair: the original and one contender (two 7B models with AdamW are what
# one H200 holds), each pair appended to pairs_<seq>.txt as it ends
pair_shape() {  # pair_shape SEQ LAYERS CONTENDER...
  local seq=$1 layers=$2; shift 2
  for contender in "$@"; do
    local budget=70
    [[ $contender == *compiled* ]] && budget=150
    step "pair-$seq-$contender" "$budget" "pair.txt" python3 scripts/gpu/verify_and_bench.py \
      --out "/tmp/pair" --skip-verify --contenders "original,$contender" --hidden 4096 \
      --intermediate 11008 --layers "$layers" --heads 32 --kv-heads 32 --batch 8 --seq "$seq" \
      --warmup 3 --rounds 5
    { echo "### original,$contender at 8 x $seq, $layers layers"; cat "$OUT/pair.txt"; } \
      >> "$OUT/pairs_$seq.txt"
    rm -f "$OUT/pair.txt"
  done
}
wanted pairs-256 && pair_shape 256 "${LAYERS_256:-32}" ${PAIRS_256:-liger-patch liger-slots \
  fused+head-compiled compiled fused-compiled liger+head fused liger fused+head}
wanted pairs-1024 && pair_shape 1024 "${LAYERS_1024:-16}" ${PAIRS_1024:-liger-patch \
  fused+head-compiled compiled fused-compiled liger+head fused}
log "== done"
