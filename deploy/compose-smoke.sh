#!/usr/bin/env bash
# Runs docker-compose.yml for real on this machine, as a user would, and checks what a user needs:
# builds the image, starts the three services, waits (with a deadline) until every container's
# health check passes, then checks that none restarted, that the engine built or loaded Folio's
# CPU kernels and compiled its decode steps (not the eager fallback; they get ready after the
# health check passes) and that the programs landed in the model-cache volume, and asks the gateway on http://127.0.0.1:8000 for one chat
# completion and one streamed chat completion, which it must stream from the engine on its
# Generate socket (not gRPC's fallback). `make test` runs it (see the Makefile).
#
# Docker is used when its daemon answers and `docker compose` exists; otherwise podman with
# podman-compose (the Debian packages podman, runc and debootstrap, and podman-compose==1.6.0
# from PyPI, which `make compose-smoke` installs). On a machine that reaches only package
# registries (no container registry), as Folio's CI machines do:
#   - the Dockerfile's base image is built here from Debian packages (debootstrap of bookworm,
#     python3 with its headers in a venv on PATH, as python:3.11-slim has them) and tagged with
#     the Dockerfile's FROM name;
#   - torch comes from a PEP 503 index served on 127.0.0.1 holding the CPU wheel pip finds for
#     the pinned version (PyPI's Linux wheel is the multi-gigabyte CUDA build), handed to the
#     build as TORCH_INDEX_URL; the build uses the host's network to reach it;
#   - podman runs with runc and ulimits no higher than the host's (its defaults exceed what this
#     sandbox allows), set in a containers.conf of its own (CONTAINERS_CONF), never in /etc.
# Idempotent: the base image, the wheelhouse and the image's layers are reused by later runs;
# the containers and their network are removed on exit, the model-cache volume is kept (the
# first start compiles decode steps into it). Podman 4.3 ignores
# compose's healthcheck conditions (the gateway then starts first and reconnects) and, without
# systemd, never runs health checks by itself: here they are run with `podman healthcheck run`.
#
#   deploy/compose-smoke.sh            # as root; exit 0 once every check passed
# Environment: FOLIO_SMOKE_DIR (work folder, default /var/tmp/folio-compose-smoke),
# FOLIO_SMOKE_TIMEOUT (seconds to wait for every container to be healthy, default 1200).
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
WORK=${FOLIO_SMOKE_DIR:-/var/tmp/folio-compose-smoke}
TIMEOUT=${FOLIO_SMOKE_TIMEOUT:-1200}
PROJECT=folio-smoke
HTTP=http://127.0.0.1:8000
BASE_IMAGE=$(sed -n 's/^FROM \([^ ]*\).*/\1/p' "$ROOT/Dockerfile" | head -n 1)
IMAGE=$(sed -n 's/^ *image: *\([^ ]*\).*/\1/p' "$ROOT/docker-compose.yml" | head -n 1)
TORCH_PIN=$(grep -o '"torch==[^"]*"' "$ROOT/pyproject.toml" | tr -d '"')
PYTHON=$(command -v python3)
# The base image's version: a base built by an older version of this script is built again.
BASE_VERSION=2
mkdir -p "$WORK"

log() { printf 'compose-smoke: %s\n' "$*" >&2; }
die() {
    log "error: $*"
    exit 1
}

# -- which container engine ---------------------------------------------------------------------
if docker info >/dev/null 2>&1 && docker compose version >/dev/null 2>&1; then
    ENGINE=docker
    COMPOSE=(docker compose)
elif command -v podman >/dev/null; then
    ENGINE=podman
    command -v podman-compose >/dev/null ||
        die "podman is installed but podman-compose is not on PATH (pip install podman-compose==1.6.0)"
    COMPOSE=(podman-compose)
    # runc as the runtime; ulimits at most the host's (podman's defaults for root are higher,
    # and runc then fails with "error setting rlimit ... operation not permitted"). Processes:
    # here runc could not set more than kernel.pid_max either.
    nproc=$(ulimit -Hu)
    pid_max=$(cat /proc/sys/kernel/pid_max)
    if [ "$nproc" = unlimited ] || [ "$nproc" -gt "$pid_max" ]; then nproc=$pid_max; fi
    nofile=$(ulimit -Hn)
    export CONTAINERS_CONF="$WORK/containers.conf"
    cat >"$CONTAINERS_CONF" <<EOF
