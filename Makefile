# hetcoll: the two set-up commands of the README are `make demo` and `make test`.
# Both create the virtualenv, install every dependency and build the Rust extension on first use.

VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.deps-stamp
BUILT  := $(VENV)/.build-stamp
export OMP_NUM_THREADS ?= 1
RUST_SOURCES := $(shell find rust -name '*.rs' -o -name Cargo.toml 2>/dev/null) Cargo.toml

.PHONY: demo test build wheel device-check lint rust-test py-test fuzz bench bench-rust clean

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet --group test
	touch $@

# The extension is an abi3 build (_core.abi3.so); a _core.cpython-3XX-*.so left by an older
# build would shadow it (Python prefers the version-tagged name), so it goes first.
$(BUILT): $(STAMP) $(RUST_SOURCES)
	rm -f python/hetcoll/_core.cpython-*.so
	VIRTUAL_ENV=$(abspath $(VENV)) $(VENV)/bin/maturin develop --release --quiet
	touch $@

build: $(BUILT)

# The wheel users install and the GPU machine carries (benches/device/README.md): one abi3
# build for CPython >= 3.10 (PyO3's abi3-py310), linked by zig against glibc 2.28
# (manylinux_2_28, what PyTorch's own wheels need), so no Rust toolchain is needed where it
# is installed.
WHEELED := $(VENV)/.wheel-stamp
$(WHEELED): $(STAMP) pyproject.toml
	$(PY) -m pip install --quiet --group wheel
	touch $@

wheel: $(WHEELED)
	rm -f dist/hetcoll-*.whl
	PATH=$(abspath $(VENV))/bin:$$PATH VIRTUAL_ENV=$(abspath $(VENV)) $(VENV)/bin/maturin build \
		--release --zig --compatibility manylinux_2_28 --out dist

# The GPU machine's check (benches/device/run.sh): the CUDA tests, real heterogeneity (one GPU
# rank beside CPU ranks) and the GPU kernels, from the wheel in dist/; without CUDA, a dry
# run on the CPU that says what it skipped. DEVICE_OUT: where its JSON and log go.
DEVICE_OUT ?= out/device
device-check: wheel
	PYTHON=$(abspath $(PY)) bash benches/device/run.sh $(DEVICE_OUT)

demo: $(BUILT)
	$(VENV)/bin/hetcoll demo

lint: $(STAMP)
	cargo fmt --all -- --check
	cargo clippy --workspace --all-targets --quiet -- -D warnings
	$(VENV)/bin/ruff check python tests benches examples
	$(VENV)/bin/ruff format --check python tests benches examples
	$(VENV)/bin/python -m mypy python/hetcoll examples benches
	$(VENV)/bin/lint-imports --no-cache

rust-test:
	cargo test -p hetcoll-core --quiet

py-test: $(BUILT)
	$(PY) -m mypy.stubtest hetcoll._core
	# Tests of one process each run one per core (pytest-xdist); those launching several ranks
	# (marked multiproc) run after them, two at a time, each file's tests on one worker (the
	# jobs and fixtures a file's tests share run once): one test alone leaves the cores idle
	# about a quarter of the time (launchers' imports, a rank's serial set-up, waits), which
	# the other fills. Each part prints its slowest, for keeping the suite short.
	$(PY) -m pytest -q -m "not multiproc" -n auto --durations=10
	$(PY) -m pytest -q -m multiproc -n 2 --dist loadfile --durations=25

test: $(BUILT) lint rust-test py-test

# The hostile-input properties of `make test` (tests/test_hostile.py, the core's
# tests/hostile_props.rs) with many more examples: minutes, not seconds.
FUZZ_EXAMPLES ?= 3000
FUZZ_CASES    ?= 20000
fuzz: $(BUILT)
	PROPTEST_CASES=$(FUZZ_CASES) cargo test -p hetcoll-core --release --quiet --test hostile_props
	HETCOLL_FUZZ_EXAMPLES=$(FUZZ_EXAMPLES) $(PY) -m pytest -q -p no:cacheprovider \
		-o timeout=3600 tests/test_hostile.py

