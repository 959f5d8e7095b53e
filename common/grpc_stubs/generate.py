"""Generates the Python stubs of protos/ with grpcio-tools: `python -m common.grpc_stubs.generate`.

protoc writes imports relative to the proto root (`from folio.v1 import common_pb2`); they are
rewritten to live under this package, away from the top-level `folio` package (the CLI). Type
stubs (.pyi, for messages and services) come from mypy-protobuf's protoc plugins. The output
is a pure function of the .proto files and the grpcio-tools version, so a test can regenerate
and compare. Never hand-edit the output; never touch protos/.
"""

from __future__ import annotations

import re
import shutil
import sys
import tempfile
from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parent
PROTO_ROOT = PACKAGE_DIR.parents[1] / "protos"
# Where the generated modules go, inside PACKAGE_DIR: mirrors the proto package folio.v1.
GENERATED = Path("folio")
_IMPORT = re.compile(r"^from folio\.v1 import ", re.MULTILINE)


def proto_files() -> list[Path]:
    return sorted(PROTO_ROOT.glob("folio/**/*.proto"))


def generate(out_dir: Path) -> list[Path]:
    """Write the stubs of every proto under out_dir/folio/...; return the files written."""
    from grpc_tools import protoc

    out_dir.mkdir(parents=True, exist_ok=True)
    # mypy-protobuf's plugins, installed beside this interpreter.
    scripts = Path(sys.executable).parent
    args = [
        "grpc_tools.protoc",
        f"--proto_path={PROTO_ROOT}",
        f"--plugin=protoc-gen-mypy={scripts / 'protoc-gen-mypy'}",
        f"--plugin=protoc-gen-mypy_grpc={scripts / 'protoc-gen-mypy_grpc'}",
        f"--python_out={out_dir}",
        f"--mypy_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        f"--mypy_grpc_out={out_dir}",
        *(str(p) for p in proto_files()),
    ]
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed on {PROTO_ROOT}")
    written = sorted(p for p in (out_dir / GENERATED).rglob("*") if p.is_file())
    for path in written:
        path.write_text(_IMPORT.sub(f"from {__package__}.folio.v1 import ", path.read_text()))
    for package in {p.parent for p in written} | {out_dir / GENERATED}:
        (package / "__init__.py").write_text("")
    return sorted(p for p in (out_dir / GENERATED).rglob("*") if p.is_file())


def main() -> int:
    # Generate aside, then swap in: a failed run never leaves half a set of stubs.
    with tempfile.TemporaryDirectory(dir=PACKAGE_DIR) as staging:
        generate(Path(staging))
        shutil.rmtree(PACKAGE_DIR / GENERATED, ignore_errors=True)
        shutil.move(Path(staging) / GENERATED, PACKAGE_DIR / GENERATED)
    print(f"stubs of {len(proto_files())} protos in {PACKAGE_DIR / GENERATED}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
