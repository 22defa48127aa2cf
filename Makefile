# Each target installs what it needs into .venv first.
VENV ?= .venv
PY := $(VENV)/bin/python
PYTEST_ARGS ?=

.PHONY: demo test test-slow lint format clean bench bench-quick

$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch first and pinned, so nothing else can pull a different (CUDA) build.
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[dev,bench,hf]'
	touch $@

demo: $(VENV)/.installed
	$(VENV)/bin/torchrun --nproc-per-node 4 examples/train_gpt.py --node-size 2 --steps 100

test: $(VENV)/.installed
	$(VENV)/bin/ruff check .
	$(PY) -m pytest -q -p no:cacheprovider --durations=20 $(PYTEST_ARGS)

# The broadest matrices (marked slow): CI runs them after `make test`.
test-slow: $(VENV)/.installed
	$(PY) -m pytest -q -p no:cacheprovider -m slow --durations=20 $(PYTEST_ARGS)

# The emulated multi-node benchmark (root, iproute2): DDP, FSDP2, DeepSpeed, zppc.
bench: $(VENV)/.installed
	# DeepSpeed, for its rows only: no CUDA ops, built against the pinned torch.
	DS_BUILD_OPS=0 $(PY) -m pip install -q --no-build-isolation deepspeed
	$(PY) benchmarks/run.py --nodes 2 --ranks-per-node 2 --inter-bw 1gbit,100mbit --steps 20

bench-quick: $(VENV)/.installed
	$(PY) -m pip install -q -e '.[bench]'
	$(PY) benchmarks/run.py --quick

lint: $(VENV)/.installed
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

format: $(VENV)/.installed
	$(VENV)/bin/ruff format .
	$(VENV)/bin/ruff check --fix .

clean:
	rm -rf $(VENV) build *.egg-info
