# shellcheck shell=bash
# shellcheck disable=SC2154 # bin, RUN_SECONDS, CLIENTS and MOONCAKE_VENV are the caller's
# What the benchmark scripts (scripts/bench-second-tier, scripts/bench-python)
# share, once they run inside their private network namespace: a work folder
# removed at the end (copied to $RESULTS_DIR first when set), servers started
# in the background and killed by their PID, ports, `kvplane bench` runs and
# Mooncake Store's processes. Sourced, not run; the caller sets `bin` (the
# kvplane binary), RUN_SECONDS and CLIENTS, and MOONCAKE_VENV for Mooncake.

ip link set lo up
work=$(mktemp -d)
pids=()
bench_cleanup() {
    local status=$?
    # SIGKILL: nothing here is kept (a cluster node asked to stop would first
    # hand its blocks on).
    for pid in "${pids[@]}"; do kill -KILL "$pid" 2>/dev/null || true; done
    for pid in "${pids[@]}"; do wait "$pid" 2>/dev/null || true; done
    if [ -n "${RESULTS_DIR:-}" ]; then
        mkdir -p "$RESULTS_DIR"
        cp -r "$work"/. "$RESULTS_DIR"/ 2>/dev/null || true
        echo "results and logs copied to $RESULTS_DIR" >&2
    fi
    rm -rf "$work"
    exit "$status"
}
trap bench_cleanup EXIT
# The compiled plugins' cache, so that nothing is written outside $work.
export KVPLANE_CACHE_DIR=$work/plugin-cache
results=$work/results.jsonl
: >"$results"

# Alone in this namespace: fixed ports are free.
next_port=20000
# The next port is $next_port after `port` (not $(port): a subshell would not count).
port() { next_port=$((next_port + 1)); }
wait_port() { # port pid
    for _ in $(seq 1 600); do
        (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null && return 0
        kill -0 "$2" 2>/dev/null || { echo "the server meant for port $1 exited; its log is in $work" >&2; tail -20 "$work"/*.log >&2; exit 1; }
        sleep 0.05
    done
    echo "nothing listens on 127.0.0.1:$1" >&2
    exit 1
}
# start NAME CMD...: in the background, logging to $work/NAME.log; sets $started.
start() {
    local name=$1
    shift
    "$@" >"$work/$name.log" 2>&1 &
    started=$!
    pids+=("$started")
}
stop() { # pid...
    for pid in "$@"; do kill "$pid" 2>/dev/null || true; done
    for pid in "$@"; do wait "$pid" 2>/dev/null || true; done
}
bytes_of() { # 64KiB -> 65536
    local n=${1%[KMG]iB}
    case $1 in *KiB) echo $((n << 10)) ;; *MiB) echo $((n << 20)) ;; *GiB) echo $((n << 30)) ;; *) echo "$1" ;; esac
}

# record LABEL RUN: labels the JSON line on stdin, appends it to $results
# and prints its figure.
record() {
    python3 -c 'import json,sys; r=json.load(sys.stdin); r["label"]=sys.argv[1]; r["run"]=int(sys.argv[2]); print(json.dumps(r))' "$1" "$2" >>"$results"
    tail -1 "$results" | python3 -c 'import json,sys; r=json.load(sys.stdin); print("  %-16s %-3s %7d B run %d: %6.3f GB/s%s" % (r["label"], r["op"], r["block_size"], r["run"], r["gb_per_s"], "" if r.get("backend_hits") is None else "  (memory-tier hits %d, read through %d)" % (r["memory_hits"], r["backend_hits"])))' >&2
}

# bench LABEL RUN ARGS...: one `kvplane bench` run (the Rust client).
bench() {
    local label=$1 run=$2
    shift 2
    "$bin" bench --json --seconds "$RUN_SECONDS" --clients "$CLIENTS" "$@" | record "$label" "$run"
}

# mooncake_start STORES SEGMENT_BYTES: Mooncake Store's master (with its HTTP
# metadata server) and STORES store processes, each mounting a segment of
# SEGMENT_BYTES; their PIDs in $mooncake_pids. TCP transport, loopback only.
mooncake_start() {
    local stores=$1 segment=$2 i mc_port mc_http mc_metrics
    port; mc_port=$next_port
    port; mc_http=$next_port
    port; mc_metrics=$next_port
    export MC_MASTER=127.0.0.1:$mc_port MC_METADATA=http://127.0.0.1:$mc_http/metadata MC_TCP_BIND_ADDRESS=127.0.0.1
    start mooncake-master "$MOONCAKE_VENV/bin/mooncake_master" --rpc_address 127.0.0.1 --rpc_port "$mc_port" \
        --enable_http_metadata_server=true --http_metadata_server_host 127.0.0.1 --http_metadata_server_port "$mc_http" \
        --metrics_port "$mc_metrics"
    mooncake_pids=("$started")
    wait_port "$mc_port" "$started"
    wait_port "$mc_http" "$started"
    for i in $(seq 1 "$stores"); do
        MC_READY=$work/store-$i.ready start "mooncake-store-$i" "$MOONCAKE_VENV/bin/python" scripts/lib/mooncake_bench.py store --segment "$segment"
        mooncake_pids+=("$started")
        for _ in $(seq 1 600); do
            [ -e "$work/store-$i.ready" ] && break
            kill -0 "$started" 2>/dev/null || { echo "mooncake store $i exited:" >&2; tail -20 "$work/mooncake-store-$i.log" >&2; exit 1; }
            sleep 0.05
        done
        [ -e "$work/store-$i.ready" ] || { echo "mooncake store $i did not mount its segment" >&2; exit 1; }
    done
}

# mooncake LABEL RUN OP SIZE BATCH BLOCKS: CLIENTS client processes of
# Mooncake's Python client, one result line.
mooncake() {
    local label=$1 run=$2 op=$3 size=$4 batch=$5 blocks=$6
    local block barrier c cpids=()
    block=$(bytes_of "$size")
    barrier=$(mktemp -d "$work/barrier.XXXX")
    for c in $(seq 0 $((CLIENTS - 1))); do
        "$MOONCAKE_VENV/bin/python" scripts/lib/mooncake_bench.py client --op "$op" --size "$block" --batch "$batch" --blocks "$blocks" \
            --index "$c" --clients "$CLIENTS" --seconds "$RUN_SECONDS" --barrier "$barrier" >"$barrier/out.$c" 2>"$barrier/err.$c" &
        cpids+=($!)
    done
    for c in "${!cpids[@]}"; do
        wait "${cpids[$c]}" || { echo "mooncake client $c failed:" >&2; tail -20 "$barrier/err.$c" >&2; exit 1; }
    done
    python3 scripts/lib/bench_results.py merge --barrier "$barrier" --target mooncake --op "$op" --size "$block" \
        --batch "$batch" --clients "$CLIENTS" | record "$label" "$run"
}
