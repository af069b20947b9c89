# Pool → Dask worker resources, shared by the Slurm and SSH recipes (source it; bash).
# Pools are tags with a large capacity: concurrency is decided by the services inside the
# workers (an engine batches what it holds, an env host runs many envs), not by resource counts.
ROLLART_BIG=1000000
ROLLART_POOLS="train h800 h20 cpu serverless reward"

pool_resources() {  # pool name → the value of `dask worker --resources`
  local b=$ROLLART_BIG
  case "$1" in
    train)      echo "H800=$b TRAIN=$b" ;;  # the trainer's own worker; never hosts an engine
    h800)       echo "H800=$b" ;;           # prefill-heavy generation (affinity: prefill)
    h20)        echo "H20=$b" ;;            # decode-heavy generation (affinity: decode)
    cpu)        echo "CPU=$b" ;;            # env hosts
    serverless) echo "SERVERLESS=$b" ;;     # reward callers (reward.mode: serverless)
    reward)     echo "REWARD=$b" ;;         # local reward runner, and stateful rewards (judge engine)
    *) echo "unknown pool '$1' (pools: $ROLLART_POOLS)" >&2; return 2 ;;
  esac
}
