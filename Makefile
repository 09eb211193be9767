# Two commands for a newcomer: `make lab` and `make test`. Both set up .venv first.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
CHROMIUM ?= /usr/bin/chromium

.PHONY: setup lab test unit lint bench browser clean data

# A fresh .venv takes about 6.5 GB (PyTorch alone 5.5): say so before pip fails halfway with "No space left".
NEED_KB := 7000000
$(STAMP): requirements.txt pyproject.toml
	@test -x $(PY) || { avail=$$(df -Pk . 2>/dev/null | awk 'NR==2 {print $$4}'); \
		if [ -n "$$avail" ] && [ "$$avail" -lt $(NEED_KB) ]; then \
		echo "make: .venv needs about 6.5 GB free (PyTorch is 5.5 GB); $$((avail / 1048576)) GB free here." \
		"Free some space (an old clone's .venv is 6.5 GB) and run make again." >&2; exit 1; fi; }
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -r requirements.txt
	@touch $(STAMP)

setup: $(STAMP)

## JupyterLab on the notebooks (widgets render: ipywidgets 8, JupyterLab 4)
lab: setup
	$(PY) -m jupyter lab --notebook-dir=notebooks $(if $(filter 0,$(shell id -u)),--allow-root)

## Everything: lint; the unit tests on both cores (pytest-xdist: each test runs on one thread, tests/conftest.py);
## then the notebooks through nbval and the browser tests, one at a time (the browser tests time the explorer)
WORKERS ?= 2
test: setup browser data lint
	$(PY) -m pytest tests -m "not e2e" -n $(WORKERS) -p no:randomly
	$(PY) -m pytest notebooks tests/e2e --nbval-lax --nbval-current-env \
		--nbval-sanitize-with tests/nbval_sanitize.cfg -p no:randomly

## Unit tests only (quick)
unit: setup lint
	$(PY) -m pytest tests -m "not e2e" -n $(WORKERS)

## ruff, and the layers of docs/layout.md (import-linter; the contract is in pyproject.toml)
lint: setup
	$(PY) -m ruff check .
	$(VENV)/bin/lint-imports

## Side-by-side timing tables in the terminal (the README's Performance section), plot in bench-out/
bench: setup
	@mkdir -p bench-out
	$(PY) -m pergrad_viz bench --quantity grads --batch-sizes 2,32,128 --hidden 20 --peers all \
		--csv bench-out/grads.csv --plot bench-out/grads.png
	$(PY) -m pergrad_viz bench --quantity jacobian --batch-sizes 2,32,128 --hidden 20 \
		--csv bench-out/jacobian.csv --plot bench-out/jacobian.png
	$(PY) -m pergrad_viz bench --quantity grads --batch-sizes 64 --hidden 20 --strategies all --peers all --norms
	$(PY) -m pergrad_viz bench --quantity grads --batch-sizes 64 --hidden 512 --strategies loop,torch_func,auto \
		--out-buffer --peers all --norms
	$(PY) -m pergrad_viz bench --quantity grads --batch-sizes 256 --hidden 20 --strategies torch_func,auto \
		--chunk-sizes 32,64
	for m in mlp transformer lstm scaleshift parent-param bilinear; do \
		$(PY) -m pergrad_viz bench --model $$m --strategies all --peers all --norms || exit 1; done
	for m in resnet18 mobilenet; do \
		$(PY) -m pergrad_viz bench --model $$m --strategies all --peers all --norms --slow-limit 512 || exit 1; done
	$(PY) -m pergrad_viz bench --targets
	$(PY) -m pergrad_viz scan-bench --model cnn --limit 8192 --rounds 5
	$(PY) -m pergrad_viz scan-bench --model mlp --limit 32768 --rounds 5

## Debian's Chromium for the browser tests (never `playwright install`: it downloads)
browser:
	@test -x $(CHROMIUM) || { echo "installing Debian's chromium for the browser tests"; \
		(apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium) \
		|| echo "could not install chromium: the browser tests will skip (and fail under CI=true)"; }

## Debian's full Fashion-MNIST (60,000 + 10,000 images) in data/fashion-mnist/ (links); without it, the bundled sample
FASHION_MNIST ?= /usr/share/datasets/fashion-mnist
FASHION_FILES := train-images-idx3-ubyte train-labels-idx1-ubyte t10k-images-idx3-ubyte t10k-labels-idx1-ubyte
data:
	@test -f $(FASHION_MNIST)/train-images-idx3-ubyte.gz || { echo "installing Debian's dataset-fashion-mnist"; \
		(apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq dataset-fashion-mnist) \
		|| echo "could not install dataset-fashion-mnist: scans will use the bundled 1,000-image sample"; }
	@if test -f $(FASHION_MNIST)/train-images-idx3-ubyte.gz; then mkdir -p data/fashion-mnist && \
		for f in $(FASHION_FILES); do ln -sf $(FASHION_MNIST)/$$f.gz data/fashion-mnist/$$f.gz; done && \
		echo "data/fashion-mnist/: the full Fashion-MNIST (links to $(FASHION_MNIST))"; fi

clean:
	rm -rf $(VENV) test-artifacts bench-out
