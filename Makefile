# Convenience wrapper around CMake: `make` builds everything into build/
# (the CLI is build/mha), `make check` builds and runs the whole test suite.
BUILD ?= build
CMAKE_FLAGS ?=
JOBS ?= $(shell nproc 2>/dev/null || echo 2)

.PHONY: all check test install clean asan scalar tsan

all: $(BUILD)/CMakeCache.txt
	cmake --build $(BUILD) -j $(JOBS)

$(BUILD)/CMakeCache.txt:
	cmake -S . -B $(BUILD) -DCMAKE_BUILD_TYPE=Release $(CMAKE_FLAGS)

check test: all
	cd $(BUILD) && ctest --output-on-failure -j $(JOBS)

# AddressSanitizer + UndefinedBehaviorSanitizer build and the whole test
# suite in build-asan/ (-O1: the sanitizers' checks at a speed CI affords;
# any report fails the test), but for the sentence-transformers comparison
# of examples/embed (5 minutes under the sanitizers on a 2-core machine; its
# tokenizer has test_embed_tokenizer here, its attention the library's
# tests)
ASAN_SKIP ?= embed_vs_sentence_transformers
asan:
	cmake -S . -B build-asan -DCMAKE_BUILD_TYPE=None \
	  -DCMAKE_C_FLAGS="-O1 -g -fsanitize=address,undefined -fno-omit-frame-pointer -fno-sanitize-recover=all" \
	  -DMHA_PYTHON_TESTS=OFF
	cmake --build build-asan -j $(JOBS)
	cd build-asan && ctest --output-on-failure -j $(JOBS) $(if $(ASAN_SKIP),-E '$(ASAN_SKIP)')

# Only the portable scalar kernels (no AVX2/AVX-512 code compiled), the
# whole test suite in build-scalar/
scalar:
	cmake -S . -B build-scalar -DCMAKE_BUILD_TYPE=Release -DMHA_SCALAR_ONLY=ON \
	  -DMHA_PYTHON_TESTS=OFF
	cmake --build build-scalar -j $(JOBS)
	cd build-scalar && ctest --output-on-failure -j $(JOBS)

# The concurrency stress under ThreadSanitizer (tests/tsan.sh)
tsan:
	tests/tsan.sh build-tsan

install: all
	cmake --install $(BUILD)

clean:
	rm -rf $(BUILD) build-asan build-scalar build-tsan
