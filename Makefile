# `make demo` and `make test` do all set-up first; nothing else is needed on a fresh clone.
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.installed
PROTOS := $(wildcard protos/clipstream/v1/*.proto)
STUBS := $(patsubst protos/%.proto,%_pb2.py,$(PROTOS))

.PHONY: setup demo test stubs clean

setup: $(STAMP) $(STUBS)

# torch first (CPU wheels on local disk); DeepSpeed imports torch while it builds, so no build isolation.
$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q "torch==2.14.1" "torchvision==0.29.1"
	$(PIP) install -q --no-build-isolation "deepspeed>=0.18,<0.20"
	$(PIP) install -q -e ".[dev]"
	touch $(STAMP)

# gRPC stubs land in the clipstream package as clipstream/v1/*_pb2*.py (package clipstream.v1).
$(STUBS): %_pb2.py: protos/%.proto $(STAMP)
	$(PY) -m grpc_tools.protoc -Iprotos --python_out=. --pyi_out=. --grpc_python_out=. $<

stubs: $(STUBS)

demo: setup
	$(VENV)/bin/clipstream demo

test: setup
	$(PY) -m pytest tests

clean:
	rm -rf .clipstream clipstream/v1/*_pb2*