[containers]
default_ulimits = ["nofile=$nofile:$nofile", "nproc=$nproc:$nproc"]

[engine]
runtime = "runc"
EOF
else
    die "neither a running docker (with compose) nor podman is installed (apt-get install podman)"
fi
log "using $ENGINE; image $IMAGE from base $BASE_IMAGE"
compose() { "${COMPOSE[@]}" -p "$PROJECT" -f "$ROOT/docker-compose.yml" "$@"; }

# -- the base image, from Debian packages ------------------------------------------------------
if [ "$("$ENGINE" image inspect --format '{{index .Config.Labels "folio.smoke-base"}}' \
    "$BASE_IMAGE" 2>/dev/null)" = "$BASE_VERSION" ]; then
    log "base image $BASE_IMAGE: present"
else
    command -v debootstrap >/dev/null || die "debootstrap is missing (apt-get install debootstrap)"
    [ "$(id -u)" = 0 ] || die "building the base image (debootstrap, chroot) needs root"
    ROOTFS="$WORK/rootfs"
    rm -rf "$ROOTFS"
    log "base image $BASE_IMAGE: debootstrap of bookworm into $ROOTFS"
    debootstrap --variant=minbase --include=python3,python3-venv,python3-dev,ca-certificates \
        bookworm "$ROOTFS" http://deb.debian.org/debian >"$WORK/debootstrap.log" 2>&1 ||
        die "debootstrap failed; see $WORK/debootstrap.log"
    # CAs this host added (an egress proxy's, on a sandboxed machine) are trusted inside too,
    # and pip, whose own CA bundle would not hold them, uses the system's.
    if compgen -G "/usr/local/share/ca-certificates/*.crt" >/dev/null; then
        cp /usr/local/share/ca-certificates/*.crt "$ROOTFS/usr/local/share/ca-certificates/"
        chroot "$ROOTFS" update-ca-certificates >/dev/null
    fi
    chroot "$ROOTFS" python3 -m venv /opt/venv
    rm -rf "$ROOTFS"/var/cache/apt/archives/*.deb "$ROOTFS"/var/lib/apt/lists/*
    tar -C "$ROOTFS" -c . | "$ENGINE" import \
        --change 'ENV PATH=/opt/venv/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
        --change 'ENV PIP_CERT=/etc/ssl/certs/ca-certificates.crt' \
        --change 'CMD ["python3"]' --change "LABEL folio.smoke-base=$BASE_VERSION" \
        - "$BASE_IMAGE" >/dev/null
    rm -rf "$ROOTFS"
fi

# -- torch's CPU wheel on a local PEP 503 index ------------------------------------------------
WHEELS="$WORK/wheels"
INDEX="$WORK/index/simple"
if ! compgen -G "$WHEELS/torch-*.whl" >/dev/null; then
    log "downloading $TORCH_PIN (the CPU wheel pip finds here) and its dependencies"
    "$PYTHON" -m pip download --quiet --only-binary=:all: -d "$WHEELS" "$TORCH_PIN"
fi
case $(basename "$(compgen -G "$WHEELS/torch-*.whl" | head -n 1)") in
    *+cpu-*) ;;
    *) die "the torch wheel pip found is not the CPU build: $(ls "$WHEELS"/torch-*.whl)" ;;
esac
rm -rf "$INDEX"
for wheel in "$WHEELS"/*.whl; do
    file=$(basename "$wheel")
    # PEP 503 names: the distribution name normalized (lower case, runs of -_. as one -).
    name=$(echo "${file%%-*}" | tr '[:upper:]' '[:lower:]' | sed -E 's/[-_.]+/-/g')
    mkdir -p "$INDEX/$name"
    ln -sf "$wheel" "$INDEX/$name/$file"
done
for project in "$INDEX"/*/; do
    {
        echo '<!DOCTYPE html><html><body>'
        for wheel in "$project"*.whl; do
            printf '<a href="%s">%s</a>\n' "$(basename "$wheel")" "$(basename "$wheel")"
        done
        echo '</body></html>'
    } >"$project/index.html"
