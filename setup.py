"""The gRPC stubs (clipstream/v1/*_pb2*.py and .pyi) are generated from protos/ when the package is built, so a wheel
or an install made from a clean checkout carries them (`make` generates the same files for the editable checkout).
Everything else about the build is in pyproject.toml."""

from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py


class BuildWithStubs(build_py):
    def run(self):
        import grpc_tools
        from grpc_tools import protoc  # a build requirement (pyproject.toml [build-system])

        protos = sorted(str(p) for p in Path("protos/clipstream/v1").glob("*.proto"))
        if protos:  # (an sdist or a copy without protos/ carries the stubs already)
            include = str(Path(grpc_tools.__file__).parent / "_proto")  # google/protobuf/*.proto
            code = protoc.main(["grpc_tools.protoc", "-Iprotos", f"-I{include}", "--python_out=.", "--pyi_out=.",
                                "--grpc_python_out=.", *protos])
            if code != 0:
                raise RuntimeError(f"protoc failed (exit {code}) on {protos}")
        super().run()


setup(cmdclass={"build_py": BuildWithStubs})
