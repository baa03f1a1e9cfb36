#!/usr/bin/env bash
# What one token costs any process that forwards it as the gateway does, on this machine: a
# minimal C relay sleeps in epoll_wait, reads a message from a unix socket (as the engine's
# stream arrives) and writes a 228-byte chunk to a TCP connection (as an SSE chunk leaves), one
# message per GAP seconds; it prints its CPU time per message. Run it beside a served model that
# is generating (so the caches are as cold as the gateway finds them) and compare with the
# gateway's CPU per token from `ninfer bench serve`: the difference is the gateway's own work.
#
#   scripts/bench/wakeup_floor.sh [GAP_SECONDS (0.019)] [MESSAGES (300)]
set -euo pipefail
GAP=${1:-0.019}
MESSAGES=${2:-300}
command -v cc >/dev/null || { echo "needs a C compiler (cc)" >&2; exit 1; }
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cat >"$work/relay.c" <<'EOF'
#include <arpa/inet.h>
#include <netinet/in.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>
/* relay MESSAGES TCP_PORT UNIX_PATH: CPU time per forwarded message, the first 5 left out. */
int main(int argc, char **argv) {
  if (argc != 4) return 2;
  int messages = atoi(argv[1]);
  int listener = socket(AF_UNIX, SOCK_STREAM, 0);
  struct sockaddr_un unix_address = {.sun_family = AF_UNIX};
  strncpy(unix_address.sun_path, argv[3], sizeof unix_address.sun_path - 1);
  if (bind(listener, (void *)&unix_address, sizeof unix_address) || listen(listener, 1)) return 1;
  int client = socket(AF_INET, SOCK_STREAM, 0);
  struct sockaddr_in tcp_address = {.sin_family = AF_INET, .sin_port = htons(atoi(argv[2]))};
  inet_pton(AF_INET, "127.0.0.1", &tcp_address.sin_addr);
  if (connect(client, (void *)&tcp_address, sizeof tcp_address)) return 1;
  int engine = accept(listener, 0, 0);
  int poller = epoll_create1(0);
  struct epoll_event event = {.events = EPOLLIN};
  epoll_ctl(poller, EPOLL_CTL_ADD, engine, &event);
  char incoming[4096], chunk[228];
  memset(chunk, 'x', sizeof chunk);
  struct timespec start = {0}, end;
  int forwarded = 0;
  while (forwarded < messages) {
    epoll_wait(poller, &event, 1, -1);
    if (read(engine, incoming, sizeof incoming) <= 0) break;
    if (forwarded == 5) clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &start);
    if (write(client, chunk, sizeof chunk) != sizeof chunk) return 1;
    forwarded++;
  }
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &end);
  double micros = ((end.tv_sec - start.tv_sec) * 1e9 + (end.tv_nsec - start.tv_nsec)) / 1e3;
  printf("%.1f us of CPU per message (%d messages)\n", micros / (forwarded - 5), forwarded - 5);
  return 0;
}
EOF
cc -O2 -o "$work/relay" "$work/relay.c"
python3 - "$work" "$GAP" "$MESSAGES" <<'EOF'
import socket, subprocess, sys, threading, time
work, gap, messages = sys.argv[1], float(sys.argv[2]), int(sys.argv[3])
sink = socket.socket()
sink.bind(("127.0.0.1", 0))
sink.listen(1)
path = f"{work}/engine.sock"
relay = subprocess.Popen([f"{work}/relay", str(messages), str(sink.getsockname()[1]), path])
client, _ = sink.accept()
threading.Thread(target=lambda: [client.recv(65536) for _ in iter(int, 1)], daemon=True).start()
engine = socket.socket(socket.AF_UNIX)
for _ in range(100):
    try:
        engine.connect(path)
        break
    except OSError:
        time.sleep(0.02)
for _ in range(messages):
    engine.send(b"m" * 60)  # about one engine token message
    time.sleep(gap)
# Messages close together may arrive in one read: the relay then stops at the end of the stream.
engine.close()
sys.exit(relay.wait())
EOF
