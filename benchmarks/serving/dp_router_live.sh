#!/bin/bash
# conveyor router for real on this machine (measure, do not assert): fresh servers per
# configuration; one engine with 2 threads, then two 1-thread replicas behind the router
# (least-loaded, then prefix), on whole Mooncake prefix families. Run from the repository root.
cd "$(dirname "$0")/../.."
export PYTHONPATH=$PWD/src
[ -f ../shared/traces/mooncake_synthetic.jsonl ] || { echo "skipped: no ../shared/traces/mooncake_synthetic.jsonl"; exit 0; }
C="python -m conveyor.entrypoints.cli"
M="--model smollm2-135m --load-format dummy --dtype float32 --log-level warning --no-access-log --max-num-seqs 32 --max-num-batched-tokens 1024"
B="--backend openai --workload ../shared/traces/mooncake_synthetic.jsonl --sample families --num-requests 48 --input-scale 0.03 --output-scale 0.25 --request-rate 2 --openai-model smollm2-135m"
wait_up() { for i in $(seq 600); do curl -sf $1/health >/dev/null && return 0; sleep 0.5; done; return 1; }
hits() { for p in "$@"; do curl -s http://127.0.0.1:$p/metrics | grep -E "^conveyor:prefix_cache_(hits|queries)_total" | tr '\n' ' '; echo; done; }
date -u +%H:%M
$C serve $M --num-threads 2 --port 8301 & P1=$!
wait_up http://127.0.0.1:8301
echo "== one engine, 2 threads"; $C bench $B --base-url http://127.0.0.1:8301 --out ${OUT:-/tmp}/dp-one.json 2>&1 | tail -32
hits 8301
kill $P1; wait $P1
for R in least-loaded prefix; do
  date -u +%H:%M
  $C serve $M --num-threads 1 --port 8302 & P2=$!
  $C serve $M --num-threads 1 --port 8303 & P3=$!
  wait_up http://127.0.0.1:8302; wait_up http://127.0.0.1:8303
  $C router --replica http://127.0.0.1:8302 --replica http://127.0.0.1:8303 --routing $R --port 8304 --log-level warning --no-access-log & PR=$!
  wait_up http://127.0.0.1:8304
  echo "== two replicas x 1 thread, router $R"; $C bench $B --base-url http://127.0.0.1:8304 --out ${OUT:-/tmp}/dp-$R.json 2>&1 | tail -32
  curl -s http://127.0.0.1:8304/router/replicas; echo
  hits 8302 8303
  kill $PR $P2 $P3; wait $PR $P2 $P3
done
date -u +%H:%M
