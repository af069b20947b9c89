#!/usr/bin/env bash
# Runs the GPU checks (check_vllm.py, check_megatron.py) one after the other, each under a time
# limit, and exits non-zero if either fails or runs out of time. Arguments go to both checks
# (e.g. --cpu). PYTHON picks the interpreter, CHECK_TIMEOUT_S the limit per check (default 240).
set -u
cd "$(dirname "$0")/../.."
PY=${PYTHON:-python}
LIMIT=${CHECK_TIMEOUT_S:-240}
status=0
summary=()
for check in check_vllm check_megatron; do
  echo "=== $check (limit ${LIMIT}s)"
  start=$(date +%s)
  timeout --kill-after=15 "$LIMIT" "$PY" "deploy/gpu/$check.py" "$@"
  rc=$?
  took=$(( $(date +%s) - start ))
  if [ "$rc" -eq 0 ]; then
    result="PASS"
  elif [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
    result="TIMEOUT"
  else
    result="FAIL (exit $rc)"
  fi
  [ "$rc" -eq 0 ] || status=1
  summary+=("$(printf '%-16s %-16s %4ss' "$check" "$result" "$took")")
done
echo "=== summary"
printf '%s\n' "${summary[@]}"
exit "$status"