# Benchmarks: each writes benches/results/<name>.json (the scripts that keep their own JSON
# write it under benches/results/raw/, and `benches/report.py import` converts it), then
# bench-report renders every results file into docs/benchmarks.md. The benchmark-only
# dependencies (the `bench` group: Mt-KaHyPar, scipy) are installed here, not by `make test`.
RESULTS := benches/results
RAW     := $(RESULTS)/raw
BENCHED := $(VENV)/.bench-stamp
PYBENCH := $(PY) -m pytest -p no:cacheprovider -o python_files='bench_*.py' -q -s \
	--benchmark-columns=median,iqr,rounds --benchmark-sort=name
COLLECTIVES_RUN    := benches/bench_collectives.py --ranks 2 4 --max-mib 256 --json $(RAW)/collectives.json
FILTER_PARALLEL_RUN := benches/bench_filter_parallel.py --json $(RAW)/filter_parallel.json
PLANS_RUN          := benches/bench_plans.py --launches 3 --json $(RAW)/plans.json
LM_PIPELINE_RUN    := benches/bench_lm_pipeline.py --launches 3 --json $(RAW)/lm_pipeline.json
TENSOR_PARALLEL_RUN := benches/bench_tensor_parallel.py --batch 32 --steps 20 \
	--json $(RAW)/tensor_parallel.json
TENSOR_PARALLEL_MOE_RUN := benches/bench_tensor_parallel.py --arch mixtral --batch 32 \
	--steps 20 --json $(RAW)/tensor_parallel_moe.json
TENSOR_PARALLEL_LORA_RUN := benches/bench_tensor_parallel.py --arch llama-lora --batch 32 \
	--steps 20 --json $(RAW)/tensor_parallel_lora.json
TENSOR_PARALLEL_DORA_RUN := benches/bench_tensor_parallel.py --arch llama-dora --batch 32 \
	--steps 20 --json $(RAW)/tensor_parallel_dora.json
EXPERT_PARALLEL_RUN := benches/bench_expert_parallel.py --batch 32 --steps 20 \
	--json $(RAW)/expert_parallel.json
PLACEMENT_RUN      := benches/bench_placement.py --launches 3 --json $(RESULTS)/placement.json \
	--plot docs/img/placement.png

.PHONY: bench-report bench-kernels bench-split bench-partition bench-partitioners bench-planner \
	bench-data-parallel bench-collectives bench-filter-parallel bench-model-validate bench-plans \
	bench-microbatches bench-planspace bench-placement bench-lm-pipeline bench-tensor-parallel \
	bench-tensor-parallel-moe bench-tensor-parallel-lora bench-tensor-parallel-dora \
	bench-expert-parallel bench-fixed-costs bench-step-timer bench-step-overhead \
	bench-trainer-rebalance bench-fsdp-rebalance bench-full-state bench-grouped-convs bench-compiled

$(BENCHED): $(STAMP) pyproject.toml
	$(PY) -m pip install --quiet --group bench
	touch $@

bench: bench-kernels bench-split bench-partition bench-partitioners bench-planner \
		bench-data-parallel bench-collectives bench-filter-parallel bench-model-validate \
		bench-microbatches bench-plans bench-planspace bench-placement bench-lm-pipeline \
		bench-tensor-parallel bench-tensor-parallel-moe bench-tensor-parallel-lora \
		bench-tensor-parallel-dora bench-expert-parallel bench-fixed-costs bench-step-timer \
		bench-step-overhead bench-trainer-rebalance bench-fsdp-rebalance bench-full-state \
		bench-grouped-convs bench-compiled
	$(MAKE) bench-report

bench-report:
	$(PY) benches/report.py --readme README.md