done

INDEX_PORT=$("$PYTHON" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
"$PYTHON" -m http.server --bind 127.0.0.1 --directory "$WORK/index" "$INDEX_PORT" >"$WORK/index.log" 2>&1 &
INDEX_PID=$!
STARTED=0
# A service's container by name (compose's labels; docker and podman-compose name them
# differently).
SERVICES=(tokenizer engine gateway)
container() {
    "$ENGINE" ps -aq --filter "label=com.docker.compose.project=$PROJECT" \
        --filter "label=com.docker.compose.service=$1"
}
# The project's containers with their anonymous volumes (the image's VOLUME where nothing is
# mounted: the gateway's), the gateway first (podman refuses to remove a container another one
# depends on), then its network; `compose down` alone would leave those volumes.
remove_containers() {
    compose stop >/dev/null 2>&1 || true
    for service in gateway engine tokenizer; do
        mapfile -t ids < <(container "$service")
        [ "${#ids[@]}" = 0 ] || "$ENGINE" rm -f -v "${ids[@]}" >/dev/null
    done
    compose down >/dev/null 2>&1 || true
}
cleanup() {
    status=$?
    kill "$INDEX_PID" 2>/dev/null || true
    if [ "$STARTED" = 1 ]; then
        if [ "$status" != 0 ]; then
            log "failed; the services' last log lines:"
            compose logs --tail 30 >&2 2>&1 || true
        fi
        log "removing the containers (the model-cache volume stays)"
        remove_containers
    fi
    exit "$status"
}
trap cleanup EXIT
for _ in $(seq 50); do
    curl -fsS "http://127.0.0.1:$INDEX_PORT/simple/torch/" >/dev/null 2>&1 && break
    sleep 0.1
done

# -- build, start, check ------------------------------------------------------------------------
log "building $IMAGE (torch from http://127.0.0.1:$INDEX_PORT/simple)"
build_pull=()
[ "$ENGINE" = podman ] && build_pull=(--pull=never)
"$ENGINE" build "${build_pull[@]}" --network host \
    --build-arg "TORCH_INDEX_URL=http://127.0.0.1:$INDEX_PORT/simple" -t "$IMAGE" "$ROOT"

remove_containers # left over from an interrupted run
# Podman keeps its lock numbers on disk and the locks in shared memory: after this machine
# restarts, a new container can draw the lock the model-cache volume holds and fail to start
# ("deadlock due to lock mismatch"). Renumbered while none of podman's containers runs.
if [ "$ENGINE" = podman ] && [ -z "$(podman ps -q)" ]; then
    podman system renumber
fi
if curl -s -o /dev/null "$HTTP/health"; then
    die "something already listens on port 8000; stop it first"
fi
# The engine and the tokenizer require this of the gateway on the compose network.
export FOLIO_INTERNAL_TOKEN=${FOLIO_INTERNAL_TOKEN:-$(head -c 24 /dev/urandom | od -An -tx1 | tr -d ' \n')}
STARTED=1
log "starting the services"
compose up -d --no-build

# A container's own health check, as compose defined it: docker runs it by itself; podman without
# systemd does not, so it is run here (which also records its result).
healthy() {
    if [ "$ENGINE" = podman ]; then
        podman healthcheck run "$1" >/dev/null 2>&1
    else
        [ "$(docker inspect --format '{{.State.Health.Status}}' "$1")" = healthy ]
    fi
}
restarts() { "$ENGINE" inspect --format '{{.RestartCount}}' "$1"; }
up_at=$SECONDS
log "waiting for every container to be healthy (a first start compiles decode steps)"
deadline=$((SECONDS + TIMEOUT))
for service in "${SERVICES[@]}"; do
    id=$(container "$service")
    [ -n "$id" ] || die "no container for the $service service"
    until healthy "$id"; do
        [ "$SECONDS" -lt "$deadline" ] || die "the $service container was not healthy after ${TIMEOUT}s"
        [ "$(restarts "$id")" = 0 ] || die "the $service container restarted before it was healthy"
        sleep 2
    done
    log "$service healthy ${SECONDS}s into the run, $((SECONDS - up_at))s after the start"
done

for service in "${SERVICES[@]}"; do
    count=$(restarts "$(container "$service")")
    [ "$count" = 0 ] || die "the $service container restarted $count times"
done
# The engine serves eagerly at once and switches to its compiled decode steps when they are
# ready (built in the background on a first start, loaded from the volume after).
engine_logs() { "$ENGINE" logs "$(container engine)" 2>&1; }
log "waiting for the engine's compiled decode steps"
until grep -qE "compiled decode steps (\(batches of|unavailable)" <<<"$(engine_logs)"; do
    [ "$SECONDS" -lt "$deadline" ] || die "no compiled decode steps after ${TIMEOUT}s"
    sleep 2
done
engine_log=$(engine_logs)
for expected in "Folio's CPU kernels ready" "compiled decode steps (batches of"; do
    grep -qF "$expected" <<<"$engine_log" || die "the engine never logged \"$expected\""
done
if grep -F " unavailable (" <<<"$engine_log"; then
    die "the engine fell back from a speed-up (above)"
fi
"$ENGINE" exec "$(container engine)" sh -c 'ls -A "$FOLIO_CACHE_DIR/compiled-decode" | grep -q .' ||
    die "no compiled decode programs in the model-cache volume: every start would compile again"
log "no restarts; the engine runs Folio's kernels and compiled decode steps, stored in the volume"
log "engine: $(grep -F "compiled decode steps (" <<<"$engine_log" | sed 's/.* INFO //')"

request='{
  "model": "SmolLM2-135M-Instruct",
  "messages": [{"role": "user", "content": "Say hello."}],
  "max_tokens": 16, "temperature": 0'
log "asking for one chat completion, then the same streamed"
response=$(curl -fsS "$HTTP/v1/chat/completions" -H 'Content-Type: application/json' -d "$request}")
stream=$(curl -fsS -N "$HTTP/v1/chat/completions" -H 'Content-Type: application/json' \
    -d "$request, \"stream\": true}")
"$PYTHON" - "$response" "$stream" <<'EOF'
import json
import sys

body = json.loads(sys.argv[1])
content = body["choices"][0]["message"]["content"]
assert body["object"] == "chat.completion", body
assert content and body["usage"]["completion_tokens"] > 0, body
print(f"compose-smoke: served by {body['model']}: {content!r}", file=sys.stderr)

# Server-sent events: chunks, then [DONE]. (Not necessarily the text above: the second request
# finds its prompt in the prefix cache, and in bfloat16, the default on CPUs that have it, a
# prefill that extends cached blocks may break a near-tie between two tokens the other way.)
events = [line[len("data: ") :] for line in sys.argv[2].splitlines() if line.startswith("data: ")]
assert events and events[-1] == "[DONE]", sys.argv[2]
chunks = [json.loads(event) for event in events[:-1]]
assert all(chunk["object"] == "chat.completion.chunk" for chunk in chunks), chunks
streamed = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
finish = [c["choices"][0].get("finish_reason") for c in chunks if c["choices"]][-1]
assert streamed and finish in ("stop", "length"), chunks
print(f"compose-smoke: streamed in {len(chunks)} chunks: {streamed!r}", file=sys.stderr)
EOF
grep -qF "streaming on its Generate socket" <<<"$("$ENGINE" logs "$(container gateway)" 2>&1)" ||
    die "the gateway did not stream on the engine's Generate socket"
log "the gateway streams on the engine's Generate socket"
size=$("$ENGINE" image inspect --format '{{.Size}}' "$IMAGE")
log "image $IMAGE: $((size / 1000000)) MB"
log "ok after ${SECONDS}s"
