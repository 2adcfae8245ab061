"""Generate the Python stubs for kvshuttle's protos: `python protos/generate.py [OUT_DIR]`.

Stubs go to protos/gen/ (importable as `kvshuttle.v1`). Never edit them by hand; run this instead.
tests/slow/test_protos.py fails when the committed stubs differ from a fresh generation.
"""

from __future__ import annotations

import sys
from importlib import resources
from pathlib import Path

from grpc_tools import protoc

PROTO_ROOT = Path(__file__).resolve().parent
DEFAULT_OUT = PROTO_ROOT / "gen"


def proto_files() -> list[Path]:
    return sorted((PROTO_ROOT / "kvshuttle").rglob("*.proto"))


def generate(out_dir: Path = DEFAULT_OUT) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    well_known = str(resources.files("grpc_tools") / "_proto")
    files = [str(p.relative_to(PROTO_ROOT)) for p in proto_files()]
    args = [
        "grpc_tools.protoc",
        f"-I{PROTO_ROOT}",
        f"-I{well_known}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        *files,
    ]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed")
    for pkg in {(out_dir / f).parent for f in files} | {out_dir / "kvshuttle"}:
        (pkg / "__init__.py").write_text("")
    return sorted(p for p in out_dir.rglob("*") if p.is_file() and "__pycache__" not in p.parts)


if __name__ == "__main__":
    target = Path(sys.argv[1]) if len(sys.argv) > 1 else DEFAULT_OUT
    for path in generate(target):
        print(path.relative_to(target))