bench-kernels: $(BUILT) $(BENCHED)
	$(PYBENCH) benches/bench_kernels.py --results-json $(RESULTS)/kernels.json \
		--results-title "Core kernel: weighted sum of K buffers"

bench-step-timer: $(BUILT) $(BENCHED)
	$(PYBENCH) benches/bench_step_timer.py --results-json $(RESULTS)/step_timer.json \
		--results-title "StepTimer: what timing a rank's own compute adds to a step"

bench-grouped-convs: $(BUILT) $(BENCHED)
	$(PYBENCH) benches/bench_grouped_convs.py --results-json $(RESULTS)/grouped_convs.json \
		--results-title "Filter parallelism across grouped convolutions: ResNeXt and RegNet"

bench-step-overhead: $(BUILT) $(BENCHED)
	$(PYBENCH) benches/bench_step_overhead.py --results-json $(RESULTS)/step_overhead.json \
		--results-title "parallelize's own work a step: one rank against the bare step"

bench-compiled: $(BUILT) $(BENCHED)
	$(PYBENCH) benches/bench_compiled.py --results-json $(RESULTS)/compiled.json \
		--results-title "torch.compile of a plan block by block: compiled blocks against eager"

bench-trainer-rebalance: $(BUILT) $(BENCHED)
	$(PYBENCH) benches/bench_trainer_rebalance.py --results-json $(RESULTS)/trainer_rebalance.json \
		--results-title "Hugging Face Trainer: BalancedTrainer rebalancing at emulated speeds 1 and 0.5"

bench-fsdp-rebalance: $(BUILT) $(BENCHED)
	$(PYBENCH) benches/bench_fsdp_rebalance.py --results-json $(RESULTS)/fsdp_rebalance.json \
		--results-title "FSDP2: weigh_loss, StepTimer and Rebalancer at emulated speeds 1 and 0.5"

bench-full-state: $(BUILT) $(BENCHED)
	$(PYBENCH) benches/bench_full_state.py --results-json $(RESULTS)/full_state.json \
		--results-title "Full state dicts of a split model through DCP, against FSDP2's"

bench-split: $(BUILT) $(BENCHED)
	$(PYBENCH) benches/bench_split.py --results-json $(RESULTS)/split.json \
		--results-title "Split solver at cluster scale"

bench-partition: $(BUILT) $(BENCHED)
	$(PYBENCH) benches/bench_partition.py --results-json $(RESULTS)/partition.json \
		--results-title "Partitioners: speed against named peers"

bench-partitioners: $(BUILT) $(BENCHED)
	$(PY) benches/compare_partitioners.py --json $(RESULTS)/partitioners.json

bench-planner: $(BUILT) $(BENCHED)
	$(PYBENCH) benches/bench_model.py --results-json $(RESULTS)/planner.json \
		--results-title "Planner speed"

bench-data-parallel: $(BUILT) $(BENCHED)
	$(PYBENCH) benches/bench_data_parallel.py --results-json $(RESULTS)/data_parallel.json \
		--results-title "Balanced data parallelism (the demo's job and a user's job)"

bench-collectives: $(BUILT) $(BENCHED)
	mkdir -p $(RAW)
	$(PY) $(COLLECTIVES_RUN)
	$(PY) benches/report.py import collectives $(RAW)/collectives.json \
		--command "python $(COLLECTIVES_RUN)"

bench-filter-parallel: $(BUILT) $(BENCHED)
	mkdir -p $(RAW)
	$(PY) $(FILTER_PARALLEL_RUN)
	$(PY) benches/report.py import filter-parallel $(RAW)/filter_parallel.json \
		--command "python $(FILTER_PARALLEL_RUN)"

bench-model-validate: $(BUILT) $(BENCHED)
	mkdir -p $(RAW)
	$(VENV)/bin/hetcoll model validate --repeat 3 --json > $(RAW)/model_validate.json
	$(PY) benches/report.py import model-validate $(RAW)/model_validate.json \
		--command "hetcoll model validate --repeat 3 --json > $(RAW)/model_validate.json"

