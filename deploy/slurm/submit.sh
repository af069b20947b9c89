#!/usr/bin/env bash
# Submit a rollart-dask cluster to Slurm: the scheduler, then one worker job per pool.
#   ROLLART_SHARED=/shared/rollart deploy/slurm/submit.sh [POOL ...]   (default: every pool)
# Edit the table below for your partitions. Workers start once the scheduler job runs.
# TLS by default: the cluster's certificate in ROLLART_TLS_DIR (default $ROLLART_SHARED/tls, made with
# `rollart cluster certs` when missing); ROLLART_TLS=off for plain TCP on a private network.
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
source "$HERE/../pools.sh"
: "${ROLLART_SHARED:?set ROLLART_SHARED to a directory every node sees}"
export ROLLART_SHARED
export ROLLART_DEPLOY=$(cd "$HERE/.." && pwd)  # the jobs run copies of their scripts: pools.sh is found through this
export ROLLART_TLS_DIR=${ROLLART_TLS_DIR:-$ROLLART_SHARED/tls}
tls_on && make_certs "$ROLLART_TLS_DIR"

spec() {  # pool → partition nodes tasks-per-node gpus-per-task cpus-per-task nthreads
  case "$1" in
    train)      echo "h800 1 1 1 16 2" ;;  # the trainer: one process
    h800)       echo "h800 1 8 1 8 2" ;;   # one engine (worker) per GPU
    h20)        echo "h20 1 8 1 8 2" ;;
    cpu)        echo "cpu 2 1 0 32 16" ;;  # env hosts: many envs per worker
    serverless) echo "cpu 1 1 0 8 8" ;;    # reward callers (reward.mode: serverless)
    reward)     echo "cpu 1 1 0 8 4" ;;    # local rewards and the judge engine (torch on CPU)
    *) echo "unknown pool '$1' (pools: $ROLLART_POOLS)" >&2; return 2 ;;
  esac
}

SCHED_JOB=$(sbatch --parsable --partition="${SCHEDULER_PARTITION:-cpu}" "$HERE/scheduler.sbatch")
echo "scheduler: job $SCHED_JOB (address in $ROLLART_SHARED/scheduler-address)"
attach_hint "\"\$(cat $ROLLART_SHARED/scheduler-address)\"" "$ROLLART_TLS_DIR"
for pool in ${*:-$ROLLART_POOLS}; do
  read -r partition nodes tasks gpus cpus nthreads <<< "$(spec "$pool")"
  gpu_args=()
  [ "$gpus" -gt 0 ] && gpu_args=(--gpus-per-task="$gpus")
  job=$(sbatch --parsable --dependency="after:$SCHED_JOB" --job-name="rollart-$pool" --partition="$partition" \
    --nodes="$nodes" --ntasks-per-node="$tasks" --cpus-per-task="$cpus" "${gpu_args[@]}" \
    "$HERE/worker.sbatch" "$pool" "$(pool_resources "$pool")" "$nthreads")
  echo "$pool: job $job"
done
