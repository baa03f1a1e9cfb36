#!/usr/bin/env bash
# The gateway's instructions per generated token, counted by valgrind (callgrind): the same on a
# quiet or a busy machine, where CPU-time figures are not. Serves MODEL on the CPU backend with
# the gateway under callgrind (counting only while an answer streams), streams one answer of
# SHORT and one of LONG tokens (end-of-sequence ignored, seeded), and prints the difference of
# their counts per token: the per-token path alone (request set-up cancels out, and the
# gateway's background work, counted over an idle stretch, is taken out in proportion to the
# answers' durations). Build with cargo build --release, then
#
#   scripts/bench/gateway_instructions.sh tiny.ninfer
#
# BIN directory of ninfer and its sibling binaries (default target/release); SHORT (50), LONG (250)
set -euo pipefail
cd "$(dirname "$0")/../.." || exit 1
MODEL=${1:?usage: gateway_instructions.sh MODEL}
BIN=${BIN:-target/release}
SHORT=${SHORT:-50}
LONG=${LONG:-250}
PORT=${PORT:-18471}
command -v valgrind >/dev/null || { echo "needs valgrind (callgrind_control comes with it)" >&2; exit 1; }
work=$(mktemp -d)
server=
trap '[[ -n $server ]] && kill "$server" 2>/dev/null; wait 2>/dev/null; rm -rf "$work"' EXIT
# ninfer starts the binaries next to its own: a copy of it beside the real engine and worker
# and a gateway that runs under callgrind.
mkdir "$work/bin"
ln "$(realpath "$BIN/ninfer")" "$work/bin/ninfer" 2>/dev/null || cp "$(realpath "$BIN/ninfer")" "$work/bin/ninfer"
ln -s "$(realpath "$BIN/ninfer-engine")" "$(realpath "$BIN/ninfer-expert-worker")" "$work/bin/"
cat >"$work/bin/ninfer-gateway" <<EOF
#!/bin/sh
exec valgrind --tool=callgrind --instr-atstart=no --callgrind-out-file=$work/callgrind.out \
  $(realpath "$BIN/ninfer-gateway") "\$@"
EOF
chmod +x "$work/bin/ninfer-gateway"
"$work/bin/ninfer" run "$MODEL" --serve --listen "127.0.0.1:$PORT" --device cpu --no-mtp \
  >"$work/server.log" 2>&1 &
server=$!
for _ in $(seq 1 300); do
  curl -sf -m 5 "127.0.0.1:$PORT/health" >/dev/null && break
  sleep 2
done
model=$(curl -sf "127.0.0.1:$PORT/v1/models" | sed -E 's/.*"id":"([^"]*)".*/\1/')
gateway=$(pgrep -f "valgrind.*$work/callgrind.out" | head -1)
answer() {
  curl -sfN -m 900 "127.0.0.1:$PORT/v1/chat/completions" -H 'content-type: application/json' \
    -d "{\"model\":\"$model\",\"stream\":true,\"max_tokens\":$1,\"ignore_eos\":true,\"seed\":7,\"messages\":[{\"role\":\"user\",\"content\":\"Tell me a long story.\"}]}" \
    >/dev/null
}
# Instructions counted while `$1` runs, then the seconds it took: "COUNT SECONDS".
counted() {
  callgrind_control -i on "$gateway" >/dev/null
  answer 5 # warm: the first answer's one-time work stays out
  callgrind_control -z "$gateway" >/dev/null
  local started
  started=$(date +%s.%N)
  "$@"
  callgrind_control -d "$1" "$gateway" >/dev/null
  local ended
  ended=$(date +%s.%N)
  callgrind_control -i off "$gateway" >/dev/null
  local dump
  dump=$(ls -t "$work"/callgrind.out.* | head -1)
  callgrind_annotate "$dump" 2>/dev/null |
    awk -v seconds="$(echo "$ended - $started" | bc)" \
      '/PROGRAM TOTALS/ && !seen {gsub(",", "", $1); print $1, seconds; seen = 1}'
}
# The gateway's background work (engine polling, timers) goes on while answers stream: counted
# over an idle stretch, it is taken out in proportion to the answers' durations.
read -r idle idle_seconds < <(counted sleep 5)
read -r short short_seconds < <(counted answer "$SHORT")
read -r long long_seconds < <(counted answer "$LONG")
awk -v idle="$idle" -v idle_s="$idle_seconds" -v short="$short" -v short_s="$short_seconds" \
  -v long="$long" -v long_s="$long_seconds" -v tokens="$((LONG - SHORT))" 'BEGIN {
  background = idle / idle_s
  printf "gateway instructions: %d for %d tokens (%.1f s), %d for %d (%.1f s), %d per second idle\n",
    short, '"$SHORT"', short_s, long, '"$LONG"', long_s, background
  printf "per generated token: %d (%d with the background of the longer answer)\n",
    (long - short - background * (long_s - short_s)) / tokens, (long - short) / tokens
}'
