#!/usr/bin/env bash
# The 7B rows of docs/retrieval.md ("7B"): ours with LoRA and full, ZeRO-3 on 4 GPUs at 16,384
# pairs (1 hard negative, seq 256), and sentence-transformers' CachedMNRL + peft on one GPU, as ONE
# engine command. It takes about 20 minutes, more than one 10-minute call of a lent machine, so
# it runs in its own process session (setsid) and outlives the call that started it; the next
# call waits for it. The machine stays warm only briefly after a call: make the next call at once.
#
#   bash launch/bench_7b.sh start   # start it, then wait up to $WAIT seconds (default 570)
#   bash launch/bench_7b.sh wait    # wait up to $WAIT more seconds (repeat until it says done)
#
# Results: $BENCH7B_DIR (default /tmp/bench_7b): results.md / results.csv (rewritten after each
# case), engine.log, one folder per case; copied to $OUT (when set) at the end of every call.
# ARCH=mistral-7b for the Mistral shape; CASES to run fewer (e.g. CASES="infcl+lora+ckptauto+chunk8 st_cached").
set -u
DIR=${BENCH7B_DIR:-/tmp/bench_7b}
WAIT=${WAIT:-570}
ARCH=${ARCH:-qwen2-7b}
CASES=${CASES:-infcl+lora+ckptauto+chunk8 st_cached infcl+chunk64}
PY=${PYTHON:-python3}

start() {
    if [ -f "$DIR/pid" ] && kill -0 "$(cat "$DIR/pid")" 2>/dev/null; then
        echo "[bench_7b] already running (pid $(cat "$DIR/pid")); waiting"; return
    fi
    rm -rf "$DIR" && mkdir -p "$DIR"
    nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$DIR/gpus.txt"
    $PY -m pip list 2>/dev/null | grep -iE "^(torch|deepspeed|transformers|peft|sentence-transformers|liger-kernel) " \
        | tee "$DIR/versions.txt"
    # shellcheck disable=SC2086
    setsid nohup sh -c "PYTHONUNBUFFERED=1 $PY -m ds_infcl.bench.engine --task bench_decoder --num-gpus 4 \
        --task-args '{\"arch\": \"$ARCH\", \"seq_len\": 256, \"num_negatives\": 1, \"init_device\": \"cuda\"}' \
        --impls $CASES --throughput-batch 16384 --steps 1 --warmup 0 --no-search \
        --deepspeed-config ds_configs/zero3.json --case-timeout 1200 \
        --st-batch 512 --st-mini-batch 16 --st-steps 2 --st-lora-r 16 \
        --label '7B, ZeRO-3, 16,384 pairs, one step' --out $DIR; echo \$? > $DIR/rc" \
        > "$DIR/engine.log" 2>&1 < /dev/null &
    echo $! > "$DIR/pid"
    echo "[bench_7b] started (pid $(cat "$DIR/pid")), $ARCH, cases: $CASES"
}

wait_for_it() {
    local t0=$SECONDS seen=0
    while [ ! -f "$DIR/rc" ] && [ $((SECONDS - t0)) -lt "$WAIT" ]; do
        sleep 10
        local n
        n=$(grep -c '^\[bench\]' "$DIR/engine.log" 2>/dev/null); n=${n:-0}
        if [ "$n" -gt "$seen" ]; then grep '^\[bench\]' "$DIR/engine.log" | tail -n $((n - seen)); seen=$n; fi
    done
    if [ -f "$DIR/rc" ]; then
        echo "[bench_7b] done (engine exit $(cat "$DIR/rc"))"; cat "$DIR/results.md" 2>/dev/null
    else
        echo "[bench_7b] still running after $((SECONDS - t0)) s of this call; call 'wait' again now"
        tail -n 5 "$DIR/engine.log"; cat "$DIR/results.md" 2>/dev/null
    fi
    if [ -n "${OUT:-}" ]; then  # at most 8 files come back
        cp "$DIR/results.md" "$DIR/results.csv" "$DIR/engine.log" "$DIR/gpus.txt" "$DIR/versions.txt" "$OUT/" 2>/dev/null
        for case in "$DIR"/*/; do
            if [ -f "$case/log.txt" ]; then tail -c 2000000 "$case/log.txt" > "$OUT/$(basename "$case").log"; fi
        done
    fi
    if [ -f "$DIR/rc" ]; then return "$(cat "$DIR/rc")"; fi  # the engine's exit status once done
}

case "${1:-}" in
    start) start; wait_for_it ;;
    wait) wait_for_it ;;
    *) echo "usage: bash launch/bench_7b.sh start|wait" >&2; exit 2 ;;
esac
