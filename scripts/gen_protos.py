"""Regenerate the committed Python gRPC code from services/common/kubelet/*.proto.

Run: python scripts/gen_protos.py [--out DIR]  (tests compare a fresh run with the tree).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from grpc_tools import protoc

ROOT = Path(__file__).resolve().parent.parent
PROTO_DIR = Path("services/common/kubelet")


def generate(out_dir: Path) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    for proto in sorted((ROOT / PROTO_DIR).glob("*.proto")):
        relative = proto.relative_to(ROOT)
        status = protoc.main(
            [
                "grpc_tools.protoc",
                f"-I{ROOT}",
                f"--python_out={out_dir}",
                f"--pyi_out={out_dir}",
                f"--grpc_python_out={out_dir}",
                str(relative),
            ]
        )
        if status != 0:
            sys.exit(f"protoc failed on {relative}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, default=ROOT)
    generate(parser.parse_args().out)
