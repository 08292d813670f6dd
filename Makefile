# Convenience wrapper around CMake: `make` builds everything into build/
# (the CLI is build/mha), `make check` builds and runs the whole test suite.
BUILD ?= build
CMAKE_FLAGS ?=
JOBS ?= $(shell nproc 2>/dev/null || echo 2)

.PHONY: all check test install clean asan scalar tsan

# The build system CMake generates (build.ninja under CMAKE_GENERATOR=Ninja)
# is what the configure rule makes: a configure that failed or was
# interrupted leaves CMakeCache.txt without it, and the next make configures
# again (tests/make/test_reconfigure.sh).
GENERATED = $(BUILD)/$(if $(filter Ninja%,$(CMAKE_GENERATOR)),build.ninja,Makefile)

all: $(GENERATED)
	cmake --build $(BUILD) -j $(JOBS)

$(GENERATED):
	cmake -S . -B $(BUILD) -DCMAKE_BUILD_TYPE=Release $(CMAKE_FLAGS)

# (every test has its own time limit, tests/CMakeLists.txt; --timeout is
# the backstop for one that would lack it). The last line names the
# suites that were skipped and why (under CI=true a skip is a failure).
CTEST = ctest --output-on-failure -j $(JOBS) --timeout 1800
# $(call ctest_in,DIR,ARGS): the suite in DIR, then its skipped line; the
# shell's rc holds ctest's status
ctest_in = rm -rf $(1)/Testing/skips; cd $(1) && $(CTEST) $(2); rc=$$?; \
  cd $(CURDIR) && sh scripts/skipped.sh $(1)
check test: all
	$(call ctest_in,$(BUILD)); exit $$rc

# What the sanitizer and scalar builds leave out, and why (each stage tests
# its own build: pip builds the Python extension with its own flags, not
# this tree's)
LEFT_OUT = left out of this build: python_torch1, python_torch2 (pip builds their extension \
  with its own flags, not this build's: MHA_PYTHON_TESTS=OFF) and hf_checkpoints' Python-API \
  tests (test_cached, test_backward; its tests through this build's mha run)

# AddressSanitizer + UndefinedBehaviorSanitizer build and the whole test
# suite in build-asan/ (-O1: the sanitizers' checks at a speed CI affords;
# any report fails the test), but for the sentence-transformers comparison
# of examples/embed (5 minutes under the sanitizers on a 2-core machine; its
# tokenizer has test_embed_tokenizer here, its attention the library's
# tests) and the README's training run (4.5 minutes under the sanitizers:
# 1000 steps of the loop that test_tiny and demo_heads run here)
ASAN_SKIP ?= embed_vs_sentence_transformers|readme_train
asan:
	cmake -S . -B build-asan -DCMAKE_BUILD_TYPE=None \
	  -DCMAKE_C_FLAGS="-O1 -g -fsanitize=address,undefined -fno-omit-frame-pointer -fno-sanitize-recover=all" \
	  -DMHA_PYTHON_TESTS=OFF -DMHA_TEST_TIMEOUT_SCALE=4 -DMHA_CONFORMANCE_PERCENT=25
	cmake --build build-asan -j $(JOBS)
	$(call ctest_in,build-asan,$(if $(ASAN_SKIP),-E '$(ASAN_SKIP)')); echo "$(LEFT_OUT)"; \
	  echo "left out of make asan: $(ASAN_SKIP) (5 and 4.5 minutes under the sanitizers;" \
	       "the first's tokenizer is test_embed_tokenizer's, its attention the library" \
	       "suites'; the second's training loop is test_tiny's and demo_heads')"; \
	  exit $$rc

# Only the portable scalar kernels (no AVX2/AVX-512 code compiled), the
# whole test suite in build-scalar/
scalar:
	cmake -S . -B build-scalar -DCMAKE_BUILD_TYPE=Release -DMHA_SCALAR_ONLY=ON \
	  -DMHA_PYTHON_TESTS=OFF -DMHA_TEST_TIMEOUT_SCALE=2
	cmake --build build-scalar -j $(JOBS)
	$(call ctest_in,build-scalar); echo "$(LEFT_OUT)"; exit $$rc

# The concurrency stress under ThreadSanitizer (tests/tsan.sh)
tsan:
	tests/tsan.sh build-tsan

install: all
	cmake --install $(BUILD)

clean:
	rm -rf $(BUILD) build-asan build-scalar build-tsan
