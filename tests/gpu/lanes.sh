#!/usr/bin/env bash
# Runs GPU checks in parallel lanes on one multi-GPU machine (device tool only, not CI).
#
# Each lane gets its own GPUs (CUDA_VISIBLE_DEVICES) and its own caches (tiny models,
# vLLM's compile cache, Inductor's), so two engines never build the same file at once.
# A lane's commands run in order; all of a lane's output goes to one log,
# $OUT/lane<i>.log (few files come back from the device), and each command's last
# JSON report (the checks print one JSON line; else its last line) is printed here with its lane and exit code.
#
#   bash tests/gpu/lanes.sh "0,1|python3 tests/gpu/check_monitor.py --tp 2" \
#                           "2,3|python3 tests/gpu/check_push.py --pp 2|python3 ..."
set -u
out="${OUT:-/tmp/lanes}"
mkdir -p "$out"
i=0
for spec in "$@"; do
  (
    IFS='|' read -r -a parts <<< "$spec"
    gpus="${parts[0]}"
    export CUDA_VISIBLE_DEVICES="$gpus" ACTBUS_CACHE="/tmp/lane$i/actbus" \
      VLLM_CACHE_ROOT="/tmp/lane$i/vllm" TORCHINDUCTOR_CACHE_DIR="/tmp/lane$i/inductor"
    log="$out/lane$i.log"
    for cmd in "${parts[@]:1}"; do
      echo "=== [lane $i gpus $gpus] $cmd" >> "$log"
      start=$(date +%s)
      part="/tmp/lane$i.part"  # not under $OUT: only the logs come back
      bash -c "$cmd" > "$part" 2>&1
      rc=$?
      cat "$part" >> "$log"
      # the check's JSON report (its last line starting with "{"), else its last line
      last=$(grep '^{' "$part" | tail -n 1)
      [ -n "$last" ] || last=$(tail -n 1 "$part")
      rm -f "$part"
      echo "lane $i rc=$rc $(( $(date +%s) - start ))s :: $cmd :: $last"
    done
  ) &
  i=$((i + 1))
done
wait
