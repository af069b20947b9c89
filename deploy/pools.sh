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

# TLS, on by default in these recipes: a Dask scheduler runs whatever it is sent, so only holders of the
# cluster's certificate may talk to it. Every node and the client read the same ca.pem, cert.pem and key.pem
# (`rollart cluster certs DIR` writes them); ROLLART_TLS=off runs plain TCP (a private network only).
tls_args() {  # directory of the three files → the TLS options of `dask scheduler` / `dask worker`
  echo "--tls-ca-file $1/ca.pem --tls-cert $1/cert.pem --tls-key $1/key.pem"
}

tls_on() { [ "${ROLLART_TLS:-on}" != off ]; }

make_certs() {  # directory: write the three files there unless they exist
  [ -s "$1/key.pem" ] || ${ROLLART_CLI:-rollart} cluster certs "$1" > /dev/null
}

attach_hint() {  # address, directory: how the client attaches (to stderr: stdout carries the address alone)
  if tls_on; then
    echo "attach: rollart run FLOW --scheduler $1 --set cluster.security.ca_file=$2/ca.pem --set cluster.security.cert=$2/cert.pem --set cluster.security.key=$2/key.pem" >&2
  else
    echo "attach: rollart run FLOW --scheduler $1   (ROLLART_TLS=off: plain TCP, anyone who reaches the port can run code there)" >&2
  fi
}
