#!/usr/bin/env bash
# hsdp-serve's container entrypoint: maps HSDP_* environment variables onto hsdp-serve's flags,
# then execs the server (one node) or torchrun (several nodes), so that the server is the
# process the container's stop signal reaches. docker/.env.example documents every variable;
# an unset or empty variable leaves the server's own default. Arguments given to the container
# are appended as extra flags (a flag given twice: the later one wins).
#
#   HSDP_DRY_RUN=1 docker/entrypoint.sh     # print the command it would run, and exit
#
# Runs as well outside a container: tests/test_docker.py starts it on CPU ranks.
set -euo pipefail

# variable -> flag. HSDP_API_KEY is deliberately absent: hsdp-serve reads it from the
# environment itself, so the key never appears on a command line (`ps` shows those).
FLAG_VARS=(
    HSDP_MODEL:--model
    HSDP_NPROC_PER_NODE:--nproc-per-node
    HSDP_REPLICATE_SIZE:--replicate-size
    HSDP_SHARD_SIZE:--shard-size
    HSDP_DEVICE:--device
    HSDP_DTYPE:--dtype
    HSDP_READ_MODE:--read-mode
    HSDP_HOST:--host
    HSDP_PORT:--port
    HSDP_LOG_LEVEL:--log-level
    HSDP_MAX_CONCURRENT_REQUESTS:--max-concurrent-requests
    HSDP_MAX_QUEUED_REQUESTS:--max-queued-requests
    HSDP_MAX_INPUT_TOKENS:--max-input-tokens
    HSDP_MAX_TOTAL_TOKENS:--max-total-tokens
    HSDP_MAX_BODY_BYTES:--max-body-bytes
    HSDP_STEP_TIMEOUT:--step-timeout
    HSDP_SHUTDOWN_TIMEOUT:--shutdown-timeout
    HSDP_COLLECTIVE_TIMEOUT:--collective-timeout
    HSDP_PREFETCH_DEPTH:--prefetch-depth
    HSDP_RESIDENT_UNITS:--resident-units
    HSDP_ALL_GATHER:--all-gather
)
# Read here or by the server, not mapped onto flags.
OTHER_VARS=(
    HSDP_API_KEY HSDP_API_KEY_FILE HSDP_CACHE_DIR HSDP_PROBE_HOST HSDP_DRY_RUN
    HSDP_NNODES HSDP_NODE_RANK HSDP_MASTER_ADDR HSDP_MASTER_PORT
    HSDP_INJECT_FORWARD_FAULT
)

die() {
    echo "hsdp-entrypoint: $*" >&2
    exit 2
}

# A misspelt variable would otherwise be ignored without a word.
known=" ${OTHER_VARS[*]} "
for pair in "${FLAG_VARS[@]}"; do known+="${pair%%:*} "; done
while IFS= read -r name; do
    [[ "$known" == *" $name "* ]] || echo "hsdp-entrypoint: warning: unknown variable $name is ignored" >&2
done < <(compgen -e | grep '^HSDP_' || true)

# A key from a file (Docker or Kubernetes secrets) rather than the environment.
if [[ -n "${HSDP_API_KEY_FILE:-}" ]]; then
    [[ -r "$HSDP_API_KEY_FILE" ]] || die "HSDP_API_KEY_FILE=$HSDP_API_KEY_FILE: not readable"
    HSDP_API_KEY="$(tr -d '\r\n' < "$HSDP_API_KEY_FILE")"
    [[ -n "$HSDP_API_KEY" ]] || die "HSDP_API_KEY_FILE=$HSDP_API_KEY_FILE: empty"
    export HSDP_API_KEY
fi

args=()
for pair in "${FLAG_VARS[@]}"; do
    name="${pair%%:*}"
    value="${!name:-}"
    [[ -n "$value" ]] && args+=("${pair#*:}" "$value")
done
args+=("$@")

nnodes="${HSDP_NNODES:-1}"
[[ "$nnodes" =~ ^[1-9][0-9]*$ ]] || die "HSDP_NNODES must be a positive integer, got '$nnodes'"
if (( nnodes == 1 )); then
    cmd=(hsdp-serve "${args[@]}")
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
    cmd=(torchrun --nnodes "$nnodes" --nproc-per-node "$nproc" --node-rank "$HSDP_NODE_RANK"
         --master-addr "$HSDP_MASTER_ADDR" --master-port "${HSDP_MASTER_PORT:-29500}"
         -m server "${args[@]}")
fi

if [[ -n "${HSDP_DRY_RUN:-}" ]]; then
    printf '%q ' "${cmd[@]}"
    echo
    exit 0
fi
echo "hsdp-entrypoint: ${cmd[*]}" >&2
exec "${cmd[@]}"
