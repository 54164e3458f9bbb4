#!/usr/bin/env bash
# A Confluent-compatible Schema Registry (Apicurio Registry 3, in-memory storage) on the
# loopback interface, for tests and local runs. See README.md next to this file.
#
#   registry.sh build          unpack the registry from Maven Central into target/quarkus-app
#   registry.sh start [PORT]   build if needed, start in the background, wait until it answers;
#                              prints the Confluent-compatible URL (PORT: 18081 by default)
#   registry.sh stop           stop the registry this script started (its pid file)
#   registry.sh url            print the URL of the running one
#
# Environment: REGISTRY_STATE_DIR (pid, port and log; default target/run), REGISTRY_JAVA
# (a java of version 21+; found under JAVA_HOME or /usr/lib/jvm otherwise), REGISTRY_HEAP
# (maximum heap, default 256m), REGISTRY_START_TIMEOUT (seconds, default 120).
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
app=$here/target/quarkus-app
state=${REGISTRY_STATE_DIR:-$here/target/run}
version=$(sed -n 's|.*<apicurio.version>\(.*\)</apicurio.version>.*|\1|p' "$here/pom.xml")

die() { echo "registry.sh: $*" >&2; exit 1; }

# The registry's classes are Java 21 bytecode: an older java fails with
# UnsupportedClassVersionError, so the first java of version 21 or newer is taken.
find_java() {
  local candidates=() j v
  [ -n "${REGISTRY_JAVA:-}" ] && candidates+=("$REGISTRY_JAVA")
  [ -n "${JAVA_HOME:-}" ] && candidates+=("$JAVA_HOME/bin/java")
  candidates+=("$(command -v java || true)")
  for j in /usr/lib/jvm/*/bin/java; do candidates+=("$j"); done
  for j in "${candidates[@]}"; do
    [ -x "$j" ] || continue
    v=$("$j" -XshowSettings:properties -version 2>&1 | sed -n 's/^ *java.specification.version = //p')
    if [ -n "$v" ] && [ "${v%%.*}" -ge 21 ]; then echo "$j"; return 0; fi
  done
  die "no java of version 21 or newer (set REGISTRY_JAVA or JAVA_HOME)"
}

build() {
  command -v mvn >/dev/null 2>&1 || die "mvn not found (Maven fetches the registry from Maven Central)"
  # the stamp names the version unpacked: a changed <apicurio.version> rebuilds from clean,
  # so no jar of the previous version stays in lib/main
  if [ -f "$app/quarkus-run.jar" ] && [ "$(cat "$app/.version" 2>/dev/null)" = "$version" ]; then
    return 0
  fi
  echo "== unpacking Apicurio Registry $version (java/registry/pom.xml) into $app" >&2
  nice -n 19 mvn -q -B -f "$here/pom.xml" clean package >&2
  echo "$version" > "$app/.version"
}

url_of() { echo "http://127.0.0.1:$1/apis/ccompat/v7"; }

running_pid() {
  local pid
  pid=$(cat "$state/registry.pid" 2>/dev/null) || return 1
  kill -0 "$pid" 2>/dev/null && echo "$pid"
}

start() {
  local port=${1:-18081} java pid deadline
  if pid=$(running_pid); then
    die "already running (pid $pid, $(url_of "$(cat "$state/registry.port")"))"
  fi
  build
  java=$(find_java)
  mkdir -p "$state"
  # Every listener on 127.0.0.1: tests send traffic to the loopback interface only. The
  # management interface (health, metrics) takes a free port so that two registries, or a
  # registry and another Quarkus service, never both want its default 9000.
  nohup "$java" -Xmx"${REGISTRY_HEAP:-256m}" -XX:+UseSerialGC -XX:TieredStopAtLevel=1 \
    -Dquarkus.http.host=127.0.0.1 -Dquarkus.http.port="$port" \
    -Dquarkus.management.host=127.0.0.1 -Dquarkus.management.port=0 \
    -jar "$app/quarkus-run.jar" > "$state/registry.log" 2>&1 < /dev/null &
  pid=$!
  echo "$pid" > "$state/registry.pid"
  echo "$port" > "$state/registry.port"
  deadline=$(( $(date +%s) + ${REGISTRY_START_TIMEOUT:-120} ))
  # ready = this process says it listens on the port, and the API answers there (an answer
  # alone could come from another server already holding the port)
  until grep -q "Listening on: http://127.0.0.1:$port\b" "$state/registry.log" \
      && curl -sf -o /dev/null "$(url_of "$port")/subjects"; do
    if ! kill -0 "$pid" 2>/dev/null; then
      tail -n 20 "$state/registry.log" >&2
      die "the registry exited while starting (log: $state/registry.log)"
    fi
    if [ "$(date +%s)" -ge "$deadline" ]; then
      kill "$pid" 2>/dev/null || true
      die "no answer on port $port within ${REGISTRY_START_TIMEOUT:-120}s (log: $state/registry.log)"
    fi
    sleep 0.2
  done
  url_of "$port"
}

stop() {
  local pid
  pid=$(running_pid) || { rm -f "$state/registry.pid"; return 0; }
  kill "$pid"
  for _ in $(seq 1 100); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
  kill -0 "$pid" 2>/dev/null && kill -9 "$pid"
  rm -f "$state/registry.pid"
}

case "${1:-}" in
  build) build ;;
  start) start "${2:-}" ;;
  stop) stop ;;
  url) running_pid >/dev/null || die "not running"; url_of "$(cat "$state/registry.port")" ;;
  *) sed -n '2,13p' "$0" | sed 's/^# \{0,1\}//'; exit 2 ;;
esac