bench-microbatches: $(BUILT) $(BENCHED)
	mkdir -p $(RAW)
	$(PY) benches/bench_microbatches.py --json $(RAW)/microbatches.json
	$(PY) benches/report.py import microbatches $(RAW)/microbatches.json \
		--command "python benches/bench_microbatches.py --json $(RAW)/microbatches.json"

bench-fixed-costs: $(BUILT) $(BENCHED)
	mkdir -p $(RAW)
	$(PY) benches/bench_fixed_costs.py --json $(RAW)/fixed_costs.json
	$(PY) benches/report.py import fixed-costs $(RAW)/fixed_costs.json \
		--command "python benches/bench_fixed_costs.py --json $(RAW)/fixed_costs.json"

bench-planspace: $(BUILT) $(BENCHED)
	mkdir -p $(RAW)
	$(PY) benches/bench_planspace.py --rounds 5 --json $(RAW)/planspace.json
	$(PY) benches/report.py import planspace $(RAW)/planspace.json \
		--command "python benches/bench_planspace.py --rounds 5 --json $(RAW)/planspace.json"

bench-plans: $(BUILT) $(BENCHED)
	mkdir -p $(RAW)
	$(PY) $(PLANS_RUN)
	$(PY) benches/report.py import plans $(RAW)/plans.json --command "python $(PLANS_RUN)"

bench-lm-pipeline: $(BUILT) $(BENCHED)
	mkdir -p $(RAW)
	$(PY) $(LM_PIPELINE_RUN)
	$(PY) benches/report.py import lm-pipeline $(RAW)/lm_pipeline.json \
		--command "python $(LM_PIPELINE_RUN)"

bench-tensor-parallel: $(BUILT) $(BENCHED)
	mkdir -p $(RAW)
	$(PY) $(TENSOR_PARALLEL_RUN)
	$(PY) benches/report.py import tensor-parallel $(RAW)/tensor_parallel.json \
		--command "python $(TENSOR_PARALLEL_RUN)"

bench-tensor-parallel-moe: $(BUILT) $(BENCHED)
	mkdir -p $(RAW)
	$(PY) $(TENSOR_PARALLEL_MOE_RUN)
	$(PY) benches/report.py import tensor-parallel $(RAW)/tensor_parallel_moe.json \
		--command "python $(TENSOR_PARALLEL_MOE_RUN)"

bench-tensor-parallel-lora: $(BUILT) $(BENCHED)
	mkdir -p $(RAW)
	$(PY) $(TENSOR_PARALLEL_LORA_RUN)
	$(PY) benches/report.py import tensor-parallel $(RAW)/tensor_parallel_lora.json \
		--command "python $(TENSOR_PARALLEL_LORA_RUN)"

bench-tensor-parallel-dora: $(BUILT) $(BENCHED)
	mkdir -p $(RAW)
	$(PY) $(TENSOR_PARALLEL_DORA_RUN)
	$(PY) benches/report.py import tensor-parallel $(RAW)/tensor_parallel_dora.json \
		--command "python $(TENSOR_PARALLEL_DORA_RUN)"

bench-expert-parallel: $(BUILT) $(BENCHED)
	mkdir -p $(RAW)
	$(PY) $(EXPERT_PARALLEL_RUN)
	$(PY) benches/report.py import expert-parallel $(RAW)/expert_parallel.json \
		--command "python $(EXPERT_PARALLEL_RUN)"

# Seed 002's comparison: writes its results file and docs/img/placement.png itself.
bench-placement: $(BUILT) $(BENCHED)
	$(PY) $(PLACEMENT_RUN)

bench-rust:
	cargo bench -p hetcoll-core

clean:
	rm -rf target $(VENV) .pytest_cache .benchmarks
