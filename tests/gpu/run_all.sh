#!/usr/bin/env bash
# Every GPU check, spread over the GPUs found, in lanes (tests/gpu/lanes.sh); then one
# table: check, parallelism, result, max error, seconds (tests/gpu/table.py).
# Device tool only, never CI. Run from the repo root with actbus installed (docs/gpu.md).
#
#   bash tests/gpu/run_all.sh                  # every check this machine's GPUs can run
#   ONLY="capture:llama ops" bash tests/gpu/run_all.sh   # those whose name starts so
#   LANES_PER_GPU=4 bash tests/gpu/run_all.sh  # several engines share each GPU
#
# A check that needs more GPUs than the machine has is listed as "not run" with the
# count it needs. Each check runs under `timeout` (CHECK_TIMEOUT_S, default 420 s), so
# a hang fails with rc 124 instead of holding the lane.
set -u
here="$(cd "$(dirname "$0")" && pwd)"
out="${OUT:-/tmp/gpu-checks}"
mkdir -p "$out"
ngpu="${NGPU:-$(python3 -c "import torch; print(torch.cuda.device_count())")}"
per="${LANES_PER_GPU:-1}"
limit="${CHECK_TIMEOUT_S:-420}"
export VLLM_PLUGINS="${VLLM_PLUGINS:-actbus}" PYTHONUNBUFFERED=1
# Several engines on one GPU: each takes an even share of its memory.
export ACTBUS_GPU_SHARE="${ACTBUS_GPU_SHARE:-$(python3 -c "print(round(min(0.3, 0.85 / $per), 3))")}"
# More than one engine a GPU: fixed KV caches, no memory profiling (tests/support/installed.py).
[ "$per" -gt 1 ] && export ACTBUS_GPU_KV_GIB="${ACTBUS_GPU_KV_GIB:-2}"

cap="python3 tests/gpu/check_capture.py --dtype bfloat16"
# name | GPUs | command. The order is longest first, so the lanes end together.
checks=(
  "ops|1|python3 tests/gpu/check_ops.py --dtype bfloat16"
  "monitor|1|python3 tests/gpu/check_monitor.py --dtype bfloat16"
  "steer|1|python3 tests/gpu/check_steer.py --dtype bfloat16"
  "push|1|python3 tests/gpu/check_push.py --dtype bfloat16"
  "capture:llama-v1|1|$cap --runner v1"
  "capture:llama-v2|1|$cap --runner v2"
)
for a in deepseek_v2 gpt_oss qwen3_moe mixtral qwen2_moe olmoe qwen2 qwen3 mistral gemma2 gemma3 \
         phi3 granite olmo2 paligemma idefics3 gpt2 gemma3mm; do
  checks+=("capture:$a|1|$cap --arch $a")
done
for f in capture steer monitor push; do
  checks+=("$f-tp2|2|python3 tests/gpu/check_$f.py --dtype bfloat16 --tp 2")
  checks+=("$f-pp2|2|python3 tests/gpu/check_$f.py --dtype bfloat16 --pp 2")
done
checks+=("capture-tp4|4|$cap --tp 4" "dp|2|python3 tests/gpu/check_dp.py --dtype bfloat16")

# Lanes: single-GPU checks share GPUs round-robin. A check on G GPUs runs where the
# machine has that many, in lanes of G GPUs each (0,1 and 2,3 for G=2 on four GPUs),
# LANES_PER_GPU of them on each set like the single-GPU ones; those lanes start after
# the single-GPU lanes end.
declare -a lane_specs=() skipped=()
nlanes=$(( ngpu * per ))
for ((i = 0; i < nlanes; i++)); do lane_specs[i]="$(( i % ngpu ))"; done
declare -A multi=() next=()
i=0
for c in "${checks[@]}"; do
  IFS='|' read -r name gpus cmd <<< "$c"
  case " ${SKIP:-} " in *" $name "*) continue ;; esac
  if [ -n "${ONLY:-}" ]; then
    keep=0; for o in $ONLY; do [[ "$name" == "$o"* ]] && keep=1; done
    [ "$keep" = 1 ] || continue
  fi
  wrapped="timeout -k 10 $limit $cmd #$name"
  if [ "$gpus" -gt "$ngpu" ]; then
    skipped+=("$name|needs $gpus GPUs, the machine has $ngpu")
  elif [ "$gpus" = 1 ]; then
    lane_specs[i % nlanes]+="|$wrapped"; i=$((i + 1))
  else
    sets=$(( ngpu / gpus )); k=${next[$gpus]:-0}; next[$gpus]=$((k + 1))
    first=$(( (k % sets) * gpus )); lane="$gpus:$(( k % (sets * per) ))"
    multi[$lane]="${multi[$lane]:-$(seq -s, "$first" $((first + gpus - 1)))}|$wrapped"
  fi
done
specs=()
for s in "${lane_specs[@]}"; do [[ "$s" == *"|"* ]] && specs+=("$s"); done
mspecs=("${multi[@]}")
start=$(date +%s)
{
  [ "${#specs[@]}" -gt 0 ] && bash "$here/lanes.sh" "${specs[@]}"
  [ "${#mspecs[@]}" -gt 0 ] && bash "$here/lanes.sh" "${mspecs[@]}"
} | tee "$out/lanes.txt"
for s in "${skipped[@]}"; do echo "skipped :: $s" >> "$out/lanes.txt"; done
python3 "$here/table.py" "$out/lanes.txt" "$(( $(date +%s) - start ))" | tee "$out/table.md"
