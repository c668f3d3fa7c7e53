#!/usr/bin/env bash
# hsdp-serve's container entrypoint: execs the server (one node) or torchrun (several nodes), so
# that the server is the process the container's stop signal reaches. The server reads its own
# HSDP_* variables (every flag has one: --max-total-tokens is HSDP_MAX_TOTAL_TOKENS; `hsdp-serve
# --help` lists them, docker/.env.example documents them), so nothing is mapped here and a key
# set as HSDP_API_KEY or HSDP_API_KEY_FILE never appears on a command line. An unset or empty
# variable leaves the server's default. Arguments given to the container are passed on as flags
# (a flag beats its variable).
#
#   HSDP_DRY_RUN=1 docker/entrypoint.sh     # print the command it would run, and exit
#
# Runs as well outside a container: tests/test_docker.py starts it on CPU ranks.
set -euo pipefail

die() {
    echo "hsdp-entrypoint: $*" >&2
    exit 2
}

nnodes="${HSDP_NNODES:-1}"
[[ "$nnodes" =~ ^[1-9][0-9]*$ ]] || die "HSDP_NNODES must be a positive integer, got '$nnodes'"
if (( nnodes == 1 )); then
    cmd=(hsdp-serve "$@")
else
    # Several nodes: torchrun's static rendezvous, one container per node. Node rank 0 holds
    # global rank 0, so it is the node that serves HTTP; the others only compute.
    [[ -n "${HSDP_NODE_RANK:-}" ]] || die "HSDP_NNODES=$nnodes needs HSDP_NODE_RANK (0 on the node that serves HTTP)"
    [[ -n "${HSDP_MASTER_ADDR:-}" ]] || die "HSDP_NNODES=$nnodes needs HSDP_MASTER_ADDR (node rank 0's address)"
    nproc="${HSDP_NPROC_PER_NODE:-auto}"
    if [[ "$nproc" == auto ]]; then
        # torchrun's own 'auto' means one rank per CPU core on a CPU host; ours means 2.
        if [[ "${HSDP_DEVICE:-}" == cpu ]]; then nproc=2; else nproc=gpu; fi
    fi
    # torchrun kills its workers 30 s after a SIGTERM by default: longer than the drain they need
    drain="${HSDP_SHUTDOWN_TIMEOUT:-30}"
    [[ "$drain" =~ ^[0-9]+$ ]] || drain=30
    export TORCH_ELASTIC_SHUTDOWN_TIMEOUT="${TORCH_ELASTIC_SHUTDOWN_TIMEOUT:-$(( drain + 15 ))}"
    cmd=(torchrun --nnodes "$nnodes" --nproc-per-node "$nproc" --node-rank "$HSDP_NODE_RANK"
         --master-addr "$HSDP_MASTER_ADDR" --master-port "${HSDP_MASTER_PORT:-29500}"
         -m server "$@")
fi

if [[ -n "${HSDP_DRY_RUN:-}" ]]; then
    printf '%q ' "${cmd[@]}"
    echo
    exit 0
fi
echo "hsdp-entrypoint: ${cmd[*]}" >&2
exec "${cmd[@]}"
