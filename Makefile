# hetcoll: the two set-up commands of the README are `make demo` and `make test`.
# Both create the virtualenv, install every dependency and build the Rust extension on first use.

VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.deps-stamp
BUILT  := $(VENV)/.build-stamp
export OMP_NUM_THREADS ?= 1
RUST_SOURCES := $(shell find rust -name '*.rs' -o -name Cargo.toml 2>/dev/null) Cargo.toml

.PHONY: demo test build lint rust-test py-test bench bench-rust clean

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet --group test
	touch $@

$(BUILT): $(STAMP) $(RUST_SOURCES)
	VIRTUAL_ENV=$(abspath $(VENV)) $(VENV)/bin/maturin develop --release --quiet
	touch $@

build: $(BUILT)

demo: $(BUILT)
	$(VENV)/bin/hetcoll demo

lint: $(STAMP)
	cargo fmt --all -- --check
	cargo clippy --workspace --all-targets --quiet -- -D warnings
	$(VENV)/bin/ruff check python tests benches examples
	$(VENV)/bin/ruff format --check python tests benches examples
	$(VENV)/bin/python -m mypy python/hetcoll examples
	$(VENV)/bin/lint-imports --no-cache

rust-test:
	cargo test -p hetcoll-core --quiet

py-test: $(BUILT)
	$(PY) -m mypy.stubtest hetcoll._core
	$(PY) -m pytest -q

test: $(BUILT) lint rust-test py-test

# pytest-benchmark suites (ratio tables at the end), then the script benchmarks that launch
# their own ranks; each prints the figures the README quotes.
bench: $(BUILT)
	$(PY) -m pytest benches -o python_files='bench_*.py' -q -s \
		--benchmark-columns=median,iqr,rounds --benchmark-sort=name
	$(PY) benches/bench_collectives.py --ranks 2 4 --max-mib 256
	$(PY) benches/bench_filter_parallel.py

bench-rust:
	cargo bench -p hetcoll-core

clean:
	rm -rf target $(VENV) .pytest_cache .benchmarks
