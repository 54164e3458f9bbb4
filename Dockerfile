# syntax=docker/dockerfile:1
#
# outbox-relay runtime image.
#
#   docker build -t outbox-relay .
#   docker build --build-arg EXTRAS=otel,console -t outbox-relay:full .   # tracing + operator console
#   docker run --rm -e OUTBOX_RELAY_DATABASE__DSN=... -e OUTBOX_RELAY_KAFKA__BOOTSTRAP_SERVERS=... outbox-relay
#
# Stage 1 builds the project wheel (and collects binary wheels of its runtime
# dependencies); stage 2 installs only those wheels. The final image has no
# compiler, no build tooling beyond pip and no tests; optional extras only when
# EXTRAS names them (comma-separated: otel, console).

ARG PYTHON_IMAGE=python:3.11-slim
ARG EXTRAS=""

# ---------------------------------------------------------------------------
FROM ${PYTHON_IMAGE} AS builder
ARG EXTRAS

ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

WORKDIR /src
# Only what the wheel is built from (see .dockerignore).
COPY pyproject.toml README.md ./
COPY outbox_relay ./outbox_relay

# The project itself: pure Python, built without its dependencies.
RUN pip wheel --no-deps --wheel-dir /dist .
# Its runtime dependencies (psycopg[binary], confluent-kafka, ...) as prebuilt
# wheels only: if one ever needs compiling, the build fails here instead of
# silently pulling a toolchain into the image.
RUN wheel=$(ls /dist/*.whl) \
 && pip wheel --only-binary=:all: --wheel-dir /wheels "${wheel}${EXTRAS:+[$EXTRAS]}"

# ---------------------------------------------------------------------------
FROM ${PYTHON_IMAGE}
ARG EXTRAS

LABEL org.opencontainers.image.title="outbox-relay" \
      org.opencontainers.image.description="Relays a PostgreSQL transactional outbox to Kafka" \
      org.opencontainers.image.licenses="MIT"

# MALLOC_ARENA_MAX=2: fewer glibc malloc arenas for the relay's many threads (each
# librdkafka producer runs its own). Measured (bench/restart_rss.py): 12 broker restarts, each
# with 4 000 messages in flight and the producer replaced, raised RSS by 18.0 MB with the
# default and by 14.8 MB with 2 arenas, both levelling off after 3-5 restarts; replaced
# producers and their threads are freed either way. A small effect, not a fix.
ENV PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    OUTBOX_RELAY_LOG__FORMAT=json \
    MALLOC_ARENA_MAX=2

# Install from the builder's wheels only (no index), without copying them into a layer.
RUN --mount=type=bind,from=builder,source=/wheels,target=/wheels \
    pip install --no-index --find-links=/wheels "outbox-relay${EXTRAS:+[$EXTRAS]}" \
 && groupadd --system --gid 10001 relay \
 && useradd --system --uid 10001 --gid relay --no-create-home --home-dir /nonexistent \
        --shell /usr/sbin/nologin relay

# Numeric uid so Kubernetes' runAsNonRoot can verify it without /etc/passwd.
USER 10001:10001
WORKDIR /tmp

# Metrics, /healthz and /readyz (metrics.port default).
EXPOSE 9464

# slim has no curl: probe /healthz with the standard library. A 503 (dead worker
# threads) raises HTTPError and exits non-zero. Follows OUTBOX_RELAY_METRICS__PORT
# if it is overridden. Only meaningful for `run`; `migrate` and other one-shot
# commands exit long before the first probe.
HEALTHCHECK --interval=15s --timeout=5s --start-period=30s --retries=3 \
    CMD ["python", "-c", "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:%s/healthz' % os.environ.get('OUTBOX_RELAY_METRICS__PORT', '9464'), timeout=4)"]

# PID 1 and signals: we rely on the exec-form ENTRYPOINT, no tini.
# The relay runs as PID 1 directly (no shell in between), and it installs its own
# SIGTERM/SIGINT handlers (stop claiming, wait up to relay.shutdown_timeout_seconds
# for in-flight batches, release the rest, exit 0; a second signal exits at once).
# The kernel only drops signals to PID 1 that have *default* disposition, so handled
# signals arrive normally. The relay starts no child processes, so there are no
# zombies for an init to reap. If you wrap the command in a shell script or add
# subprocesses, run with `docker run --init` (or add tini) instead.
# Give the container more than shutdown_timeout_seconds to stop (docker stop -t 30,
# compose stop_grace_period, k8s terminationGracePeriodSeconds).
STOPSIGNAL SIGTERM
ENTRYPOINT ["outbox-relay"]
CMD ["run"]
